"""Model loading, in process: what every rank does with pretrained weights, quantized or not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zero_utils.assets import BUNDLED_MODEL
from zero_utils.model.loading import load_causal_lm
from zero_utils.run.errors import UserError

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
    from zero_utils.model.qlora import quantization_config

    assert quantization_config(False) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--qlora needs a CUDA GPU"):
        quantization_config(True)


def test_qlora_of_a_config_only_model_is_refused():
    with pytest.raises(UserError, match="--qlora quantizes pretrained weights, but --model .* holds only a config"):
        load_causal_lm(BUNDLED_MODEL, accelerator=fsdp2_rank(True), quantization_config=bnb_4bit())


def test_parameters_transformers_converts_on_load_are_named_not_skipped(tmp_path):
    """A Mixtral checkpoint as `save_pretrained` writes it holds per-expert w1/w2/w3 tensors and
    `block_sparse_moe.gate`, while the loaded model's parameters are the fused `experts.gate_up_proj` /
    `experts.down_proj` and `mlp.gate`: exactly those are unmatched by name (the DeepSpeed fp32-master restore then
    says so in one line instead of skipping them silently)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, MixtralConfig

    from zero_utils.model.deepspeed_setup import _safetensors_files, unmatched_trainable

    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    [path] = _safetensors_files(str(tmp_path))
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys  # per-expert tensors on disk
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    fused = {f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    renamed = {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}  # block_sparse_moe.gate on disk
    assert {f"model.layers.{i}.block_sparse_moe.gate.weight" for i in range(2)} <= keys
    assert set(unmatched_trainable(loaded, keys)) == fused | renamed
    assert unmatched_trainable(loaded, set()) == []  # a config-only folder: nothing to restore, nothing to say


def test_converted_parameters_are_rebuilt_as_transformers_loads_them(tmp_path):
    """The fp32 master of a parameter transformers builds on load (Mixtral's fused experts, its renamed router) is
    rebuilt from the checkpoint through transformers' own conversion: equal, bit for bit, to what
    `from_pretrained(dtype=float32)` holds."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from zero_utils.model.deepspeed_setup import _safetensors_files, converted_tensors, unmatched_trainable

    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    files = _safetensors_files(str(tmp_path))
    wanted = set(unmatched_trainable(loaded, set().union(*files.values())))
    rebuilt = dict(converted_tensors(loaded, files, wanted))
    assert set(rebuilt) == wanted and len(wanted) == 6
    params = dict(loaded.named_parameters())
    for name, tensor in rebuilt.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, params[name]), name


def test_a_model_folder_under_home_written_with_a_tilde_loads(saved_model, tmp_path, monkeypatch):
    """`--model ~/model` (a --config YAML's value, which no shell expands): config, tokenizer and weights load from
    $HOME/model, the weights equal to the folder's; before, transformers took '~/model' for a Hub id."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zero_utils.model.loading import load_config, load_tokenizer

    shutil.copytree(saved_model, tmp_path / "model")
    AutoTokenizer.from_pretrained(BUNDLED_MODEL).save_pretrained(tmp_path / "model")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_config("~/model").model_type == "llama" and len(load_tokenizer("~/model")) == 872
    loaded = load_causal_lm("~/model").state_dict()
    saved = AutoModelForCausalLM.from_pretrained(saved_model).state_dict()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
