"""Model loading, in process: what every rank does with pretrained weights, quantized or not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zero_utils.errors import UserError
from zero_utils.model import BUNDLED_MODEL, load_causal_lm

pytestmark = pytest.mark.unit


def fsdp2_rank(is_main_process: bool):
    """What `load_causal_lm` reads of an FSDP2 launch of 2 processes with `fsdp_cpu_ram_efficient_loading: true`."""
    plugin = SimpleNamespace(cpu_ram_efficient_loading=True)
    return SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), num_processes=2, is_main_process=is_main_process)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("saved-llama")
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BUNDLED_MODEL)).save_pretrained(path)
    return str(path)


def bnb_4bit():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                              bnb_4bit_quant_storage=torch.bfloat16)


def load_error(path: str, accelerator) -> str:
    with pytest.raises(Exception) as info:
        load_causal_lm(path, accelerator=accelerator, quantization_config=bnb_4bit())
    return f"{type(info.value).__name__}: {info.value}"


def test_qlora_loads_on_a_non_main_rank_as_on_rank_0(saved_model):
    """QLoRA under an FSDP2 YAML with rank-0 loading: a non-main rank takes the same quantized load as rank 0
    (before, it passed quantization_config to from_config: a TypeError). Without a GPU and bitsandbytes the load
    itself stops in transformers' quantizer check, on both ranks alike; on a GPU node it quantizes."""
    on_rank_0, on_rank_1 = load_error(saved_model, fsdp2_rank(True)), load_error(saved_model, fsdp2_rank(False))
    assert on_rank_1 == on_rank_0 and "TypeError" not in on_rank_1


def test_unquantized_non_main_rank_still_waits_for_rank_0_on_meta(saved_model):
    model = load_causal_lm(saved_model, accelerator=fsdp2_rank(False))
    assert all(p.is_meta for p in model.parameters())


def test_qlora_needs_a_cuda_gpu_and_is_off_by_default(monkeypatch):
    from zero_utils.qlora import quantization_config

    assert quantization_config(False) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--qlora needs a CUDA GPU"):
        quantization_config(True)


def test_qlora_of_a_config_only_model_is_refused():
    with pytest.raises(UserError, match="--qlora quantizes pretrained weights, but --model .* holds only a config"):
        load_causal_lm(BUNDLED_MODEL, accelerator=fsdp2_rank(True), quantization_config=bnb_4bit())
