"""ZeRO made measurable: every engine trains the same model as single-process training (sharding changes memory,
not the mathematics: the logged loss, the mean over every answer token of the global batch, and the clipped
gradient norm follow the same curve), and each rank holds the model-state bytes its engine's formula predicts.

One fp32 run per (engine, world size, accumulation) serves the loss-curve, weights, grad-norm and memory
assertions. The global batch is 8 rows of 64 tokens throughout; clipping at 0.5 is active on every step, so a
local instead of global gradient norm would change the curve."""

from __future__ import annotations

import json

import plain_loop
import pytest
import torch
from conftest import (
    EIGHT_STEPS,
    LOSS_PROBE,
    WHOLE_LOGITS,
    Run,
    assert_chunked_equals_whole,
    assert_one_host_sync,
    isolated_env,
)
from safetensors.torch import load_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ENGINES = ["ddp", "zero1", "zero2", "zero3", "fsdp2", "fsdp2_zero2"]
OFFLOAD_ENGINES = ["zero3_offload", "fsdp2_offload"]
# (world size, per-device batch, accumulation): 8 rows per optimizer step in every layout. Two launches per engine
# cover 2 and 4 ranks, with and without accumulation: the 4-rank run accumulates, and its memory is read too.
LAYOUTS = [(2, 4, 1), (4, 1, 2)]
LAYOUT_OF_WORLD = {world: (world, batch, accumulation) for world, batch, accumulation in LAYOUTS}
# fp32 on 2 CPU cores: DDP and ZeRO reduce the same gradients in another order than one process; measured
# differences grow from ~1e-7 to ~3e-5 over 8 steps at this learning rate; 1e-4 still catches any real
# divergence (a wrong loss scale or a local gradient norm moves the curve by > 1e-2).
LOSS_RTOL = 1e-4
# Adam divides by sqrt(v): the same noise moves an element by up to ~6e-5 after 8 steps (measured: DDP 6e-6,
# ZeRO 1.2e-5 at a global batch of 8; up to 5.5e-5 at 6 rows on 3 ranks), while a real error moves weights by
# ~lr = 2e-3 per step.
WEIGHT_ATOL = 1e-4


@pytest.fixture(scope="module")
def reference(run_layout):
    return run_layout("single", 1, 8, 1)


def final_weights(run: Run) -> dict[str, torch.Tensor]:
    return load_file(run.output_dir / "final" / "model.safetensors")


def assert_same_training(run: Run, reference: Run) -> None:
    got, want = run.metrics(), reference.metrics()
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=LOSS_RTOL)
    assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in want], rel=LOSS_RTOL)
    assert all(m["grad_norm"] > 0.5 for m in want[:4])  # clipping is active, so the norm must be the global one
    weights, ref_weights = final_weights(run), final_weights(reference)
    assert weights.keys() == ref_weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor.float(), ref_weights[name].float(), rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.parametrize("world,batch,accumulation", LAYOUTS, ids=[f"{w}ranks-acc{a}" for w, _, a in LAYOUTS])
@pytest.mark.parametrize("engine", ENGINES)
def test_engine_matches_single_process(run_layout, reference, engine, world, batch, accumulation):
    assert_same_training(run_layout(engine, world, batch, accumulation), reference)


@pytest.mark.parametrize("engine", ["single", *ENGINES])
def test_a_training_step_syncs_the_host_once(run_layout, engine):
    """Step 5 of the 4-rank layout (2 micro-batches a step; one process: 1 x 8 rows), probed on every rank
    (tests/scripts/sync_probe.py): one host sync in our code, transformers' one per forward, no blocking copy."""
    run = run_layout(engine, 1, 8, 1) if engine == "single" else run_layout(engine, *LAYOUT_OF_WORLD[4])
    assert_one_host_sync(run, forwards=1 if engine == "single" else 2)


@pytest.mark.parametrize("engine", OFFLOAD_ENGINES)
def test_offload_engine_matches_single_process(run_layout, reference, engine):
    assert_same_training(run_layout(engine, 2, 4, 1), reference)


def test_accumulation_does_not_change_single_process_training(run_layout, reference):
    assert_same_training(run_layout("single", 1, 4, 2), reference)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("engine", ENGINES + OFFLOAD_ENGINES)
def test_model_state_bytes_match_the_engine_formula(run_layout, engine, world):
    """Measured from the live tensors right after the optimizer step, max over ranks, vs the formula with the
    uneven-sharding remainder added exactly; the ratio to DDP is the formula's too."""
    summary = run_layout(engine, *LAYOUT_OF_WORLD[world]).summary()
    ddp = run_layout("ddp", *LAYOUT_OF_WORLD[world]).summary()
    assert summary["model_state_bytes"] == pytest.approx(summary["model_state_bytes_expected"], rel=0.01)
    measured_ratio = summary["model_state_bytes"] / ddp["model_state_bytes"]
    expected_ratio = summary["model_state_bytes_expected"] / ddp["model_state_bytes_expected"]
    assert measured_ratio == pytest.approx(expected_ratio, rel=0.01)
    if engine != "ddp":
        assert measured_ratio < 0.9  # every ZeRO engine really saves memory over DDP


def test_sharded_memory_shrinks_with_world_size(run_layout):
    for engine in ("zero3", "fsdp2"):
        two, four = (run_layout(engine, *LAYOUT_OF_WORLD[w]).summary()["model_state_bytes"] for w in (2, 4))
        assert four / two == pytest.approx(0.5, rel=0.02)


@pytest.mark.parametrize("engine", ["fsdp2", "zero3", "ddp"])
def test_world_size_that_does_not_divide_the_model(runs, small_model, engine):
    """3 ranks: 872-row embeddings and 688-row MLPs do not split evenly; training still equals one process."""
    args = (*EIGHT_STEPS, "--model", small_model, "--gradient_accumulation_steps", "1")
    reference = runs("zm-single-6", *args, "--per_device_batch_size", "6", num_processes=1,
                     mixed_precision="no").check()
    run = runs(f"zm-{engine}-3", *args, "--per_device_batch_size", "2", config=engine, num_processes=3,
               mixed_precision="no").check()
    assert_same_training(run, reference)
    summary = run.summary()
    assert summary["model_state_bytes"] == pytest.approx(summary["model_state_bytes_expected"], rel=0.01)
    # Each rank's own bytes, next to what it holds (the harness's sharding evidence, walked independently):
    # fp32 Adam keeps 16 bytes per parameter element a rank holds (weight, gradient, two moments), plus Adam's
    # step counters and, under FSDP2, the last rank's parameter and gradient shards padded to the others' size
    # (0.7% here). DeepSpeed adds its own fp32 gradient partition (checked by the formula above).
    per_rank = summary["model_state_bytes_per_rank"]
    assert len(per_rank) == 3 and max(per_rank) == summary["model_state_bytes"]
    if engine != "zero3":
        held = [e["local_param_fraction"] * summary["num_params"] for e in summary["sharding_per_rank"]]
        assert per_rank == pytest.approx([16 * n for n in held], rel=0.01)
    if engine == "fsdp2":  # uneven shards: the third rank holds 1.5% fewer elements, and its own figure says so
        assert per_rank[2] < per_rank[0]
    assert max(summary["peak_mem_bytes_per_rank"]) == summary["peak_mem_bytes"]


@pytest.mark.parametrize("config", ["fsdp2", "fsdp2_zero2"])
def test_fsdp2_reshard_setting_decides_what_stays_gathered(runs, config):
    """Between forward and backward, fsdp2_zero2 holds every block's parameters unsharded; fsdp2 only the groups
    that are never resharded after forward (the last block, the final norm and the output head)."""
    run = runs(f"probe-{config}", recipe="tests/scripts/unsharded_after_forward.py", config=config,
               mixed_precision="no").check()
    report = json.loads((run.output_dir / "report.json").read_text())
    if config == "fsdp2_zero2":
        assert report["unsharded_bytes"] == report["full_param_bytes"]
    else:
        assert report["unsharded_bytes"] == report["last_block_bytes"] + report["norm_and_head_bytes"]
        assert report["unsharded_bytes"] < 0.5 * report["full_param_bytes"]



def whole_logits_run(runs, small_model, session_root, engine: str) -> Run:
    """The twin of the shared 2-rank run with the whole logits at once; the FSDP2 one carries the loss probe."""
    return runs(f"zm-{engine}-2-4x1-whole", *EIGHT_STEPS, "--model", small_model, "--per_device_batch_size", "4",
                *WHOLE_LOGITS, config=engine, mixed_precision="no",
                env={**isolated_env(session_root), **(LOSS_PROBE if engine == "fsdp2" else {})}).check()


@pytest.mark.parametrize("engine", ["ddp", "zero3", "fsdp2"])
def test_chunked_loss_trains_as_the_whole_logits(runs, run_layout, layout_plain, small_model, session_root, engine):
    """The shared runs compute the loss 40 tokens at a time inside the output head (untied here; the tied head:
    tests/test_wrapping.py); they train as the plain loop's whole logits do (tests/plain_loop.py, in process), and
    under FSDP2 as the same run with the whole logits at once (the loss probe's twin below) to 2e-6."""
    plain_loop.assert_trains_as(run_layout(engine, 2, 4, 1), layout_plain)
    if engine == "fsdp2":
        assert_chunked_equals_whole(run_layout(engine, 2, 4, 1), whole_logits_run(runs, small_model, session_root,
                                                                                   engine))


def test_no_full_vocabulary_tensor_in_a_chunked_step(runs, small_model, session_root):
    """A probe around the unchanged recipe (tests/scripts/loss_probe.py) records every op's output during step 1
    under FSDP2: chunked, no logits-shaped tensor holds more than a chunk's 40 tokens (forward and backward,
    transients included), where the whole-logits twin creates the micro-batch's 4 x 64 = 256; and the output head's
    group is all-gathered once for the micro-batch, not once per chunk."""
    probe = runs("zm-fsdp2-2-4x1-loss-probe", *EIGHT_STEPS, "--model", small_model, "--per_device_batch_size", "4",
                 "--max_steps", "2", config="fsdp2", mixed_precision="no",
                 env={**isolated_env(session_root), **LOSS_PROBE}).check()
    whole = whole_logits_run(runs, small_model, session_root, "fsdp2")
    for run, tokens in ((probe, 40), (whole, 4 * 64)):
        for rank in run.summary()["loss_probe_per_rank"]:
            assert rank["max_logits_tokens"] == tokens and rank["vocab"] > 256
            assert rank["head_all_gathers"] == 1
