"""DeepSpeed's fp32 master, restored from a checkpoint whose parameters transformers converts on load: a Mixtral
folder as `save_pretrained` writes it (per-expert w1/w2/w3 and `block_sparse_moe.gate` on disk; fused
`experts.gate_up_proj` / `down_proj` and `mlp.gate` in the model). bf16, --lr 0, one step, under ZeRO-1 and
zero3_offload (2 launches): the exported fp32 weights are the master, and every tensor equals what
`from_pretrained(dtype=float32)` loads, bit for bit (a master rebuilt from the bf16 cast would differ)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FLAGS = ("--max_steps", "1", "--lr", "0", "--warmup_steps", "0", "--seq_len", "64", "--per_device_batch_size", "1",
         "--eval_fraction", "0", "--max_new_tokens", "0", "--report_to", "none")


@pytest.fixture(scope="module")
def mixtral(session_root):
    from conftest import REPO
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig

    path = session_root / "mixtral-fp32"
    tokenizer = AutoTokenizer.from_pretrained(REPO / "zero_utils/assets/tiny-llama")
    config = MixtralConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.3.w1.weight" in keys and not any("gate_up_proj" in k for k in keys)
    return path


@pytest.mark.parametrize("config", ["zero1", "zero3_offload"])
def test_the_fp32_master_of_converted_parameters_is_the_checkpoints(runs, mixtral, config):
    from transformers import AutoModelForCausalLM

    run = runs(f"master-mixtral-{config}", *FLAGS, "--model", str(mixtral), config=config,
               mixed_precision="bf16").check()
    assert "were found neither by name nor through" not in run.output  # nothing left unmatched
    exported = load_file(run.output_dir / "final" / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(mixtral, dtype=torch.float32).state_dict()
    assert set(exported) == set(reference) - {"lm_head.weight"} or set(exported) == set(reference)
    unequal = [name for name, tensor in exported.items() if not torch.equal(tensor, reference[name])]
    assert not unequal, unequal
