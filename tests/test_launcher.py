"""zero_utils.launch.launcher, the one builder of `accelerate launch` lines (tests, benchmarks, compare), and
benchmarks/run.py, which parses its flags in main(), not at import. The expected lines are written out by hand."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from conftest import REPO

from zero_utils.launch.launcher import accelerate_launch_command, config_file, shown_command

pytestmark = pytest.mark.unit


def test_options_come_first_each_only_when_given(tmp_path):
    assert accelerate_launch_command("recipes/llama_zero3.py", ["--max_steps", 4], python="py") == [
        "py", "-m", "accelerate.commands.launch", "recipes/llama_zero3.py", "--max_steps", "4"]
    assert accelerate_launch_command(
        "r.py", ["--output_dir", tmp_path], config_file="c.yaml", num_processes=2, main_process_port=29511,
        mixed_precision="no", launch_args=("--max_restarts", 1), python="py") == [
        "py", "-m", "accelerate.commands.launch", "--config_file", "c.yaml", "--num_processes", "2",
        "--main_process_port", "29511", "--mixed_precision", "no", "--max_restarts", "1", "r.py", "--output_dir",
        str(tmp_path)]
    assert config_file("fsdp2") == REPO / "accelerate_configs" / "fsdp2.yaml" and config_file("fsdp2").is_file()


def test_the_shown_line_is_what_a_user_types():
    cmd = accelerate_launch_command("recipes/llama_zero3.py", ["--project", "my run"],
                                    config_file="accelerate_configs/zero3.yaml", num_processes=2, python="/venv/python")
    assert shown_command(cmd) == ("accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 "
                                  "recipes/llama_zero3.py --project 'my run'")
    with pytest.raises(ValueError):
        shown_command(["python", "recipes/llama_zero3.py"])


def test_benchmarks_run_parses_its_flags_in_main_not_at_import(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["run.py", "--not-a-flag-of-run-py"])
    # run.py puts benchmarks/ on sys.path and imports its memory.py: both undone after the test
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, "memory", None)
    del sys.modules["memory"]
    spec = importlib.util.spec_from_file_location("benchmarks_run", REPO / "benchmarks" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)  # would exit 2 on the unknown flag if it parsed sys.argv here
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--help"])
    assert exit_info.value.code == 0 and "--output_dir" in capsys.readouterr().out
