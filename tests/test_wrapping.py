"""Layer wrapping and activation checkpointing, under real launches."""

from __future__ import annotations

import json

import plain_loop
import pytest
from conftest import EIGHT_STEPS, isolated_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("engine", ["ddp", "zero1", "zero2", "zero3", "fsdp2"])
def test_gradient_checkpointing_keeps_the_loss_and_saves_activations(runs, run_layout, small_model, engine):
    """--gradient_checkpointing recomputes each block in backward: the same losses (fp32, bitwise up to
    summation order) and far fewer bytes saved for backward (measured with autograd's saved-tensor hooks). Under
    FSDP2 it is switched on by the YAML's fsdp_activation_checkpointing instead (given on the launch line)."""
    plain = run_layout(engine, 2, 4, 1)
    switch = {"launch_args": ("--fsdp_activation_checkpointing", "true")} if engine == "fsdp2" else {}
    flag = () if switch else ("--gradient_checkpointing",)
    checkpointed = runs(f"gc-{engine}", *EIGHT_STEPS, "--model", small_model, "--per_device_batch_size", "4",
                        *flag, config=engine, mixed_precision="no", **switch).check()
    assert [m["loss"] for m in checkpointed.metrics()] == pytest.approx([m["loss"] for m in plain.metrics()],
                                                                        rel=1e-6)
    saved, saved_plain = checkpointed.summary()["saved_activation_bytes"], plain.summary()["saved_activation_bytes"]
    assert 0 < saved < 0.5 * saved_plain


def _tiny_configs(tokenizer) -> dict:
    """A 2-block model of each family but Llama (the engine tests' small Llama serves), built from a config (no
    download), with the bundled tokenizer."""
    from transformers import (
        GemmaConfig,
        GPT2Config,
        GPTNeoXConfig,
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


# 3 steps of a global batch of 4 rows; the FSDP2 runs use 2 ranks x 2 rows.
FAMILY_HYPER = plain_loop.Hyper(steps=3, global_batch=4)
FAMILY_ARGS = (*FAMILY_HYPER.flags(), "--per_device_batch_size", "2")


@pytest.fixture(scope="module")
def family_model(session_root):
    """`family_model(family)`: (the saved fp32 model's folder, its block class, its config); random weights, seeded,
    saved once so that the recipe's runs and the plain loop start from the same ones."""
    import torch
    from conftest import REPO
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "zero_utils/assets/tiny-llama")
    configs = _tiny_configs(tokenizer)

    def get(family: str):
        config, block = configs[family]
        path = session_root / f"family-{family}"
        if not path.exists():
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
            tokenizer.save_pretrained(path)
        return str(path), block, config
    return get


@pytest.fixture(scope="module")
def family_plain(family_model, tmp_path_factory):
    """`family_plain(family)`: the plain loop's (losses, gradient norms, trained model) for FAMILY_HYPER; the families
    share the bundled tokenizer, so their rows are packed once in one cache."""
    done, rows_cache = {}, tmp_path_factory.mktemp("family-rows")

    def get(family: str):
        if family not in done:
            done[family] = plain_loop.train(family_model(family)[0], FAMILY_HYPER, rows_cache)
        return done[family]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_shards_block_by_block_and_trains_as_a_plain_loop(run_layout, layout_plain, runs, family_model,
                                                                        family_plain, family):
    """FSDP2 wraps each decoder block of every family as its own unit and trains it as a plain PyTorch loop does
    (tests/plain_loop.py, in process). Llama: the shared 4-block run every engine test reads."""
    if family == "llama":
        sharded, plain, block, blocks = run_layout("fsdp2", 2, 4, 1), layout_plain, "LlamaDecoderLayer", 4
    else:
        model, block, _ = family_model(family)
        sharded = runs(f"family-{family}-fsdp2", *FAMILY_ARGS, "--model", model, config="fsdp2",
                       mixed_precision="no").check()
        plain, blocks = family_plain(family), 2
    plain_loop.assert_trains_as(sharded, plain)
    assert all(loss == loss and loss < 100 for loss in (m["loss"] for m in sharded.metrics()))
    for evidence in sharded.summary()["sharding_per_rank"]:
        assert evidence["fsdp_units"].get(block) == blocks  # each block is its own FSDP unit
        assert 0.45 < evidence["local_param_fraction"] <= 0.55


def test_wrapping_choices_change_what_stays_gathered(runs):
    """The three wrapping settings, all switched away from their defaults in one launch, each show their
    memory effect: the last block is resharded after forward (its bytes leave the held set), the embedding joins
    the root group (held all step), and explicit prefetching gathers the next two blocks at each block's start.
    The defaults' side is tests/test_zero_math.py's fsdp2 probe (same session run)."""
    default = runs("probe-fsdp2", recipe="tests/scripts/unsharded_after_forward.py", config="fsdp2",
                   mixed_precision="no").check()
    changed = runs("probe-fsdp2-choices", "--reshard_last_block", "--no_embedding_group", "--prefetch_blocks", "2",
                   recipe="tests/scripts/unsharded_after_forward.py", config="fsdp2", mixed_precision="no").check()
    before = json.loads((default.output_dir / "report.json").read_text())
    after = json.loads((changed.output_dir / "report.json").read_text())
    assert before["unsharded_bytes"] == before["last_block_bytes"] + before["norm_and_head_bytes"]
    assert after["unsharded_bytes"] == after["norm_and_head_bytes"] + after["embedding_bytes"]
    assert (before["max_blocks_gathered_in_forward"], after["max_blocks_gathered_in_forward"]) == (1, 3)


def test_reshard_fallback_for_older_torch_leaves_what_reset_iter_state_leaves(runs):
    """torch < 2.13 has no `reset_iter_state` (the GPU machine's image has 2.11): `reshard_after_inference` then
    calls `reshard()` on every FSDP module (`wrapping.reshard_every_group`). After an inference forward on 2 ranks
    (fsdp2.yaml: the last block and the output head stay gathered) the fallback leaves exactly what
    `reset_iter_state` leaves after the same forward: nothing registered unsharded, every parameter SHARDED. The run
    is the wrapping test's default probe."""
    run = runs("probe-fsdp2", recipe="tests/scripts/unsharded_after_forward.py", config="fsdp2",
               mixed_precision="no").check()
    after = json.loads((run.output_dir / "report.json").read_text())["after_inference"]
    for name in ("reshard_every_group", "reset_iter_state"):
        assert after[f"before_{name}"]["unsharded_bytes"] > 0  # the inference forward left groups gathered
    assert after["reshard_every_group"] == after["reset_iter_state"]
    assert after["reset_iter_state"]["unsharded_bytes"] == 0
    assert set(after["reset_iter_state"]["states"]) == {"ShardedState.SHARDED"}


@pytest.fixture(scope="module")
def pretrained_50m(session_root) -> tuple[str, int]:
    """A 49.8M-parameter Llama saved with weights (199 MB in fp32); its largest tensor is 3 MB, so the
    one-tensor-at-a-time broadcast buffer stays small next to the bound."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = session_root / "llama-50m"
    config = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=14,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                         tie_word_embeddings=False)
    if not path.exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("config", ["fsdp2", "zero3"])
def test_pretrained_weights_are_read_on_rank0_only(runs, session_root, pretrained_50m, config):
    """Loading a pretrained 50M model at 2 ranks: on rank 1 the peak RSS rises by less than (1/N + 0.1) x the
    model's bytes, under FSDP2 (rank 0 reads, the shards are broadcast) and DeepSpeed ZeRO-3 (zero.Init,
    transformers reads on rank 0), while the naive load (every rank reads the file) exceeds that bound in the same
    test. Every rank ends with exactly the file's weights.

    glibc's malloc raises its mmap threshold as large blocks are freed, after which freed multi-MB tensors stay in
    the heap and the peak RSS depends on allocation order (ZeRO-3: 0.71x to 1.5x the model in repeated runs); a
    fixed threshold makes freed tensors go back to the system, so the RSS follows the live tensors (0.565x, 0.536x
    for FSDP2, 1.13x naive; stable to 0.1%)."""
    env = {**isolated_env(session_root), "MALLOC_MMAP_THRESHOLD_": "131072"}

    def report(name, *extra):
        run = runs(name, "--model", pretrained_50m, *extra, recipe="tests/scripts/load_rss.py", config=config,
                   mixed_precision="no", env=env).check()
        return json.loads((run.output_dir / "report.json").read_text())

    loaded = report(f"rss-{config}")
    assert loaded["weights_match_file"]
    bound = (1 / loaded["world_size"] + 0.1) * loaded["model_bytes"]
    assert loaded["ranks"][1]["peak_rss_rise_bytes"] < bound
    if config == "fsdp2":
        naive = report("rss-fsdp2-naive", "--naive")
        assert naive["weights_match_file"]
        assert naive["ranks"][1]["peak_rss_rise_bytes"] > bound


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_tied_head_chunked_loss_trains_as_the_whole_logits(runs, family_model, family_plain, engine):
    """Gemma ties its output head to the input embedding: the chunk loop inside the head's forward reads the tied
    weight as the engine gathered it (FSDP2: the head group holds the embedding too; ZeRO-3: gathered for the
    head's forward and again for its backward), and trains as the plain loop's whole logits do (fp32). The FSDP2 run
    is the family test's."""
    model, _, config = family_model("gemma")
    assert config.tie_word_embeddings
    chunked = runs(f"family-gemma-{engine}", *FAMILY_ARGS, "--model", model, config=engine,
                   mixed_precision="no").check()
    assert "the loss uses the whole logits instead" not in chunked.output  # the head really ran in chunks
    plain_loop.assert_trains_as(chunked, family_plain("gemma"))
