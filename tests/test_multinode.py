"""More than one machine, rehearsed on loopback: two `accelerate launch` processes with --num_machines 2 and
--machine_rank 0|1 form one world through torchrun's static rendezvous, as on two nodes, and train exactly as
the single-machine run of the same world size."""

from __future__ import annotations

import subprocess

import pytest
from conftest import EIGHT_STEPS, HARNESS, REPO, Run, free_port, isolated_env

from zero_utils.launcher import accelerate_launch_command, config_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def launch_two_machines(output_dir, config: str, per_machine: int, small_model: str, extra_launch=(),
                        batch: int = 4, accumulation: int = 1) -> Run:
    port = str(free_port())
    procs = []
    for machine_rank in (0, 1):
        cmd = accelerate_launch_command(
            HARNESS,  # recipes/llama_zero3.py with the per-rank evidence attached
            ["--output_dir", output_dir, *EIGHT_STEPS, "--model", small_model, "--per_device_batch_size", batch,
             "--gradient_accumulation_steps", accumulation],
            config_file=config_file(config), num_processes=2 * per_machine, main_process_port=port,
            mixed_precision="no", launch_args=("--num_machines", "2", "--machine_rank", machine_rank,
                                               "--main_process_ip", "127.0.0.1", *extra_launch))
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=isolated_env(output_dir.parent), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
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
    (not a quarter, as full sharding over 4 would), and training equals the 4-rank single-machine run."""
    run = launch_two_machines(session_root / "two-machines-hsdp", "multinode_fsdp2_hsdp", 2, small_model,
                              extra_launch=("--parallelism_config_dp_replicate_size", "2",
                                            "--parallelism_config_dp_shard_size", "2"), batch=1, accumulation=2)
    summary = run.summary()
    assert summary["engine"] == "fsdp2_hsdp" and summary["world_size"] == 4
    for evidence in summary["sharding_per_rank"]:
        assert 0.45 < evidence["local_param_fraction"] <= 0.55
    assert summary["model_state_bytes"] == pytest.approx(summary["model_state_bytes_expected"], rel=0.01)
    reference = run_layout("fsdp2", 4, 1, 2)  # the 4-rank layout of tests/test_zero_math.py
    assert [m["loss"] for m in run.metrics()] == pytest.approx([m["loss"] for m in reference.metrics()], rel=1e-4)
