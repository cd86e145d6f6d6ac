"""Compare engines on one model: run each accelerate config with the same recipe, model, data, seed and global
batch, one after the other, then write one report (table + charts) and one W&B group. This module runs the configs
and is the command; the table, charts and W&B summary run are zero_utils.compare.report.

    python -m zero_utils.compare --configs ddp zero1 zero2 zero3 fsdp2 --num_processes 8 --max_steps 50 \\
        --output_dir runs/compare -- --model meta-llama/Llama-3.2-1B --seq_len 2048
    python -m zero_utils.compare --from runs/compare/ddp-8x runs/compare/fsdp2-8x --output_dir runs/compare2

A config is a name from accelerate_configs/ or a path to an accelerate YAML. Flags this CLI does not know (or that
follow `--`) go to the recipe; every run gets the same recipe flags and --num_processes, so the same global batch.
Files in --output_dir D:
    D/<config>-<N>x/       the recipe's run folder, plus launch.log (its output) and compare_run.json (how it ran)
    D/report.md            the table and the charts (memory.png, throughput.png, loss.png); MB = 1e6 bytes
    D/comparison.json      every run's status, error, W&B run id and group, and the table as numbers
With --report_to wandb each run is a W&B run in one group, plus a "summary" run with the table and the charts;
without an API key they are written offline under D and a `wandb sync` line says how to upload them.
Exit status: 0 when every run finished, 1 when one failed (the report shows it), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from zero_utils.compare.report import load_run, log_summary_run, markdown_table, write_report
from zero_utils.launch import launcher
from zero_utils.launch.shipped import shipped
from zero_utils.run.errors import UserError

SET_BY_COMPARE = ("--output_dir", "--report_to", "--project", "--group", "--max_steps")


def resolve_config(name: str) -> tuple[str, Path]:
    """A config name from accelerate_configs/ (e.g. 'zero2') or a path to a YAML -> (label, YAML path)."""
    if name.endswith((".yaml", ".yml")):
        path = Path(name).expanduser()
        if not path.is_file():
            raise UserError(f"config file {name!r} does not exist; pass a path to an accelerate YAML or a name.")
        return path.stem, path.resolve()
    path = launcher.config_file(name)
    if not path.is_file():
        names = " ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise UserError(f"unknown config {name!r}; use one of: {names} (or a path to an accelerate YAML).")
    return name, path


def launch_command(config_file: Path, num_processes: int, mixed_precision: str | None, recipe: Path, run_dir: Path,
                   max_steps: int, report_to: str, project: str, group: str, recipe_args: list[str]) -> list[str]:
    """The `accelerate launch` command of one run (launcher options before the recipe, recipe flags after)."""
    tracker = ["--project", project, "--group", group] if report_to != "none" else []
    return launcher.accelerate_launch_command(
        recipe, ["--output_dir", run_dir, "--max_steps", max_steps, "--report_to", report_to, *tracker, *recipe_args],
        config_file=config_file, num_processes=num_processes, mixed_precision=mixed_precision)


def _relative(arg: str) -> str:
    """A path under the current folder, relative to it (records stay valid when the folder moves)."""
    path = Path(arg)
    return str(path.relative_to(Path.cwd())) if path.is_absolute() and path.is_relative_to(Path.cwd()) else arg


def shown_command(cmd: list[str]) -> str:
    """launch_command's list as a user types it: `accelerate launch ...`, paths under the current folder relative."""
    return launcher.shown_command([_relative(arg) for arg in cmd])


def error_line(output: str) -> str:
    """The one line of a failed launch's output that says why: the recipe's `error: ...`, else the first exception
    raised in a rank (not the launcher's own CalledProcessError), else the last line."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in output.splitlines()]
    lines = [line for line in lines if line]
    found = next((line.removeprefix("error: ") for line in lines if line.startswith("error: ")), None)
    found = found or next((line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)
                           and not re.match(r"^[\w.]*(CalledProcessError|ChildFailedError)", line)), None)
    found = found or (lines[-1] if lines else "no output")
    return found if len(found) <= 300 else found[:297] + "..."


def _wandb_run_folder(run_dir: Path, since: float = 0.0) -> Path | None:
    """The newest W&B run folder (online `run-*` or `offline-run-*`) under run_dir/wandb, created after `since`."""
    folders = [p for p in (run_dir / "wandb").glob("*run-*-*") if p.is_dir() and p.stat().st_mtime >= since]
    return max(folders, key=lambda p: p.name.split("run-", 1)[1], default=None)


def run_one(config: str, cmd: list[str], run_dir: Path, env: dict, timeout_s: float | None, **info) -> dict:
    """Launch one run, its output into run_dir/launch.log. Returns its record (also written as compare_run.json):
    config, status ('ok' or 'failed'), error, wall_s (seconds), command, W&B run id and folder, and `info`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(run_dir / "launch.log", "w") as log:
        # A session of its own, so a timeout (or Ctrl-C) ends the launcher and every rank it started.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    error = None
    if returncode is None:
        error = f"timed out after {timeout_s:g} s (--timeout_s)"
    elif returncode != 0:
        error = error_line((run_dir / "launch.log").read_text(errors="replace"))
    elif not (run_dir / "summary.json").is_file():
        error = "the recipe exited without writing summary.json"
    wandb_folder = _wandb_run_folder(run_dir, since=start)
    record = {"config": config, **info, "status": "failed" if error else "ok", "error": error,
              "wall_s": round(time.time() - start, 1), "command": shown_command(cmd),
              "wandb_run_id": wandb_folder.name.rsplit("-", 1)[1] if wandb_folder else None,
              "wandb_dir": str(wandb_folder) if wandb_folder else None}
    (run_dir / "compare_run.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line through main(), not argparse's usage block
        raise UserError(f"{message}; see --help.")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m zero_utils.compare", allow_abbrev=False, description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--configs", nargs="+", metavar="CONFIG", help="names in accelerate_configs/ or YAML paths")
    what.add_argument("--from", dest="from_dirs", nargs="+", metavar="DIR", help="rebuild the report from these "
                      "run folders (summary.json + metrics.jsonl) or comparison folders, without training")
    p.add_argument("--output_dir", required=True, metavar="D", help="where the runs and the report go")
    p.add_argument("--num_processes", type=int, metavar="N", help="processes (GPUs) per run; required with --configs")
    p.add_argument("--max_steps", type=int, default=20, metavar="S", help="optimizer steps per run (default: 20)")
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], help="passed to accelerate launch "
                   "(default: what each YAML says)")
    p.add_argument("--recipe", default=str(shipped("recipes") / "llama_zero3.py"),
                   help="the recipe every config runs (default: this repository's recipes/llama_zero3.py)")
    p.add_argument("--report_to", default="wandb", help="wandb (offline without an API key) or none")
    p.add_argument("--project", default="zero-recipes", help="W&B project (default: %(default)s)")
    p.add_argument("--group", help="W&B group (default: compare-<model>-<date and time>)")
    p.add_argument("--timeout_s", type=float, help="stop a run after this many seconds and report it as failed")
    p.add_argument("--overwrite", action="store_true", help="reuse run folders that already hold a run")
    return p


def _model_name(recipe_args: list[str]) -> str:
    """The --model the recipe flags name (its last path part), else the bundled model's."""
    from zero_utils.assets import BUNDLED_MODEL

    model = next((a.split("=", 1)[1] for a in recipe_args if a.startswith("--model=")), None)
    if model is None and "--model" in recipe_args[:-1]:
        model = recipe_args[recipe_args.index("--model") + 1]
    return Path(model or BUNDLED_MODEL).name


def _wandb_mode(report_to: str) -> str | None:
    """'offline' when W&B is asked for but there is no API key (as the recipe decides), else WANDB_MODE or None."""
    from zero_utils.train.tracking import wandb_has_credentials

    if "wandb" in report_to and not os.environ.get("WANDB_MODE") and not wandb_has_credentials():
        return "offline"
    return os.environ.get("WANDB_MODE")


def _run_all(args, recipe_args: list[str], output_dir: Path, group: str, mode: str | None) -> list[dict]:
    """Check everything a user can get wrong before the first launch, then run the configs one after the other."""
    if args.num_processes is None or args.num_processes < 1:
        raise UserError("--configs needs --num_processes N (N >= 1): the processes (GPUs) every run uses.")
    if args.max_steps < 1:
        raise UserError(f"--max_steps {args.max_steps} is below 1; pass the optimizer steps per run, e.g. 20.")
    given = [a.split("=", 1)[0] for a in recipe_args]
    for flag in SET_BY_COMPARE:
        if flag in given:
            raise UserError(f"{flag} is set by compare for every run; pass it to compare itself, not to the recipe.")
    recipe = Path(args.recipe).expanduser().resolve()
    if not recipe.is_file():
        raise UserError(f"recipe {args.recipe!r} does not exist; pass --recipe path/to/recipe.py.")
    configs = [resolve_config(name) for name in args.configs]
    labels = [label for label, _ in configs]
    if len(set(labels)) != len(labels):
        raise UserError(f"--configs names a config twice ({' '.join(labels)}); give each once.")
    run_dirs = [output_dir / f"{label}-{args.num_processes}x" for label in labels]
    for run_dir in run_dirs:
        if not args.overwrite and run_dir.is_dir() and any(run_dir.iterdir()):
            raise UserError(f"{run_dir} already holds a run; pass --overwrite or another --output_dir.")
    here = str(Path(__file__).resolve().parents[2])  # the folder this zero_utils is imported from: the runs use it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    if mode:
        env["WANDB_MODE"] = mode
    recipe_args = recipe_args + (["--overwrite"] if args.overwrite else [])
    output_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for i, ((label, config_file), run_dir) in enumerate(zip(configs, run_dirs, strict=True), start=1):
        for stale in ("summary.json", "compare_run.json"):  # a failed rerun must not show the last run's numbers
            (run_dir / stale).unlink(missing_ok=True)
        cmd = launch_command(config_file, args.num_processes, args.mixed_precision, recipe, run_dir,
                             args.max_steps, args.report_to, args.project, group, recipe_args)
        print(f"[{i}/{len(configs)}] {label}: running on {args.num_processes} processes -> {run_dir}", flush=True)
        record = run_one(label, cmd, run_dir, env, args.timeout_s, config_file=_relative(str(config_file)),
                         num_processes=args.num_processes, model=_model_name(recipe_args),
                         group=group if "wandb" in args.report_to else None)
        run = load_run(run_dir)
        s = run["summary"]
        result = (f"ok in {record['wall_s']} s: final loss {s['final_loss']:.4f}, {s['tokens_per_s']:,.0f} tokens/s, "
                  f"model states {s['model_state_bytes'] / 1e6:.2f} MB/rank" if s else
                  f"FAILED in {record['wall_s']} s: {record['error']} (log: {run_dir / 'launch.log'})")
        print(f"[{i}/{len(configs)}] {label}: {result}", flush=True)
        runs.append(run)
    return runs


def _expand_from(paths: list[str]) -> list[str]:
    """A comparison folder (with comparison.json) stands for its run folders, in their order."""
    out = []
    for path in paths:
        listing = Path(path) / "comparison.json"
        if listing.is_file() and not (Path(path) / "summary.json").is_file():
            for run in json.loads(listing.read_text())["runs"]:  # next to the listing, else where it was
                beside = Path(path) / Path(run["run_dir"]).name
                out.append(str(beside) if beside.is_dir() else run["run_dir"])
        else:
            out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m zero_utils.compare`: run the configs (or read --from folders), write the report, log to W&B."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, recipe_args = _parser().parse_known_args(argv)
        recipe_args = [a for a in recipe_args if a != "--"]
        if args.from_dirs and recipe_args:
            raise UserError(f"--from reads finished runs; drop the recipe flags {' '.join(recipe_args)}.")
        output_dir = Path(args.output_dir)
        use_wandb = "wandb" in args.report_to
        group = args.group or f"compare-{_model_name(recipe_args)}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
        mode = _wandb_mode(args.report_to)
        if args.from_dirs:
            runs = [load_run(d) for d in _expand_from(args.from_dirs)]
            groups = {r["record"].get("group") for r in runs}
            group = args.group or (groups.pop() if len(groups) == 1 and None not in groups else group)
            output_dir.mkdir(parents=True, exist_ok=True)
        else:
            runs = _run_all(args, recipe_args, output_dir, group, mode)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    command = shlex.join(["python", "-m", "zero_utils.compare", *argv])
    report, rows, charts = write_report(output_dir, runs, command, group if use_wandb else None)
    summary_run = None
    if use_wandb:
        try:
            summary_run = log_summary_run(output_dir, args.project, group, rows, charts, mode)
        except Exception as error:  # the report is written; W&B trouble must not hide it
            print(f"warning: the W&B summary run failed ({error}); the report is complete without it.")
    listing = {"group": group if use_wandb else None, "project": args.project, "command": command,
               "runs": [{"config": r["config"], "run_dir": r["run_dir"], **r["record"],
                         "status": "ok" if r["summary"] else "failed"} for r in runs],
               "summary_run": summary_run, "table": rows}
    (output_dir / "comparison.json").write_text(json.dumps(listing, indent=2) + "\n")
    print(f"\n{markdown_table(rows)}\n\nreport: {report} (charts: {', '.join(c.name for c in charts)})")
    if use_wandb and mode == "offline":
        offline = [] if args.from_dirs else [r["record"].get("wandb_dir") for r in runs]
        offline += [summary_run["dir"]] if summary_run else []
        print(f"W&B is offline (no API key, or WANDB_MODE=offline): group {group!r}; upload with `wandb sync "
              f"{' '.join(shlex.quote(d) for d in offline if d)}`")
    failed = [r["config"] for r in runs if not r["summary"]]
    if failed:
        print(f"failed: {', '.join(failed)} (see the status column and each run's launch.log)")
    return 1 if failed and not args.from_dirs else 0  # --from only reports past failures
