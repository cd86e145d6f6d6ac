"""The comparison's report: each run folder read back (summary.json, metrics.jsonl), the table with ratios to DDP,
the charts (memory, throughput, loss) and the W&B summary run of the group. Reads run folders only, so it also
reports runs made earlier (`python -m zero_utils.compare --from ...`, compare.runner). Units: MB = 1e6 bytes,
tokens/s, seconds.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path

from zero_utils.run.errors import UserError

# The summary.json numbers that get a ratio to DDP (units: bytes, bytes, tokens/s, seconds, nats).
METRICS = ("model_state_bytes", "peak_mem_bytes", "tokens_per_s", "step_time_s", "final_loss")
_PRECISION = {"no": "fp32", "bf16": "bf16 mixed precision", "fp16": "fp16 mixed precision"}


def load_run(run_dir: str | Path) -> dict:
    """A run folder -> {config, run_dir, summary (or None), metrics (list of per-step dicts), record (compare's
    compare_run.json, or {})}. Raises UserError for a folder that holds neither summary.json nor compare_run.json."""
    run_dir = Path(run_dir)
    summary_path, record_path = run_dir / "summary.json", run_dir / "compare_run.json"
    if not summary_path.is_file() and not record_path.is_file():
        raise UserError(f"{run_dir} holds no summary.json (nor compare_run.json); pass a recipe's --output_dir.")
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    metrics_path = run_dir / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line] \
        if summary and metrics_path.is_file() else []
    config = record.get("config") or re.sub(r"-\d+x$", "", run_dir.name)
    return {"config": config, "run_dir": str(run_dir), "summary": summary, "metrics": metrics, "record": record}


def build_table(runs: list[dict]) -> tuple[list[dict], str | None]:
    """One row per run (load_run's dicts): config, engine, world_size, model_state_bytes and
    model_state_bytes_expected (per rank), peak_mem_bytes (per rank) and peak_mem_bytes_estimated (the fit check's
    estimate before the run, per rank), tokens_per_s (global, median), step_time_s
    (median), final_loss, error; and ratio_<metric> = value / the DDP row's value for each of METRICS.

    The baseline is the first successful run whose engine is ddp; without one every ratio is None. Returns (rows,
    the baseline's config or None)."""
    baseline = next((r["summary"] for r in runs if r["summary"] and r["summary"].get("engine") == "ddp"), None)
    rows = []
    for run in runs:
        s = run["summary"] or {}
        row = {"config": run["config"], "engine": s.get("engine"),
               "world_size": s.get("world_size", run["record"].get("num_processes")),
               "model_state_bytes_expected": s.get("model_state_bytes_expected"),
               "peak_mem_bytes_estimated": s.get("peak_mem_bytes_estimated"),
               "reference_state_bytes": s.get("reference_state_bytes"),  # recipes/llama_dpo.py's reference model
               "error": None if run["summary"] else run["record"].get("error") or "no summary.json"}
        for key in METRICS:
            row[key] = s.get(key)
            base = (baseline or {}).get(key)
            row[f"ratio_{key}"] = row[key] / base if row[key] is not None and base else None
        rows.append(row)
    return rows, next((r["config"] for r in runs if r["summary"] is baseline), None) if baseline else None


def markdown_table(rows: list[dict]) -> str:
    """build_table's rows as a Markdown table: MB = 1e6 bytes per rank, and (x DDP) ratios where there are some."""
    def cell(row, key, scale=1.0, spec=".2f"):
        if row[key] is None:
            return ""
        ratio = row.get(f"ratio_{key}")
        return format(row[key] / scale, spec) + (f" ({ratio:.2f}x)" if ratio is not None else "")

    header = ["config", "engine", "world size", "model states / rank, MB (measured)", "expected, MB",
              "peak memory / rank, MB", "estimated, MB", "tokens/s", "step time, s", "final loss", "status"]
    reference = any(row.get("reference_state_bytes") for row in rows)  # a preference run's reference model
    if reference:
        header.insert(5, "reference / rank, MB")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        status = "ok" if not row["error"] else "failed: " + row["error"].replace("|", "\\|")
        cells = [row["config"], row["engine"] or "", str(row["world_size"] or ""),
                 cell(row, "model_state_bytes", 1e6), cell(row, "model_state_bytes_expected", 1e6),
                 cell(row, "peak_mem_bytes", 1e6, ",.1f"), cell(row, "peak_mem_bytes_estimated", 1e6, ",.1f"),
                 cell(row, "tokens_per_s", spec=",.0f"),
                 cell(row, "step_time_s", spec=".3f"), cell(row, "final_loss", spec=".4f"), status]
        if reference:
            cells.insert(5, cell(row, "reference_state_bytes", 1e6))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _bar_axes(rows: list[dict], title: str, ylabel: str):
    """A figure with one x slot per config (config and engine as the tick label, 'failed' where a run failed)."""
    fig, ax = _pyplot().subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.8), dpi=120)
    for x, row in enumerate(rows):
        if row["error"]:
            ax.text(x, 0, "failed", ha="center", va="bottom", color="#c44e52", fontweight="bold")
    ticks = [r["config"] if r["engine"] in (None, r["config"]) else f"{r['config']}\n({r['engine']})" for r in rows]
    ax.set_xticks(range(len(rows)), ticks)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.margins(y=0.2)
    return fig, ax


def plot_memory(runs: list[dict], rows: list[dict], path: Path, subtitle: str) -> Path:
    """Stacked bars of model-state MB per rank (params / grads / optimizer, measured; a preference run's reference
    model on top) with the formula's value for the model states."""
    fig, ax = _bar_axes(rows, f"Model states per rank by engine (measured)\n{subtitle}",
                        "model states per rank, MB (1 MB = 1e6 bytes)")
    xs, bottoms = range(len(runs)), [0.0] * len(runs)
    for kind, color in (("params", "#4c72b0"), ("grads", "#dd8452"), ("optimizer", "#55a868")):
        heights = [((r["summary"] or {}).get("model_state_breakdown_bytes") or {}).get(kind, 0) / 1e6 for r in runs]
        ax.bar(xs, heights, 0.6, bottom=bottoms, label=kind, color=color)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    references = [((r["summary"] or {}).get("reference_state_bytes") or 0) / 1e6 for r in runs]
    if any(references):  # recipes/llama_dpo.py: the frozen reference, held as the engine holds params
        ax.bar(xs, references, 0.6, bottom=bottoms, label="reference model", color="#8172b3", hatch="//")
        bottoms = [b + h for b, h in zip(bottoms, references, strict=True)]
    labelled = False
    for x, row, top in zip(xs, rows, bottoms, strict=True):
        if row["error"]:
            continue
        if row["model_state_bytes_expected"]:
            ax.hlines(row["model_state_bytes_expected"] / 1e6, x - 0.35, x + 0.35, colors="black", linestyles="--",
                      label=None if labelled else "expected (formula)")
            labelled = True
        ax.annotate(f"{top:.2f}", (x, top), xytext=(0, 4), textcoords="offset points", ha="center", fontsize=9)
    ax.legend(loc="upper right")
    return _save(fig, path)


def plot_throughput(rows: list[dict], path: Path, subtitle: str) -> Path:
    """Bars of global tokens/s (median over steps) per config, with the ratio to DDP on each bar."""
    fig, ax = _bar_axes(rows, f"Training throughput by engine (higher is better)\n{subtitle}",
                        "tokens/s (global, median over steps)")
    for x, row in enumerate(rows):
        if row["error"]:
            continue
        ax.bar(x, row["tokens_per_s"], 0.6, color="#4c72b0")
        ratio = f"\n{row['ratio_tokens_per_s']:.2f}x DDP" if row["ratio_tokens_per_s"] is not None else ""
        ax.text(x, row["tokens_per_s"], f"{row['tokens_per_s']:,.0f}{ratio}", ha="center", va="bottom", fontsize=9)
    return _save(fig, path)


def plot_loss(runs: list[dict], path: Path, subtitle: str) -> Path:
    """Training loss per optimizer step, one line per config; below it each loss minus DDP's when DDP ran."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    done = [r for r in runs if r["metrics"]]
    ddp = next((r for r in done if r["summary"].get("engine") == "ddp"), None)
    fig, axes = plt.subplots(2 if ddp else 1, 1, figsize=(8, 6.4 if ddp else 4.8), dpi=120, sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [2, 1]} if ddp else None)
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(done):
        steps, losses = [m["step"] for m in run["metrics"]], [m["loss"] for m in run["metrics"]]
        style = {"linestyle": styles[i % 4], "marker": "os^vDx*P"[i % 8], "markersize": 4, "label": run["config"]}
        axes[0][0].plot(steps, losses, **style)
        if ddp:
            base = {m["step"]: m["loss"] for m in ddp["metrics"]}
            axes[1][0].plot(steps, [loss - base.get(s, float("nan")) for s, loss in zip(steps, losses, strict=True)],
                            **style)
    axes[0][0].set_ylabel("training loss (token cross-entropy)")
    axes[0][0].set_title(f"Training loss by engine (same data, seed and global batch)\n{subtitle}", fontsize=11)
    axes[0][0].legend()
    if ddp:
        axes[1][0].set_ylabel("loss - DDP loss")
    axes[-1][0].set_xlabel("optimizer step")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    fig.clear()
    return path


def write_report(output_dir: Path, runs: list[dict], command: str, group: str | None) -> tuple[Path, list[dict], list]:
    """Write report.md and its three PNG charts into output_dir. Returns (report path, table rows, chart paths)."""
    rows, baseline = build_table(runs)
    done = [r["summary"] for r in runs if r["summary"]]
    first = done[0] if done else {}
    batches = sorted({(s.get("global_batch_rows"), s.get("seq_len")) for s in done}, key=str)
    precisions = "/".join(sorted({_PRECISION.get(s.get("mixed_precision"), str(s.get("mixed_precision")))
                                  for s in done})) or "n/a"
    world = ", ".join(sorted({str(r["world_size"]) for r in rows if r["world_size"]}))
    models = ", ".join(dict.fromkeys(r["record"]["model"] for r in runs if r["record"].get("model")))
    subtitle = (f"{models + ', ' if models else ''}{(first.get('num_params') or 0) / 1e6:.2f}M params, "
                f"{world} processes, {precisions}")
    charts = [plot_memory(runs, rows, output_dir / "memory.png", subtitle),
              plot_throughput(rows, output_dir / "throughput.png", subtitle),
              plot_loss(runs, output_dir / "loss.png", subtitle)]
    no_baseline = "No DDP baseline" + (" (the ddp run failed)" if any(r["config"] == "ddp" for r in runs) else "")
    no_baseline += ": ratios left blank."
    batch_text = " and ".join(f"{b} rows of {L} tokens" for b, L in batches) or "n/a"
    lines = [f"# Engine comparison: {subtitle}", "",
             f"Made with `{command}` on {datetime.date.today()}." + (f" W&B group `{group}`." if group else ""), "",
             f"Every config ran the same recipe, model, data, seed and global batch ({batch_text} per optimizer step: "
             f"per-device batch x gradient accumulation x {world} processes, passed unchanged to every run)"
             + (", **but the runs differ in global batch: compare with care**." if len(batches) > 1 else "."),
             f"Software: {', '.join(f'{k} {v}' for k, v in (first.get('versions') or {}).items())}.", "",
             "MB = 1e6 bytes, per rank (the maximum over ranks). Model states = params + grads + optimizer state, "
             "the most measured after any micro-batch's backward or optimizer update of the first two steps; expected "
             "= zero_utils.formulas.model_states's formula. Peak memory is the largest training step's own peak: the "
             "accelerator allocator's on GPU, the process RSS high-water mark on CPU (which also holds the Python "
             "runtime and libraries, several hundred MB the estimate leaves out); estimated = the recipe's fit "
             "check before the run (zero_utils.memory.fit_check). tokens/s is global and "
             "step time per optimizer step, both medians over steps. "
             + (f"(0.50x) = the value over the `{baseline}` row's value." if baseline else no_baseline),
             "", markdown_table(rows), ""]
    lines += [f"![{c.stem}]({c.name})" for c in charts]
    lines += ["", "## Runs", ""]
    for run in runs:
        status = "ok" if run["summary"] else f"failed: {run['record'].get('error') or 'no summary.json'}"
        folder = os.path.relpath(run["run_dir"], output_dir)
        lines.append(f"- `{run['config']}` ({status}), folder [{folder}]({folder})"
                     + (f": `{run['record']['command']}`" if run["record"].get("command") else ""))
    path = output_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path, rows, charts


def log_summary_run(output_dir: Path, project: str, group: str, rows: list[dict], charts: list,
                    mode: str | None) -> dict:
    """One W&B run ('summary', same group) holding the comparison as a wandb.Table, bar charts and the PNGs.
    Returns {'id', 'dir'} of that run."""
    import wandb

    columns = ["config", "engine", "world_size", "model_state_mb", "model_state_expected_mb", "peak_mem_mb",
               "peak_mem_estimated_mb", "reference_mb", "tokens_per_s", "step_time_s", "final_loss",
               *(f"ratio_{k}" for k in METRICS), "error"]
    data = [[r["config"], r["engine"], r["world_size"], *(None if r[k] is None else r[k] / 1e6 for k in
             ("model_state_bytes", "model_state_bytes_expected", "peak_mem_bytes", "peak_mem_bytes_estimated",
              "reference_state_bytes")),
             r["tokens_per_s"], r["step_time_s"], r["final_loss"], *(r[f"ratio_{k}"] for k in METRICS), r["error"]]
            for r in rows]
    run = wandb.init(project=project, group=group, name="summary", job_type="comparison", dir=str(output_dir),
                     mode=mode, config={"configs": [r["config"] for r in rows]})
    table = wandb.Table(columns=columns, data=data)
    # Loss curves need no chart here: the group's runs log `loss` per step, and W&B overlays them.
    run.log({"comparison": table, **{f"chart_{c.stem}": wandb.Image(str(c)) for c in charts},
             "tokens_per_s_by_engine": wandb.plot.bar(table, "config", "tokens_per_s", title="tokens/s by engine"),
             "model_state_mb_by_engine": wandb.plot.bar(table, "config", "model_state_mb",
                                                        title="model states per rank (MB) by engine")})
    info = {"id": run.id, "dir": str(Path(run.dir).parent)}
    run.finish()
    return info
