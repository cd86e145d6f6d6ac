"""More than one machine, rehearsed on loopback: two `accelerate launch` processes with --num_machines 2 and
--machine_rank 0|1 form one world through torchrun's static rendezvous, as on two nodes, and train exactly as
the single-machine run of the same world size."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import EIGHT_STEPS, HARNESS, REPO, Run, free_port, isolated_env

from zero_utils.checkpoint.policy import JOB_TOKEN_FILE
from zero_utils.launch.launcher import accelerate_launch_command, config_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def start_two_machines(output_dir, config: str, per_machine: int, small_model: str, extra_launch=(),
                       batch: int = 4, accumulation: int = 1, recipe_args=(), own_caches: bool = False,
                       env_extra: dict | None = None, machine_env: dict | None = None,
                       machine_args: dict | None = None) -> list[tuple[int, str, str]]:
    """Both machines' (exit code, stdout, stderr). `own_caches`: each machine its own datasets cache
    (HF_DATASETS_CACHE=<output_dir>.cache-machine<rank>), as nodes without a shared file system have. `env_extra`:
    more environment for both machines (the harness's probes); `machine_env` / `machine_args`: {machine rank:
    environment / recipe flags} for one machine only (later flags win: another --output_dir, as a node-local
    disk)."""
    port = str(free_port())
    procs = []
    for machine_rank in (0, 1):
        env = {**isolated_env(output_dir.parent), **(env_extra or {}), **(machine_env or {}).get(machine_rank, {})}
        if own_caches:
            env["HF_DATASETS_CACHE"] = f"{output_dir}.cache-machine{machine_rank}"
        cmd = accelerate_launch_command(
            HARNESS,  # recipes/llama_zero3.py with the per-rank evidence attached
            ["--output_dir", output_dir, *EIGHT_STEPS, "--model", small_model, "--per_device_batch_size", batch,
             "--gradient_accumulation_steps", accumulation, *recipe_args,
             *(machine_args or {}).get(machine_rank, ())],
            config_file=config_file(config), num_processes=2 * per_machine, main_process_port=port,
            mixed_precision="no", launch_args=("--num_machines", "2", "--machine_rank", machine_rank,
                                               "--main_process_ip", "127.0.0.1", *extra_launch))
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = [p.communicate(timeout=600) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


def launch_two_machines(output_dir, config: str, per_machine: int, small_model: str, **kwargs) -> Run:
    """`start_two_machines`, both exiting 0: machine 0's run."""
    machines = start_two_machines(output_dir, config, per_machine, small_model, **kwargs)
    for returncode, out, err in machines:
        assert returncode == 0, (out + err)[-4000:]
    return Run(0, machines[0][1], machines[0][2], output_dir)


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


SLOW_S, TIMEOUT_S = 15, 10  # the slow machine's wait outlasts the collective timeout


def test_a_cold_machine_prepares_while_the_other_waits_outside_collectives(session_root, small_model):
    """2 machines x 1 process, each its own datasets cache; machine 1's preparation takes longer than
    --collective_timeout_s (the harness slows its first tokenized example, in machine 1's environment only): the
    main process's machine finishes first and waits for it outside any collective, the job trains, both exit 0
    (before, machine 0 went on into the node count's all-reduce and both died: "Timed out waiting 10000ms")."""
    out = session_root / "two-machines-cold-node"
    start = time.monotonic()
    run = launch_two_machines(out, "fsdp2", 1, small_model, batch=2, own_caches=True,
                              recipe_args=("--num_proc", "1", "--collective_timeout_s", str(TIMEOUT_S)),
                              machine_env={1: {"ZERO_RECIPES_HARNESS_SLOW_PREP_S": str(SLOW_S)}})
    assert time.monotonic() - start > SLOW_S  # the wait really happened
    summary = run.summary()
    assert summary["steps"] == 8 and summary["data"]["nodes_with_own_rows"] == 1
    assert summary["tokenizer_calls_in_data_prep_per_rank"][1] > 0  # machine 1 prepared its own rows


def test_node_local_output_dirs_stop_every_rank_before_the_model_is_built(session_root, small_model):
    """Each machine its own --output_dir (as node-local disks), machine 1's holding a job token left by an earlier
    job: every rank exits 2 with one sentence naming the folder, before the model is built (the harness shortens
    the 60 s the check rides out NFS caching for to 2 s)."""
    out = session_root / "two-machines-local-disks"
    local = out / "machine1-local"
    local.mkdir(parents=True)
    (local / JOB_TOKEN_FILE).write_text("an-earlier-job\n")
    machines = start_two_machines(out / "machine0-local", "fsdp2", 1, small_model, batch=2,
                                  env_extra={"ZERO_RECIPES_HARNESS_SHARED_DIR_WAIT_S": "2"},
                                  machine_args={1: ("--output_dir", str(local))})
    for machine, (returncode, stdout, stderr) in enumerate(machines):
        report = re.findall(r"rank\s+:\s+(\d+) \(local_rank: \d+\)\n\s+exitcode\s+:\s+(-?\d+)", stderr)
        assert returncode != 0 and report == [(str(machine), "2")], (stdout + stderr)[-3000:]  # torchrun's report
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "is not shared: node 1" in errors[0], (machine, errors)
        assert "a file system every node mounts" in errors[0]
        assert "engine fsdp2 |" not in stdout  # the line printed once the model is built and prepared
    assert (local / JOB_TOKEN_FILE).read_text() == "an-earlier-job\n"  # machine 1 never wrote there
    assert not list((out / "machine0-local").glob("checkpoints"))


def test_a_model_folder_on_one_machine_only_is_one_sentence_naming_the_other(session_root, small_model):
    """Issue 67 item 3: `--model ~/model`, a folder in machine 0's home only (each machine its own HOME, as
    node-local disks): every rank of both machines exits 2 with one sentence naming machine rank 1 as the one that
    lacks it and what to do, before the data is prepared (2 launches that fail early)."""
    import shutil

    out = session_root / "two-machines-model-on-one"
    homes = [out / f"home{machine}" for machine in (0, 1)]
    for home in homes:
        home.mkdir(parents=True)
    shutil.copytree(small_model, homes[0] / "model")
    machines = start_two_machines(out / "run", "fsdp2", 1, small_model, batch=2, recipe_args=("--model", "~/model"),
                                  machine_env={m: {"HOME": str(home)} for m, home in enumerate(homes)})
    for machine, (returncode, stdout, stderr) in enumerate(machines):
        report = re.findall(r"rank\s+:\s+(\d+) \(local_rank: \d+\)\n\s+exitcode\s+:\s+(-?\d+)", stderr)
        assert returncode != 0 and report == [(str(machine), "2")], (stdout + stderr)[-3000:]
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert errors == ["error: --model '~/model' exists on machine rank 0 but not on machine rank 1: a local "
                          "--model must exist at the same path on every node (copy it there, or use a file system "
                          "every node mounts), or pass a Hub id (downloaded once per node)."], (machine, errors)
        assert "tokenize and pack" not in stderr + stdout  # before the data
