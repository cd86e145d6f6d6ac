"""Mistakes a user can make end in one sentence, exit code 2, no traceback from our code, and no rank left
waiting: launched as users launch, on 2 processes (the in-process checks are in test_data and test_configs)."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = [pytest.mark.distributed]
FAST = ("--max_steps", "1", "--report_to", "none", "--max_new_tokens", "0", "--seq_len", "64")


def assert_one_sentence(run, *needles):
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert errors, run.stderr[-3000:]
    assert all(needle in errors[0] for needle in needles), errors[0]
    assert not re.search(r'File ".*/(zero_utils|recipes)/', run.stderr)  # no traceback through our code


def test_missing_dataset_stops_every_rank(runs, tmp_path):
    run = runs("bad-dataset-path", *FAST, "--dataset", str(tmp_path / "missing.jsonl"), config="fsdp2", timeout=180)
    assert_one_sentence(run, "missing.jsonl", "does not exist")


def test_a_failure_on_the_main_process_ends_every_rank_with_its_sentence_and_code_2(runs, tmp_path):
    """An empty data file, found by the main process while the other rank waits for its data: both ranks print the
    sentence and exit 2 (torchrun's report lists exitcode 2 for each, not a dead peer or its SIGTERM)."""
    (tmp_path / "empty.jsonl").write_text("")
    run = runs("bad-dataset-empty", *FAST, "--dataset", str(tmp_path / "empty.jsonl"), config="ddp", timeout=180)
    assert_one_sentence(run, "empty.jsonl", "is empty (0 bytes)")
    assert len(re.findall(r"error: [^\n]*is empty", run.stderr)) == 2  # a line may follow another's bar (no \n)
    report = re.findall(r"rank\s+:\s+(\d+) \(local_rank: \d+\)\n\s+exitcode\s+:\s+(-?\d+)", run.stderr)
    assert sorted(report) == [("0", "2"), ("1", "2")], run.stderr[-3000:]


def test_dataset_without_known_columns_names_them(runs, tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) + "\n" for i in range(20)))
    run = runs("bad-dataset-columns", *FAST, "--dataset", str(path), config="zero3", timeout=180)
    assert_one_sentence(run, "['answer', 'question']", "--columns")


def test_seq_len_beyond_the_model_is_refused(runs):
    run = runs("bad-seq-len", *FAST[:-2], "--seq_len", "4096", config="ddp", timeout=180)
    assert_one_sentence(run, "--seq_len 4096", "max_position_embeddings")


def test_stale_deepspeed_build_lock_stops_the_launch(runs, session_root):
    """Before DeepSpeed loads its ops (inside Accelerator()), an abandoned build lock stops the launch with the
    file to remove; without the check the launch waits on it forever (here: until this test's timeout)."""
    import os
    import time

    from conftest import isolated_env

    extensions = session_root / "stale-lock-extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    os.utime(lock, (time.time() - 3600,) * 2)
    env = {**isolated_env(session_root), "TORCH_EXTENSIONS_DIR": str(extensions)}
    run = runs("bad-stale-lock", *FAST, config="zero1", num_processes=1, env=env, timeout=120)
    assert_one_sentence(run, str(lock), "minutes old", f"rm {lock}")
