"""Long context: DeepSpeed's Ulysses sequence parallelism from the accelerate YAML (accelerate_configs/zero3_sp.yaml,
zero2_sp.yaml, `--parallelism_config_sp_size 2`) in the SFT recipe, fp32, 2 processes as one SP group: the losses,
gradient norms and eval loss of one process without SP on the same global batch (rows of one example each), each
rank's blocks holding half of every row's positions in training and whole rows in eval; what the ZeRO-3 factor of
the loss scale is worth; the refusals, in process."""

from __future__ import annotations

import pytest

SP_STEPS = ("--max_steps", "3", "--seq_len", "64", "--no-packing", "--eval_every", "0", "--warmup_steps", "1",
            "--lr", "3e-3", "--max_new_tokens", "0", "--report_to", "none")
SP_TWO = ("--parallelism_config_sp_size", "2")
RTOL = 1e-5


@pytest.fixture(scope="module")
def sp_model(session_root):
    """A tiny Llama of 4 query heads and 2 key/value heads (each rank of an SP group of 2 attends with 2 and 1)."""
    from conftest import llama_from_config

    return llama_from_config(session_root / "sp-llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def sp_runs(runs, session_root, sp_model):
    """`sp_runs(name)`: 'single' (1 process, micro-batch 4), 'zero3' (zero3_sp.yaml, micro-batch 2, the blocks'
    positions probed), 'zero2_acc2' (zero2_sp.yaml, micro-batch 1 x accumulation 2), 'zero3_unscaled' (zero3 without
    the factor of `zero_utils.run.engine.sequence_parallel_gradient_factor`): global batch 4 rows each."""
    from conftest import isolated_env

    env = isolated_env(session_root)
    model = ("--model", sp_model)
    launches = {
        "single": lambda: runs("sp-single", *SP_STEPS, *model, "--per_device_batch_size", "4", num_processes=1,
                               mixed_precision="no"),
        "zero3": lambda: runs("sp-zero3", *SP_STEPS, *model, "--per_device_batch_size", "2", config="zero3_sp",
                              mixed_precision="no", launch_args=SP_TWO,
                              env={**env, "ZERO_RECIPES_HARNESS_SP_PROBE": "1"}),
        "zero2_acc2": lambda: runs("sp-zero2-acc2", *SP_STEPS, *model, "--per_device_batch_size", "1",
                                   "--gradient_accumulation_steps", "2", config="zero2_sp", mixed_precision="no",
                                   launch_args=SP_TWO),
        "zero3_unscaled": lambda: runs("sp-zero3-unscaled", *SP_STEPS, *model, "--per_device_batch_size", "2",
                                       config="zero3_sp", mixed_precision="no", launch_args=SP_TWO,
                                       env={**env, "ZERO_RECIPES_HARNESS_SP_UNSCALED": "1"}),
    }
    return lambda name: launches[name]().check()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3", "zero2_acc2"])
def test_sequence_parallel_trains_as_one_process_without_it(sp_runs, name):
    """ZeRO-3 and ZeRO-2 (with 2 micro-steps of 1 row) at sp 2: every step's loss and gradient norm, and the eval
    loss, equal one process's on the same 4 rows to 1e-5; the data line says what SP does."""
    single, run = sp_runs("single").metrics(), sp_runs(name)
    for ours, theirs in zip(run.metrics(), single, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=RTOL), ours["step"]
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=RTOL), ours["step"]
    assert run.summary()["eval_loss"] == pytest.approx(sp_runs("single").summary()["eval_loss"], rel=RTOL)
    micro_steps = 2 if name == "zero3" else 4
    assert (f"sequence parallel 2: each group of 2 ranks trains its members' micro-batches in turn ({micro_steps} "
            "micro-steps a step), each rank 32 of every row's 64 positions") in run.output
    assert "one example each (--no-packing)" in run.output


@pytest.mark.distributed
@pytest.mark.slow
def test_each_rank_trains_on_half_of_every_row_and_evaluates_whole_rows(sp_runs):
    """A forward hook on the first decoder block: 32 of the 64 positions in training on both ranks, the whole 64 in
    eval (accelerate turns Ulysses off in eval mode; the recipe's eval batches are whole rows)."""
    for rank, seen in enumerate(sp_runs("zero3").summary()["block_positions_per_rank"]):
        assert seen["train"] == [32] and 64 in seen["eval"], (rank, seen)


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_averages_over_every_rank_so_its_loss_scale_takes_sp(sp_runs):
    """DeepSpeed ZeRO-3's reduce-scatter averages over all 2 ranks where ZeRO-1/2 divide by the data-parallel size
    (1) and sum the SP ranks: without the factor sp in the loss scale, ZeRO-3's gradient norm is half the one
    process's at every step (and the losses still agree at step 1, before any update)."""
    single, unscaled = sp_runs("single").metrics(), sp_runs("zero3_unscaled").metrics()
    for ours, theirs in zip(unscaled, single, strict=True):
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"] / 2, rel=1e-3), ours["step"]
    assert unscaled[0]["loss"] == pytest.approx(single[0]["loss"], rel=RTOL)


# ---------------------------------------------------------------------------------------------- in process
@pytest.mark.unit
@pytest.mark.parametrize("name", ["zero3_sp", "zero2_sp"])
def test_an_sp_yaml_is_its_engine_with_a_parallelism_block(name):
    """zero3_sp.yaml and zero2_sp.yaml are zero3.yaml and zero2.yaml plus accelerate's parallelism_config block:
    the deepspeed backend, sdpa, and as many ranks as SP size x data-parallel size on an 8-GPU node."""
    import yaml
    from conftest import CONFIGS

    sp, base = (yaml.safe_load((CONFIGS / f"{n}.yaml").read_text()) for n in (name, name[:-3]))
    block = sp.pop("parallelism_config")
    assert sp == base
    assert block["parallelism_config_sp_backend"] == "deepspeed"
    assert block["parallelism_config_sp_attn_implementation"] == "sdpa"
    assert block["parallelism_config_sp_size"] * block["parallelism_config_dp_shard_size"] == base["num_processes"]


@pytest.mark.unit
@pytest.mark.parametrize("sp, seq_len, heads, kv_heads, attention, world, sentence", [
    (2, 63, 4, 2, "sdpa", 2, "--seq_len 63 is not a multiple of parallelism_config_sp_size 2"),
    (4, 64, 6, 2, "sdpa", 4, "6 attention heads, not divisible by parallelism_config_sp_size 4"),
    (4, 64, 8, 6, "sdpa", 4, "6 key/value heads: parallelism_config_sp_size 4 must divide them"),
    (2, 64, 4, 2, "eager", 2, "--attn_implementation eager under sequence parallelism"),
    (4, 64, 8, 2, "sdpa", 6, "parallelism_config_sp_size 4 does not divide the 6 processes"),
])
def test_a_run_ulysses_cannot_train_is_one_sentence(sp, seq_len, heads, kv_heads, attention, world, sentence):
    from types import SimpleNamespace

    from zero_utils.data.training import check_sequence_parallel
    from zero_utils.run.errors import UserError

    config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
    with pytest.raises(UserError) as error:
        check_sequence_parallel(sp, seq_len, config, attention, world)
    assert sentence in str(error.value) and "\n" not in str(error.value)
    check_sequence_parallel(2, 64, SimpleNamespace(num_attention_heads=4, num_key_value_heads=1), "sdpa", 2)  # MQA


@pytest.mark.unit
def test_sp_under_fsdp2_and_the_preference_recipes_are_refused(monkeypatch):
    """The launch's SP size comes from accelerate's environment; under FSDP2 (or DDP) build_accelerator refuses it
    naming the SP YAMLs, and the DPO recipes' data refuses SP, before any work."""
    from zero_utils.preference.data import PreferenceData
    from zero_utils.run.accelerator import build_accelerator
    from zero_utils.run.engine import sequence_parallel_size
    from zero_utils.run.errors import UserError

    assert sequence_parallel_size() == 1
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
    assert sequence_parallel_size() == 2
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(UserError, match="runs under DeepSpeed ZeRO only .*zero3_sp.yaml"):
        build_accelerator(per_device_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=1.0)
    with pytest.raises(UserError, match="preference recipes do not run under sequence parallelism"):
        PreferenceData.prepare(None, None, None, dataset="x", columns="", seq_len=64, eval_fraction=0, seed=0,
                               per_device_batch_size=1, gradient_accumulation_steps=1)


@pytest.mark.unit
def test_the_estimate_divides_activations_by_sp_and_adds_the_all_to_all():
    """At sp 8 a GPU's activations are those of seq_len / 8 positions (the block mask gone: rows of one example);
    the all-to-all term is, by hand, 2 buffers x (queries + output: h each, keys + values: h x kv/heads each) x
    positions per GPU x 2 bytes: for Llama-3-8B-like sizes at 131,072 tokens over 8 GPUs, 2 x 16,384 x (2 x 4,096 +
    2 x 1,024) x 2 = 671,088,640 bytes. The CLI lists the engines with an _sp YAML and launches the cheapest with
    its SP and data-parallel sizes; an FSDP2 engine with --sp is one sentence."""
    import subprocess
    import sys
    from dataclasses import replace

    from conftest import REPO

    from zero_utils.formulas.model_states import architecture_from_sizes
    from zero_utils.memory.estimate import Setup, estimate
    from zero_utils.run.engine import Engine

    arch = architecture_from_sizes(8 * 10**9, 4096, 32, 128256, intermediate_size=14336, num_heads=32,
                                   num_kv_heads=8)
    setup = Setup(num_params=arch.num_params, arch=arch, seq_len=131072, activation_checkpointing=True,
                  sequence_parallel=8)
    zero3 = (Engine.parse("zero3"),)
    with_sp = estimate(setup, zero3)[0]
    per_gpu = estimate(replace(setup, seq_len=16384, sequence_parallel=1, packed_rows=False), zero3)[0]
    assert with_sp.activation_bytes == per_gpu.activation_bytes < estimate(replace(setup, sequence_parallel=1),
                                                                            zero3)[0].activation_bytes / 7
    assert with_sp.peak_terms["sp_all_to_all"] == 671_088_640 and with_sp.peak_terms["block_mask"] == 0
    flags = ["--params", "8B", "--hidden_size", "4096", "--num_layers", "32", "--vocab_size", "128256",
             "--intermediate_size", "14336", "--num_heads", "32", "--num_kv_heads", "8", "--seq_len", "131072",
             "--activation_checkpointing", "--device_memory", "80GB"]

    def cli(*extra):
        return subprocess.run([sys.executable, "-m", "zero_utils.memory", *flags, *extra], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    out = cli("--sp", "8").stdout
    assert [line.split()[0] for line in out.splitlines() if line.startswith("zero")] == ["zero2", "zero3"]
    assert ("accelerate launch --config_file accelerate_configs/zero2_sp.yaml --num_processes 8 "
            "--parallelism_config_sp_size 8 --parallelism_config_dp_shard_size 1 recipes/llama_zero3.py") in out
    refused = cli("--sp", "8", "--engines", "zero3,fsdp2")
    assert refused.returncode == 2 and "runs under DeepSpeed ZeRO only" in refused.stderr and "fsdp2" in refused.stderr
