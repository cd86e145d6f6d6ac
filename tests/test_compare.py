"""python -m zero_utils.compare: one real comparison (ddp, zero2, fsdp2 and a config that fails) on 2 processes serves
the report, chart, W&B and --from assertions; the table logic is also tested in process on hand-made summaries.

The failing config is an accelerate YAML written for the test: fsdp2.yaml with `fsdp_version: 1`, which
zero_utils.run.accelerator refuses with a UserError in every rank before any work (deterministic, about 6 s). It also
exercises configs given as YAML paths.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONFIGS, REPO, isolated_env

from zero_utils.compare import report as compare_report
from zero_utils.compare import runner as compare
from zero_utils.run.errors import UserError

GROUP = "test-compare-group"
FSDP1_ERROR = "the accelerate config asks for FSDP version 1"
TINY = ("--seq_len", "64", "--per_device_batch_size", "2", "--max_new_tokens", "0", "--eval_fraction", "0")


def _compare(*args: str, env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zero_utils.compare", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _table_rows(report: Path) -> list[str]:
    return [line for line in report.read_text().splitlines() if line.startswith("|")]


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """The one real comparison: (completed process, output dir, env)."""
    root = tmp_path_factory.mktemp("compare")
    broken = root / "fsdp1.yaml"
    broken.write_text((CONFIGS / "fsdp2.yaml").read_text().replace("fsdp_version: 2", "fsdp_version: 1"))
    assert "fsdp_version: 1" in broken.read_text()
    env = isolated_env(root)
    out = root / "cmp"
    proc = _compare("--configs", "ddp", "zero2", "fsdp2", str(broken), "--num_processes", "2", "--max_steps", "3",
                    "--mixed_precision", "no", "--output_dir", str(out), "--group", GROUP, "--report_to", "wandb",
                    "--", *TINY, env=env)
    return proc, out, env


@pytest.mark.distributed
@pytest.mark.slow
def test_report_has_one_row_per_config_and_the_failure(comparison):
    proc, out, _ = comparison
    assert proc.returncode == 1, proc.stdout + proc.stderr  # 1: the report is written, but a run failed
    for i, config in enumerate(["ddp", "zero2", "fsdp2", "fsdp1"], start=1):
        assert f"[{i}/4] {config}: running on 2 processes" in proc.stdout
    rows = _table_rows(out / "report.md")[2:]
    assert [row.split("|")[1].strip() for row in rows] == ["ddp", "zero2", "fsdp2", "fsdp1"]
    assert all(row.rstrip(" |").endswith("ok") for row in rows[:3]), rows
    assert f"failed: {FSDP1_ERROR}" in rows[3]
    assert "(1.00x)" in rows[0] and "(0.50x)" in rows[2]  # fsdp2 holds half of DDP's model states on 2 ranks
    header = [cell.strip() for cell in _table_rows(out / "report.md")[0].split("|")]
    measured, estimated = header.index("peak memory / rank, MB"), header.index("estimated, MB")
    for row, config in zip(rows[:3], ("ddp", "zero2", "fsdp2"), strict=True):  # the fit check's estimate, shown
        summary = json.loads((out / f"{config}-2x" / "summary.json").read_text())
        cells = [cell.strip() for cell in row.split("|")]
        assert estimated == measured + 1 and cells[estimated] == f"{summary['peak_mem_bytes_estimated'] / 1e6:,.1f}"
    report = (out / "report.md").read_text()
    assert "same recipe, model, data, seed and global batch (4 rows of 64 tokens" in report
    assert "`fsdp1` (failed: " in report and (out / "fsdp1-2x" / "launch.log").is_file()


@pytest.mark.distributed
@pytest.mark.slow
def test_charts_are_legible_pngs(comparison):
    import matplotlib.image

    _, out, _ = comparison
    report = (out / "report.md").read_text()
    for name in ("memory.png", "throughput.png", "loss.png"):
        assert f"]({name})" in report
        assert (out / name).stat().st_size > 10_000
        height, width, _channels = matplotlib.image.imread(out / name).shape
        assert height >= 400 and width >= 600


@pytest.mark.distributed
@pytest.mark.slow
def test_one_wandb_offline_run_per_config_in_one_group(comparison):
    proc, out, _ = comparison
    listing = json.loads((out / "comparison.json").read_text())
    assert listing["group"] == GROUP
    ok_runs = [r for r in listing["runs"] if r["status"] == "ok"]
    assert [r["config"] for r in ok_runs] == ["ddp", "zero2", "fsdp2"]
    for run in [*ok_runs, {**listing["summary_run"], "config": "summary", "wandb_run_id": listing["summary_run"]["id"],
                           "wandb_dir": listing["summary_run"]["dir"]}]:
        folder = Path(run["wandb_dir"])
        assert folder.name.startswith("offline-run-") and folder.name.endswith(run["wandb_run_id"])
        assert len(list(folder.parent.glob("offline-run-*"))) == 1
        # The run's binary log (protobuf records) holds its group and name as plain UTF-8.
        log = (folder / f"run-{run['wandb_run_id']}.wandb").read_bytes()
        assert GROUP.encode() in log
        assert (f"{run['config']}-2x" if run["config"] != "summary" else "summary").encode() in log
        assert str(folder) in proc.stdout  # the printed `wandb sync ...` line names it
    assert "wandb sync" in proc.stdout
    failed = next(r for r in listing["runs"] if r["config"] == "fsdp1")
    assert failed["status"] == "failed" and FSDP1_ERROR in failed["error"] and failed["wandb_run_id"] is None


@pytest.mark.distributed
@pytest.mark.slow
def test_from_rebuilds_the_same_table_without_training(comparison, tmp_path):
    _, out, env = comparison
    run_dirs = [str(out / f"{config}-2x") for config in ("ddp", "zero2", "fsdp2", "fsdp1")]
    proc = _compare("--from", *run_dirs, "--output_dir", str(tmp_path / "again"), "--report_to", "none", env=env,
                    timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _table_rows(tmp_path / "again" / "report.md") == _table_rows(out / "report.md")
    assert not (tmp_path / "again" / "wandb").exists()
    assert {p.name for p in (tmp_path / "again").iterdir()} == {"report.md", "comparison.json", "memory.png",
                                                                 "throughput.png", "loss.png"}


# ---------------------------------------------------------------------------------------------- in process
def _fake_run(config: str, engine: str | None, state_bytes: float = 0, tokens_per_s: float = 0, error: str = None):
    """A load_run-shaped dict from hand-made numbers (a failed run when `error` is given)."""
    if error:
        return {"config": config, "run_dir": f"/runs/{config}-2x", "summary": None, "metrics": [],
                "record": {"config": config, "error": error, "num_processes": 2}}
    summary = {"engine": engine, "world_size": 2, "mixed_precision": "no", "model_state_bytes": state_bytes,
               "model_state_bytes_expected": state_bytes, "peak_mem_bytes": 2 * state_bytes,
               "model_state_breakdown_bytes": {"params": state_bytes / 4, "grads": state_bytes / 4,
                                               "optimizer": state_bytes / 2, "total": state_bytes},
               "tokens_per_s": tokens_per_s, "step_time_s": 1000 / tokens_per_s, "final_loss": 2.0,
               "num_params": 10**6, "global_batch_rows": 4, "seq_len": 64, "versions": {"torch": "2.13.0"}}
    return {"config": config, "run_dir": f"/runs/{config}-2x", "summary": summary, "record": {},
            "metrics": [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]}


@pytest.mark.unit
def test_ratios_are_relative_to_the_ddp_row():
    rows, baseline = compare_report.build_table([_fake_run("fsdp2", "fsdp2", 8e6, 3000),
                                                 _fake_run("ddp", "ddp", 16e6, 4000),
                                                 _fake_run("zero3", None, error="boom | bad")])
    assert baseline == "ddp"
    fsdp2, ddp, failed = rows
    assert fsdp2["ratio_model_state_bytes"] == pytest.approx(0.5)
    assert fsdp2["ratio_tokens_per_s"] == pytest.approx(0.75)
    assert fsdp2["ratio_step_time_s"] == pytest.approx(4 / 3)
    assert ddp["ratio_final_loss"] == 1.0
    assert failed["error"] == "boom | bad" and failed["ratio_tokens_per_s"] is None and failed["world_size"] == 2
    table = compare_report.markdown_table(rows).splitlines()
    assert table[2].startswith("| fsdp2 | fsdp2 | 2 | 8.00 (0.50x) | 8.00 | 16.0 (0.50x) |  | 3,000 (0.75x) |")
    assert table[4].endswith("| failed: boom \\| bad |")  # a pipe in the error does not break the table


@pytest.mark.unit
def test_without_ddp_the_ratios_are_blank(tmp_path):
    runs = [_fake_run("zero2", "zero2", 12e6, 3000), _fake_run("fsdp2", "fsdp2", 8e6, 2500)]
    rows, baseline = compare_report.build_table(runs)
    assert baseline is None and all(r[f"ratio_{k}"] is None for r in rows for k in compare_report.METRICS)
    assert "x)" not in compare_report.markdown_table(rows)
    report, _, charts = compare_report.write_report(tmp_path, runs, "python -m zero_utils.compare ...", group=None)
    assert "No DDP baseline: ratios left blank." in report.read_text()
    assert all(c.stat().st_size > 0 for c in charts)


@pytest.mark.unit
def test_error_line_prefers_the_recipe_message_then_the_rank_exception():
    assert compare.error_line("noise\n[rank0]: error: --seq_len 9999 is too long; lower it.\nTraceback\n"
                              "subprocess.CalledProcessError: Command ... returned 2") == \
        "--seq_len 9999 is too long; lower it."
    assert compare.error_line("Traceback (most recent call last):\n[rank1]: RuntimeError: loss is nan at step 3\n"
                              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n") == \
        "RuntimeError: loss is nan at step 3"
    assert compare.error_line("") == "no output"


@pytest.mark.unit
def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(UserError, match="unknown config 'zero4'; use one of: .*zero3"):
        compare.resolve_config("zero4")
    with pytest.raises(UserError, match="holds no summary.json"):
        compare_report.load_run(tmp_path)
    assert compare.main(["--configs", "ddp", "nope", "--num_processes", "2", "--output_dir", str(tmp_path)]) == 2
    assert compare.main(["--configs", "ddp", "--num_processes", "2", "--output_dir", str(tmp_path), "--",
                         "--output_dir", "x"]) == 2
    assert compare.main(["--from", str(tmp_path), "--output_dir", str(tmp_path / "r")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and all(line.startswith("error: ") for line in errors), errors
    assert "--output_dir is set by compare" in errors[1]
