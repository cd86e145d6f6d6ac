"""Gradient accumulation keeps the ZeRO promise: between the micro-batches of a step each rank holds what its
engine's formula says, not the whole model's gradients. Under FSDP2 the recipe reduce-scatters every micro-batch
(accelerate's `sync_each_batch`, zero_utils.run.accelerator); accelerate's default would keep every rank's unsharded
gradients until the last micro-batch (torch's `FSDPParam.unsharded_accumulated_grad`). Model-state bytes are
measured where they peak (after each micro-batch's backward in the first two steps, and after the update), and each
step's memory peak is its own (zero_utils.train.measurement)."""

from __future__ import annotations

import pytest
from conftest import isolated_env, llama_from_config

from zero_utils.train import measurement

pytestmark = pytest.mark.distributed

ACCUMULATION_PROBE = {"ZERO_RECIPES_HARNESS_ACCUMULATION_PROBE": "1"}  # tests/scripts/accumulation_probe.py


def test_fsdp2_holds_only_gradient_shards_between_micro_batches(runs, small_model, session_root):
    """FSDP2, 2 ranks, fp32, accumulation 2: in step 2 (Adam's state exists), after micro-batch 1's backward, no rank
    keeps a whole gradient (`unsharded_accumulated_grad`, or in fp32 the unsharded parameter's `.grad`), every
    parameter group's gradient is already in its shards, and the
    model states counted then are FSDP2's 16 bytes per parameter / N, the paper's P_os+g+p (within 1%: dim-0
    padding). The run's model_state_bytes, the maximum over every measured moment, is the same."""
    run = runs("accumulation-fsdp2-probe", "--model", small_model, "--max_steps", "3", "--seq_len", "64",
               "--per_device_batch_size", "2", "--gradient_accumulation_steps", "2", "--eval_fraction", "0",
               "--max_new_tokens", "0", "--report_to", "none", config="fsdp2", mixed_precision="no",
               env={**isolated_env(session_root), **ACCUMULATION_PROBE}).check()
    summary = run.summary()
    formula = 16 * summary["num_params"] / 2
    for records in summary["accumulation_probe_per_rank"]:
        assert [(r["step"], r["micro_batch"]) for r in records] == [(1, 1), (1, 2), (2, 1), (2, 2)]
        assert all(r["unsharded_grads"] == 0 for r in records), records
        between = records[2]  # step 2, after micro-batch 1's backward, before the update
        assert between["groups_with_sharded_grads"] == between["param_groups"] > 0
        assert between["model_state_bytes"] == pytest.approx(formula, rel=0.01)
    assert summary["model_state_bytes"] == pytest.approx(formula, rel=0.01)
    assert all(m["model_state_bytes"] == summary["model_state_bytes"] for m in run.metrics()[1:])


def test_peak_memory_is_reset_per_step_on_cpu():
    """A step's CPU peak is its own: after 400 MB are touched and freed, `reset_peak_memory` brings the RSS
    high-water mark (`VmHWM`, read here from /proc directly) back down, and `peak_memory_bytes` reports it."""
    import mmap

    def vm_hwm_bytes() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    import torch

    cpu = torch.device("cpu")
    block = mmap.mmap(-1, 400 * 2**20)  # anonymous pages, returned to the system on close
    block.write(b"\1" * len(block))
    block.close()
    high = vm_hwm_bytes()
    assert measurement.reset_peak_memory(cpu)
    after = vm_hwm_bytes()
    assert high - after > 350 * 2**20
    assert measurement.peak_memory_bytes(cpu) == pytest.approx(after, abs=8 * 2**20)
    assert "each step's reset" in measurement.peak_memory_measured(cpu)


def llama_115m(path) -> str:
    """A 115M-parameter Llama (hidden 768, 16 layers, the bundled tokenizer's 872-token vocabulary), config only."""
    return llama_from_config(path, hidden_size=768, intermediate_size=2048, num_hidden_layers=16,
                             num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=256)


@pytest.mark.slow
def test_fsdp2_accumulation_peak_at_115m_params(runs, session_root):
    """The training peak per rank (max over steps; each step's RSS high-water mark reset at its start) of
    accumulation 4 stays within 0.5 x (4 P - 4 P / N) of accumulation 1's: FSDP2, 2 ranks, fp32, micro-batch 1.
    Before the fix the whole unsharded gradients (4 P bytes) sat on every rank next to the 4 P / N shards.
    glibc keeps freed blocks under its dynamic mmap threshold on its heap, so both runs fix it at 64 KiB."""
    model = llama_115m(session_root / "llama-115m")
    env = {**isolated_env(session_root), "MALLOC_MMAP_THRESHOLD_": "65536"}
    args = ("--model", model, "--max_steps", "2", "--seq_len", "64", "--per_device_batch_size", "1",
            "--eval_fraction", "0", "--max_new_tokens", "0", "--report_to", "none", "--warmup_steps", "0")
    peaks = {}
    for accumulation in (1, 4):
        run = runs(f"accumulation-115m-{accumulation}", *args, "--gradient_accumulation_steps", str(accumulation),
                   config="fsdp2", mixed_precision="no", env=env, timeout=900).check()
        summary = run.summary()
        peaks[accumulation] = summary["peak_mem_bytes"]
        steps = [m["peak_mem_bytes"] for m in run.metrics()]
        assert summary["peak_mem_bytes"] >= max(steps)
        print(f"\naccumulation {accumulation}: peak per step (MB) {[round(b / 1e6) for b in steps]}, saved "
              f"activations {summary['saved_activation_bytes'] / 1e6:,.0f} MB per micro-batch")
    params, ranks = summary["num_params"], 2
    unsharded_extra = 4 * params - 4 * params / ranks
    print(f"\n{params / 1e6:.1f}M params: training peak per rank {peaks[1] / 1e6:,.0f} MB at accumulation 1, "
          f"{peaks[4] / 1e6:,.0f} MB at 4 (+{(peaks[4] - peaks[1]) / 1e6:,.0f} MB; unsharded gradients less their "
          f"shard: {unsharded_extra / 1e6:,.0f} MB)")
    assert params > 100e6
    assert peaks[4] - peaks[1] < 0.5 * unsharded_extra
