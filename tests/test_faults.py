"""Faults with real processes and real signals: preemption (SIGTERM/SIGINT to the launcher or to one rank), a
diverging loss, and a rank killed with SIGKILL. The work done is kept and `--resume auto` continues."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from conftest import REPO, free_port, isolated_env, launch

from zero_utils.checkpoint import storage as checkpoint_storage
from zero_utils.launch.launcher import accelerate_launch_command, config_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
LONG_RUN = ("--max_steps", "100000", "--seq_len", "64", "--per_device_batch_size", "2", "--report_to", "none",
            "--max_new_tokens", "0", "--eval_fraction", "0")
GRACE_S = 30  # torchrun's shutdown grace period: everything must be saved and gone well before


def start(output_dir, config="fsdp2", extra=(), launch_args=()):
    cmd = accelerate_launch_command(REPO / "recipes/llama_zero3.py", ["--output_dir", output_dir, *LONG_RUN, *extra],
                                    config_file=config_file(config), num_processes=2, main_process_port=free_port(),
                                    mixed_precision="no", launch_args=launch_args)
    return subprocess.Popen(cmd, cwd=REPO, env=isolated_env(output_dir.parent), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_steps(output_dir, steps: int, proc, timeout_s: float = 120) -> None:
    metrics = output_dir / "metrics.jsonl"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps within {timeout_s} s")


def workers_of(proc) -> list[int]:
    """The training processes torchrun started under this launcher."""
    import psutil

    children = psutil.Process(proc.pid).children(recursive=True)
    workers = [c.pid for c in children if any("llama_zero3.py" in part for part in c.cmdline())]
    assert workers, "no worker processes found"
    return workers


@pytest.mark.parametrize("target,sig", [("launcher", signal.SIGTERM), ("launcher", signal.SIGINT),
                                        ("one rank", signal.SIGTERM)])
def test_preemption_saves_a_complete_checkpoint_and_resume_continues(tmp_path, target, sig):
    out = tmp_path / "run"
    proc = start(out)
    wait_for_steps(out, 3, proc)
    sent = time.time()
    os.kill(proc.pid if target == "launcher" else workers_of(proc)[-1], sig)
    output = proc.communicate(timeout=GRACE_S + 30)[0]
    elapsed = time.time() - sent
    assert elapsed < GRACE_S, f"took {elapsed:.0f} s"
    assert "received: stopped after step" in output, output[-3000:]
    saved = checkpoint_storage.list_complete(out)
    assert saved, output[-3000:]
    step = saved[-1][0]
    assert step >= 3 and len(out.joinpath("metrics.jsonl").read_text().splitlines()) == step
    if target == "one rank":  # one resume serves the three signals: the checkpoint each leaves is the same kind
        resumed = launch(out, *LONG_RUN, "--max_steps", str(step + 2), "--resume", "auto", config="fsdp2",
                         mixed_precision="no", env=isolated_env(tmp_path)).check()
        assert [m["step"] for m in resumed.metrics()] == list(range(1, step + 3))


def test_diverging_loss_stops_with_a_sentence_and_keeps_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "run"
    run = launch(out, *LONG_RUN, "--max_steps", "30", "--lr", "1e30", "--warmup_steps", "0", "--save_every", "1",
                 "--max_grad_norm", "1e9", config="fsdp2", mixed_precision="no", env=isolated_env(tmp_path))
    assert run.returncode != 0
    stopped = [line for line in run.stderr.splitlines() if line.startswith("stopped: the loss became")]
    assert stopped, run.output[-3000:]
    saved = checkpoint_storage.list_complete(out)
    assert saved and f"last good checkpoint is {saved[-1][1]}" in stopped[0]
    bad_step = int(stopped[0].split(" at step ")[1].split()[0])
    assert saved[-1][0] == bad_step - 1  # nothing saved at or after the bad step


def test_a_rank_killed_fails_the_job_and_resume_auto_continues(tmp_path):
    out = tmp_path / "run"
    proc = start(out, extra=("--save_every", "2", "--collective_timeout_s", "60"))
    wait_for_steps(out, 5, proc)
    os.kill(workers_of(proc)[-1], signal.SIGKILL)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, output[-2000:]
    saved = checkpoint_storage.list_complete(out)
    assert saved and saved[-1][0] >= 4
    step = saved[-1][0]
    resumed = launch(out, *LONG_RUN, "--max_steps", str(step + 2), "--save_every", "2", "--resume", "auto",
                     config="fsdp2", mixed_precision="no", env=isolated_env(tmp_path)).check()
    assert [m["step"] for m in resumed.metrics()][-3:] == [step, step + 1, step + 2]



def test_torchrun_max_restarts_restarts_in_place_and_resumes(tmp_path):
    """`accelerate launch --max_restarts 1 ... --resume auto`: a rank killed with SIGKILL makes torchrun restart
    every worker in place; they join a fresh process group (zero_utils.run.accelerator, per-attempt rendezvous keys),
    resume from the newest complete checkpoint and finish the run, and the job exits 0."""
    out = tmp_path / "run"
    proc = start(out, extra=("--max_steps", "40", "--save_every", "2", "--resume", "auto", "--seq_len", "256",
                             "--per_device_batch_size", "8", "--collective_timeout_s", "60"),
                 launch_args=("--max_restarts", "1"))
    wait_for_steps(out, 5, proc)
    killed_at = len((out / "metrics.jsonl").read_text().splitlines())
    os.kill(workers_of(proc)[-1], signal.SIGKILL)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-3000:]
    assert killed_at < 40, "the run ended before the kill: make the steps slower"
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41))
    assert output.count("resumed from") == 1, output[-3000:]
