"""Work one rank does alone while the others wait (data preparation, the final export) is not bounded by the
collective timeout, and the flash-attention path trains what sdpa trains: one launch through the test harness
(tests/scripts/harness.py), which slows preparation and export and registers the flash-attention stand-in. In
process: the wait's own limit (--wait_limit_s) and its progress lines, on a real TCPStore, and the check that a node
sees --output_dir's job token. (The waits across machines and rank 0's read of the weights: test_multinode.py,
test_pretrained.py.)"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from conftest import assert_one_host_sync, free_port, isolated_env, sync_probe

from zero_utils.checkpoint.policy import JOB_TOKEN_FILE, sees_job_token
from zero_utils.run import distributed
from zero_utils.run.errors import UserError

PREP_S, EXPORT_S, TIMEOUT_S = 15, 12, 10  # each wait outlasts the timeout
ARGS = ("--max_steps", "4", "--per_device_batch_size", "2", "--seq_len", "128", "--eval_fraction", "0",
        "--max_new_tokens", "2", "--report_to", "none", "--collective_timeout_s", str(TIMEOUT_S))


@pytest.mark.unit
def test_a_wait_past_wait_limit_s_stops_with_a_sentence_and_says_what_it_waits_for(monkeypatch, capsys):
    """A rank waiting (outside collectives, on the store) for work that never finishes: a line every
    WAIT_LINE_EVERY_S naming what it waits for, then past --wait_limit_s a UserError naming the flag; and the wait
    ends as soon as the counter is reached."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    rank = SimpleNamespace(process_index=3, is_local_main_process=True)
    monkeypatch.setattr(distributed, "WAIT_LINE_EVERY_S", 0.2)
    distributed.set_wait_limit(1)
    try:
        start = time.monotonic()
        with pytest.raises(UserError, match=r"rank 3 waited more than --wait_limit_s 1 s for the download of --model "
                                            r"x; raise --wait_limit_s \(0 = no limit\)"):
            distributed._wait_for_count(store, "done", 1, rank, "the download of --model x", poll_s=0.05)
        assert 1 < time.monotonic() - start < 3
        assert capsys.readouterr().out.count("[rank 3] waiting 0 min for the download of --model x") >= 3
        threading.Timer(0.3, lambda: store.add("done", 1)).start()
        distributed._wait_for_count(store, "done", 1, rank, "the export", poll_s=0.05)  # returns once it is done
    finally:
        distributed.set_wait_limit(0)


@pytest.mark.unit
def test_a_node_sees_only_this_jobs_token(tmp_path):
    """A node's check of --output_dir: a token file left by an earlier job does not pass; this job's token passes,
    also when it shows up late (as a network file system may show a new file), within the wait."""
    (tmp_path / JOB_TOKEN_FILE).write_text("an-earlier-job\n")
    start = time.monotonic()
    assert not sees_job_token(tmp_path, "this-job", wait_s=0.5, poll_s=0.1)
    assert time.monotonic() - start >= 0.5  # it retried
    assert not sees_job_token(tmp_path / "missing", "this-job", wait_s=0, poll_s=0.1)
    threading.Timer(0.3, lambda: (tmp_path / JOB_TOKEN_FILE).write_text("this-job\n")).start()
    assert sees_job_token(tmp_path, "this-job", wait_s=5, poll_s=0.1)


@pytest.fixture(scope="module")
def slow_flash_run(runs, session_root):
    log = session_root / "varlen-probe-calls.txt"
    env = {**isolated_env(session_root), "ZERO_RECIPES_HARNESS_SLOW_PREP_S": str(PREP_S),
           "ZERO_RECIPES_HARNESS_SLOW_EXPORT_S": str(EXPORT_S), "ZERO_RECIPES_HARNESS_VARLEN_PROBE": "1",
           "ZERO_RECIPES_PROBE_LOG": str(log), "HF_HOME": str(session_root / "hf_home_slow"),  # a cold data cache
           **sync_probe(3)}
    start = time.monotonic()
    run = runs("slow-prep-varlen", *ARGS, "--attn_implementation", "varlen_probe", recipe="tests/scripts/harness.py",
               config="fsdp2", mixed_precision="no", env=env, timeout=400)
    return run, time.monotonic() - start, log


@pytest.mark.distributed
@pytest.mark.slow
def test_rank_0_preparation_and_export_outlast_the_collective_timeout(slow_flash_run):
    run, wall_s, _ = slow_flash_run
    run.check()
    assert wall_s > PREP_S + EXPORT_S  # the waits really happened, each longer than --collective_timeout_s
    assert run.summary()["steps"] == 4 and (run.output_dir / "final" / "model.safetensors").exists()


@pytest.mark.distributed
@pytest.mark.slow
def test_a_flash_attention_step_syncs_the_host_once(slow_flash_run):
    """Step 3 (tests/scripts/sync_probe.py): the varlen offsets were found on the host rows and copied with them,
    without blocking; the step's one host sync is ours, transformers' packed-rows check its own."""
    assert_one_host_sync(slow_flash_run[0].check(), forwards=1)


@pytest.mark.distributed
@pytest.mark.slow
def test_flash_attention_path_trains_as_sdpa_does(slow_flash_run, runs):
    """Under FSDP2 at micro-batch 2 the packed rows reached the varlen kernel (every layer, every micro-batch)
    and training equals sdpa's block masks: same losses."""
    run, _, log = slow_flash_run
    calls = log.read_text().split()
    assert calls.count("flash_attn_varlen_func") >= 4 * 2 * 4  # steps x ranks x 4 layers (1 micro-batch a step)
    sdpa = runs("slow-prep-sdpa-reference", *ARGS, config="fsdp2", mixed_precision="no").check()
    assert [m["loss"] for m in run.check().metrics()] == pytest.approx([m["loss"] for m in sdpa.metrics()], rel=1e-5)
