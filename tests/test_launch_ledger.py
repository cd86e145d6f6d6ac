"""The suite's launch ledger (tests/launch_ledger.py): launches are counted where they start, a subprocess's too, a
file over its budget fails the run with one sentence, every test file has a budget, and scratch stays under pytest's
root. The planted file runs in a pytest of its own with its own ledger and budget table (2 torchrun launches of an
empty script, not counted in this suite's ledger)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, run_root
from launch_ledger import LEDGER_DIR, LEDGER_FILE, read_budgets, read_file_seconds

# Two tests, each starting one 2-process torchrun of an empty script: one directly, one from a Python subprocess;
# a third reads a shared run no test of the file launched, which the file needs as much as its own launches.
PLANTED = textwrap.dedent('''
    import subprocess, sys

    LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "empty.py"]

    def test_launches_directly():
        subprocess.run(LAUNCH, check=True)

    def test_launches_inside_a_subprocess():
        subprocess.run([sys.executable, "-c", f"import subprocess; subprocess.run({LAUNCH!r}, check=True)"],
                       check=True)

    def test_reads_a_shared_run_another_file_made():
        from launch_ledger import note_shared_run

        note_shared_run("made-elsewhere")  # as tests/conftest.py's `runs` does on a cache hit
''')


@pytest.mark.distributed
def test_a_planted_launch_over_budget_fails_the_run_and_a_subprocess_launch_counts(tmp_path):
    (tmp_path / "planted").mkdir()
    (tmp_path / "planted/test_plant.py").write_text(PLANTED)
    (tmp_path / "empty.py").write_text("")
    (tmp_path / "budgets.md").write_text("| test file | launches |\n|---|---|\n| planted/test_plant.py | 1 |\n")
    env = {name: value for name, value in os.environ.items()
           if name not in (LEDGER_FILE, LEDGER_DIR, "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    inner = ["-p", "launch_ledger", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "--basetemp",
             str(tmp_path / "basetemp"), "--launch-budgets", "budgets.md", "--launch-ledger", "ledger.jsonl"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", *inner, "planted/test_plant.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert "3 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert ("LAUNCH BUDGET: planted/test_plant.py needs 3 launches (2 made in it, 1 of other files' shared runs), "
            "over its budget of 1 in budgets.md: share a run or raise the budget there.") in proc.stdout
    lines = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    launches = [line for line in lines if not line.get("read")]
    assert [(x["test"].split("::")[1], x["run"]) for x in lines if x.get("read")] == [
        ("test_reads_a_shared_run_another_file_made", "made-elsewhere")]
    assert [(x["test"].split("::")[1], x["processes"]) for x in launches] == [
        ("test_launches_directly", 2), ("test_launches_inside_a_subprocess", 2)]
    assert all(x["file"] == "planted/test_plant.py" and x["seconds"] > 0 for x in launches)


@pytest.mark.unit
def test_every_test_file_has_a_launch_budget_and_every_budget_a_file():
    budgets = read_budgets(REPO / "docs/TESTING.md")
    files = {str(path.relative_to(REPO)) for path in (REPO / "tests").glob("test_*.py")}
    assert set(budgets) == files


@pytest.mark.unit
def test_budgets_and_seconds_come_from_the_budget_table_not_a_later_table_of_the_same_shape(tmp_path):
    # docs/TESTING.md's per-file before/after table has rows `| <file> | 6 numbers |` too: read as budgets, it
    # set test_benchmarks.py's budget to its 9 tests and failed CI (stop 82).
    doc = tmp_path / "TESTING.md"
    doc.write_text("# Tests\n\n| a | b |\n|---|---|\n| x | 1 |\n\n"
                   "| test file | budget | tests | launches | processes | launch s | test s |\n"
                   "|---|---|---|---|---|---|---|\n"
                   "| suite/test_a.py | 18 | 9 | 18 | 29 | 308 | 410 |\n"
                   "| suite/test_b.py | 0 | 3 | 0 | 0 | 0 | 35 |\n\n"
                   "## Later\n\n| test file | before | after | launches before | after | s before | s after |\n"
                   "|---|---|---|---|---|---|---|\n| suite/test_a.py | 9 | 9 | 20 | 18 | 500 | 444 |\n")
    assert read_budgets(doc) == {"suite/test_a.py": 18, "suite/test_b.py": 0}
    assert read_file_seconds(doc) == {"suite/test_a.py": 410, "suite/test_b.py": 35}


@pytest.mark.unit
def test_temporary_files_of_the_tests_and_their_processes_go_under_pytests_root(tmp_path_factory):
    root = run_root(tmp_path_factory)
    for name in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        assert Path(os.environ[name]).is_relative_to(root), name
    assert Path(tempfile.gettempdir()) == Path(os.environ["TMPDIR"])
