"""More than one machine, rehearsed on loopback: two `accelerate launch` processes with --num_machines 2 and
--machine_rank 0|1 form one world through torchrun's static rendezvous, as on two nodes, and train exactly as
the single-machine run of the same world size."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import EIGHT_STEPS, HARNESS, REPO, Run, free_port, isolated_env

from zero_utils.launcher import accelerate_launch_command, config_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def launch_two_machines(output_dir, config: str, per_machine: int, small_model: str, extra_launch=(),
                        batch: int = 4, accumulation: int = 1, recipe_args=(), own_caches: bool = False,
                        env_extra: dict | None = None) -> Run:
    """`own_caches`: each machine its own datasets cache (HF_DATASETS_CACHE=<output_dir>.cache-machine<rank>), as
    nodes without a shared file system have. `env_extra`: more environment for both machines (the harness's
    probes)."""
    port = str(free_port())
    procs = []
    for machine_rank in (0, 1):
        env = {**isolated_env(output_dir.parent), **(env_extra or {})}
        if own_caches:
            env["HF_DATASETS_CACHE"] = f"{output_dir}.cache-machine{machine_rank}"
        cmd = accelerate_launch_command(
            HARNESS,  # recipes/llama_zero3.py with the per-rank evidence attached
            ["--output_dir", output_dir, *EIGHT_STEPS, "--model", small_model, "--per_device_batch_size", batch,
             "--gradient_accumulation_steps", accumulation, *recipe_args],
            config_file=config_file(config), num_processes=2 * per_machine, main_process_port=port,
            mixed_precision="no", launch_args=("--num_machines", "2", "--machine_rank", machine_rank,
                                               "--main_process_ip", "127.0.0.1", *extra_launch))
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, (out + err)[-4000:]
    return Run(0, outputs[0][0], outputs[0][1], output_dir)


def test_two_machines_one_process_each_match_one_machine(session_root, run_layout, small_model):
    run = launch_two_machines(session_root / "two-machines-fsdp2", "fsdp2", 1, small_model)
    reference = run_layout("fsdp2", 2, 4, 1)
    assert run.summary()["world_size"] == 2
    assert [m["loss"] for m in run.metrics()] == pytest.approx([m["loss"] for m in reference.metrics()], rel=1e-6)


def test_hsdp_shards_within_a_machine_and_replicates_across(session_root, run_layout, small_model):
    """HSDP on 2 machines x 2 processes: shard groups of 2, 2 replicas. Each rank holds half the model states
    (not a quarter, as full sharding over 4 would), and training equals the 4-rank single-machine run.
    With accumulation 2, after a step's first micro-batch every rank holds its shard group's partial sums (FSDP2's
    `_partial_reduce_output` in every parameter group: reduce-scattered within the machine, the all-reduce across
    machines skipped) and no whole gradient; after the last, every group's sharded gradients are set (all-reduced),
    and no partial sum is left."""
    run = launch_two_machines(session_root / "two-machines-hsdp", "multinode_fsdp2_hsdp", 2, small_model,
                              extra_launch=("--parallelism_config_dp_replicate_size", "2",
                                            "--parallelism_config_dp_shard_size", "2"), batch=1, accumulation=2,
                              env_extra={"ZERO_RECIPES_HARNESS_ACCUMULATION_PROBE": "1"})
    summary = run.summary()
    assert summary["engine"] == "fsdp2_hsdp" and summary["world_size"] == 4
    for evidence in summary["sharding_per_rank"]:
        assert 0.45 < evidence["local_param_fraction"] <= 0.55
    assert summary["model_state_bytes"] == pytest.approx(summary["model_state_bytes_expected"], rel=0.01)
    reference = run_layout("fsdp2", 4, 1, 2)  # the 4-rank layout of tests/test_zero_math.py
    assert [m["loss"] for m in run.metrics()] == pytest.approx([m["loss"] for m in reference.metrics()], rel=1e-4)
    assert [m["grad_norm"] for m in run.metrics()] == pytest.approx([m["grad_norm"] for m in reference.metrics()],
                                                                      rel=1e-4)
    for records in summary["accumulation_probe_per_rank"]:  # (step, micro-batch) (1, 1), (1, 2), (2, 1), (2, 2)
        first, last = records[2], records[3]  # step 2
        assert (first["step"], first["micro_batch"], last["micro_batch"]) == (2, 1, 2)
        assert first["partial_reduce_outputs"] == first["param_groups"] > 0 and first["unsharded_grads"] == 0
        assert last["partial_reduce_outputs"] == 0 and last["groups_with_sharded_grads"] == last["param_groups"]
        assert first["model_state_bytes"] == pytest.approx(16 * summary["num_params"] / 2, rel=0.01)


def test_machines_without_a_shared_cache_each_prepare_the_same_rows(session_root, small_model):
    """2 machines x 2 processes, each machine its own datasets cache: each machine's local main process (ranks 0
    and 2) tokenizes, no other process does (the harness counts tokenizer calls per process; --num_proc 1 keeps
    them in the process), each writes one row file, and the two caches hold the same rows byte for byte."""
    out = session_root / "two-machines-own-caches"
    run = launch_two_machines(out, "ddp", 2, small_model, batch=2, recipe_args=("--num_proc", "1"), own_caches=True)
    summary = run.summary()
    calls = summary["tokenizer_calls_in_data_prep_per_rank"]
    assert calls[0] > 0 and calls[2] > 0 and calls[1] == calls[3] == 0, calls
    assert summary["data_cache_files_written_per_rank"] == [1, 0, 1, 0]
    rows = [sorted(Path(f"{out}.cache-machine{m}").glob("zero_recipes_rows/*/train.arrow")) for m in (0, 1)]
    assert len(rows[0]) == len(rows[1]) == 1 and rows[0][0].parent.name == rows[1][0].parent.name
    assert rows[0][0].read_bytes() == rows[1][0].read_bytes()
    assert summary["data"]["nodes_with_own_rows"] == 1
    assert "and the same rows by the local main process of 1 node(s) with their own datasets cache" in run.output
