"""The prepared-data cache (issue 67 item 4), in processes of their own as users meet it: `python -m zero_utils.data
cache` lists what jobs prepared (kind, data, tokenizer, seq_len, size, last use), and `--prune` removes by age or
size, never a folder a running job holds: a second process holds one (`cache.hold`, as a job's open does) while
it is 30 days old. No launch."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, isolated_env

pytestmark = pytest.mark.unit

PREPARE = """
import sys
from types import SimpleNamespace
from transformers import AutoTokenizer
from zero_utils.data.preparation import prepare
from zero_utils.data.sft_rows import SFTRows
from zero_utils.assets import BUNDLED_DATASET
from zero_utils.assets import BUNDLED_MODEL
from zero_utils.assets import BUNDLED_PREFERENCES
from zero_utils.preference.pair_rows import PairRows

one, tokenizer, root = SimpleNamespace(is_main_process=True, num_processes=1), AutoTokenizer.from_pretrained(
    BUNDLED_MODEL), sys.argv[1]
for seq_len in (64, 128):
    print(prepare(one, tokenizer, BUNDLED_DATASET, SFTRows(seq_len, 0), eval_fraction=0.1, seed=0, cache_root=root,
                  num_proc=1)[2]["folder"])
print(prepare(one, tokenizer, BUNDLED_PREFERENCES, PairRows(128), eval_fraction=0.1, seed=0, cache_root=root,
              num_proc=1)[2]["folder"])
"""
HOLD = "import sys\nfrom zero_utils.data.cache import hold\nhold(sys.argv[1])\nprint('held', flush=True)\ninput()\n"


def cache_cli(root, *args) -> str:
    proc = subprocess.run([sys.executable, "-m", "zero_utils.data", "cache", "--cache_dir", str(root), *args],
                          cwd=REPO, env=isolated_env(root.parent), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def age(folder, days: float) -> None:
    """Set the folder's last use `days` back (.in_use, written by every hold, and info.json)."""
    when = time.time() - days * 86400
    for name in (".in_use", "info.json"):
        if (folder / name).exists():
            os.utime(folder / name, (when, when))


def test_the_cache_lists_and_prunes_but_never_a_folder_a_running_job_holds(tmp_path):
    from pathlib import Path

    from zero_utils.assets import BUNDLED_DATASET, BUNDLED_MODEL, BUNDLED_PREFERENCES

    root = tmp_path / "rows"
    prepared = subprocess.run([sys.executable, "-c", PREPARE, str(root)], cwd=REPO, env=isolated_env(tmp_path),
                              capture_output=True, text=True, timeout=300)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    sft64, sft128, pairs = (Path(line) for line in prepared.stdout.split())
    listing = cache_cli(root)
    rows = {line.split(" | ")[-1].strip(" |"): line for line in listing.splitlines() if line.startswith("| ")}
    assert rows[sft64.name].startswith(f"| SFT rows | {BUNDLED_DATASET} | {BUNDLED_MODEL} | 64 | ")
    assert rows[sft128.name].startswith(f"| SFT rows | {BUNDLED_DATASET} | {BUNDLED_MODEL} | 128 | ")
    assert rows[pairs.name].startswith(f"| preference pairs | {BUNDLED_PREFERENCES} | {BUNDLED_MODEL} | 128 | ")
    assert "3 folder(s)" in listing and "(0.0 days ago)" in rows[sft64.name]

    assert "removed" not in cache_cli(root, "--prune", "--keep_days", "7")  # all used just now
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(sft64)], cwd=REPO, env=isolated_env(tmp_path),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for folder in (sft64, sft128, pairs):
            age(folder, 30)  # the held one too: a job that started 30 days ago and still runs
        assert "would remove" in cache_cli(root, "--prune", "--keep_days", "7", "--dry_run")
        assert sft128.exists() and pairs.exists()
        pruned = cache_cli(root, "--prune", "--keep_days", "7")
        assert f"held by a running job: kept: {sft64} (SFT rows" in pruned
        assert f"removed: {sft128} (SFT rows" in pruned and f"removed: {pairs} (preference pairs" in pruned
        assert not sft128.exists() and not pairs.exists() and (sft64 / "train.arrow").is_file()
        assert "removed" not in cache_cli(root, "--prune", "--max_gb", "0")  # still held
    finally:
        holder.communicate("\n", timeout=60)
    assert f"removed: {sft64}" in cache_cli(root, "--prune", "--max_gb", "0")  # the job ended: its lock with it
    assert not sft64.exists() and "0 folder(s)" in cache_cli(root)


def test_prune_without_a_rule_or_a_rule_without_prune_is_one_sentence(tmp_path):
    for args, sentence in ((["--prune"], "--prune needs --keep_days N or --max_gb G"),
                           (["--keep_days", "3"], "--keep_days, --max_gb and --dry_run go with --prune")):
        proc = subprocess.run([sys.executable, "-m", "zero_utils.data", "cache", "--cache_dir", str(tmp_path), *args],
                              cwd=REPO, env=isolated_env(tmp_path), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and sentence in proc.stderr, proc.stderr
