"""Layer wrapping and activation checkpointing, under real launches."""

from __future__ import annotations

import pytest
from conftest import EIGHT_STEPS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("engine", ["ddp", "zero1", "zero2", "zero3", "fsdp2"])
def test_gradient_checkpointing_keeps_the_loss_and_saves_activations(runs, run_layout, small_model, engine):
    """--gradient_checkpointing recomputes each block in backward: the same losses (fp32, bitwise up to
    summation order) and far fewer bytes saved for backward (measured with autograd's saved-tensor hooks)."""
    plain = run_layout(engine, 2, 4, 1)
    checkpointed = runs(f"gc-{engine}", *EIGHT_STEPS, "--model", small_model, "--per_device_batch_size", "4",
                        "--gradient_checkpointing", config=engine, mixed_precision="no").check()
    assert [m["loss"] for m in checkpointed.metrics()] == pytest.approx([m["loss"] for m in plain.metrics()],
                                                                        rel=1e-6)
    saved, saved_plain = checkpointed.summary()["saved_activation_bytes"], plain.summary()["saved_activation_bytes"]
    assert 0 < saved < 0.5 * saved_plain


def _tiny_configs(tokenizer) -> dict:
    """A 2-block model of each family, built from a config (no download), with the bundled tokenizer."""
    from transformers import (
        GemmaConfig,
        GPT2Config,
        GPTNeoXConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        PhiConfig,
        Qwen2Config,
        Qwen2MoeConfig,
    )

    ids = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    decoder = {**ids, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 256}
    return {
        "llama": (LlamaConfig(**decoder), "LlamaDecoderLayer"),
        "mistral": (MistralConfig(**decoder, sliding_window=None), "MistralDecoderLayer"),
        "qwen2": (Qwen2Config(**decoder), "Qwen2DecoderLayer"),
        "qwen2_moe": (Qwen2MoeConfig(**decoder, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                     num_experts=4, num_experts_per_tok=2), "Qwen2MoeDecoderLayer"),
        "mixtral": (MixtralConfig(**decoder, num_local_experts=4, num_experts_per_tok=2), "MixtralDecoderLayer"),
        "gemma": (GemmaConfig(**decoder, head_dim=16), "GemmaDecoderLayer"),
        "phi": (PhiConfig(**{k: v for k, v in decoder.items() if k != "num_key_value_heads"}), "PhiDecoderLayer"),
        "gpt2": (GPT2Config(**ids, n_embd=64, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0), "GPT2Block"),
        "gpt_neox": (GPTNeoXConfig(**{k: v for k, v in decoder.items() if k != "num_key_value_heads"}),
                     "GPTNeoXLayer"),
    }


FAMILIES = ["llama", "mistral", "qwen2", "qwen2_moe", "mixtral", "gemma", "phi", "gpt2", "gpt_neox"]


@pytest.fixture(scope="module")
def family_model(session_root):
    from conftest import REPO
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "zero_utils/assets/tiny-llama")
    configs = _tiny_configs(tokenizer)

    def get(family: str):
        config, block = configs[family]
        path = session_root / f"family-{family}"
        if not path.exists():
            config.save_pretrained(path)
            tokenizer.save_pretrained(path)
        return str(path), block, config
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_shards_block_by_block_and_trains_as_one_process(runs, family_model, family):
    model, block, config = family_model(family)
    args = ("--model", model, "--max_steps", "3", "--seq_len", "64", "--eval_fraction", "0",
            "--max_new_tokens", "0", "--report_to", "none", "--warmup_steps", "1")
    sharded = runs(f"family-{family}-fsdp2", *args, "--per_device_batch_size", "2", config="fsdp2",
                   mixed_precision="no").check()
    single = runs(f"family-{family}-single", *args, "--per_device_batch_size", "4", num_processes=1,
                  mixed_precision="no").check()
    losses = [m["loss"] for m in sharded.metrics()]
    assert all(loss == loss and loss < 100 for loss in losses)
    assert losses == pytest.approx([m["loss"] for m in single.metrics()], rel=1e-4)
    for evidence in sharded.summary()["sharding_per_rank"]:
        assert evidence["fsdp_units"].get(block) == 2  # each of the 2 blocks is its own FSDP unit
        assert 0.45 < evidence["local_param_fraction"] <= 0.55
