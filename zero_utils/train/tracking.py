"""Run records: metrics.jsonl (one line per optimizer step), summary.json, and accelerate trackers such as W&B.

Rank-0 discipline lives here: every method may be called on every rank and writes only on the main process, so
recipes need no `if is_main:` around logging. metrics.jsonl is the readable record (wandb's offline log is
binary); it is appended to, so a resumed run continues the same file.

The bookkeeping every recipe shares lives here too: the tracker's config (the recipe's settings, the engine, world
size, precision, parameters and optimizer groups, the global batch, the fit check, a mixture's sources) and
summary.json's keys (the same, with the meter's figures, losses, the data, the answer and the final checkpoint's
bytes) come from `RunTracker` given the run's parts; a recipe passes only its own keys (`config=`, `own=`).
"""

from __future__ import annotations

import json
import netrc
import os
from dataclasses import asdict
from pathlib import Path

from zero_utils.run.versions import software_versions
from zero_utils.train.measurement import checkpoint_bytes, rank_spread


def trackers_for(report_to: str) -> list[str] | None:
    """Accelerate `log_with` value for `--report_to` ('none' -> no tracker; 'wandb'; or any accelerate tracker,
    comma-separated)."""
    names = [n.strip() for n in report_to.split(",") if n.strip() and n.strip() != "none"]
    return names or None


def wandb_has_credentials() -> bool:
    """Whether W&B can log in here: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


class RunTracker:
    """Writes a run's per-step metrics and summary on the main process, and forwards them to accelerate trackers.

        tracker = RunTracker(accelerator, cfg, engine, data=train_data, fit=fit, num_params=n,
                             param_groups=groups, resumed=checkpointer.resumed, config={"attention": "sdpa"})
        tracker.log_step(result, eval_loss=eval_loss)                         # every step
        summary = tracker.write_summary(meter, last, eval_loss=eval_loss, answer=answer,
                                        checkpoint=final_checkpoint, own={"perplexity": ...})

    `settings`: the recipe's settings dataclass, every flag of which goes into the config; the tracker reads its
    output_dir, report_to, project, group (the W&B group), max_steps, seq_len and prompt. `data`: the run's
    `TrainingData` or `PreferenceData` (its `info` and `global_batch_record()`), `fit`: the `FitCheck`.
    Files under `output_dir`: `metrics.jsonl` and `summary.json` (written at the end). A fresh run starts
    metrics.jsonl anew; a run resumed at step k keeps the lines up to that step (an interrupted run may
    have logged steps after its last checkpoint) and appends (`resumed`: `checkpoint.Checkpointer.resumed`, which
    also names the W&B run to continue). The software versions are added to the tracker's
    config (`version_<name>`) and to the summary (`versions`), with the W&B run id (`tracker_run_id`). With W&B
    and no credentials the run is written offline under `output_dir/wandb` and one line says how to sync it.
    The W&B run is named `run_name` (default `<engine>-<world size>x`).
    """

    def __init__(self, accelerator, settings, engine, *, data, fit, num_params: int, param_groups,
                 resumed=None, run_name: str | None = None, config: dict | None = None):
        self.accelerator, self.settings, self.engine, self.data, self.fit = accelerator, settings, engine, data, fit
        self.num_params, self.param_groups = num_params, param_groups
        self.output_dir = Path(settings.output_dir)
        self.is_main = accelerator.is_main_process
        self.trackers = trackers_for(settings.report_to) or []
        world = accelerator.num_processes
        # the run's config as the trackers get it (also without a tracker): the settings, the run's facts, versions
        self.config = {**asdict(settings), "engine": engine.name, "world_size": world, "num_params": num_params,
                       "optimizer_param_groups": param_groups, "mixed_precision": accelerator.mixed_precision,
                       **data.global_batch_record(), **fit.summary(), "data_sources": data.info.get("sources"),
                       **(config or {}), **{f"version_{k}": v for k, v in software_versions().items()}}
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            _restart_metrics(self.output_dir / "metrics.jsonl", resumed.step if resumed else None)
        if not self.trackers:
            return
        init_kwargs = {}
        if "wandb" in self.trackers:
            if not wandb_has_credentials() and not os.environ.get("WANDB_MODE"):
                os.environ["WANDB_MODE"] = "offline"
            init_kwargs["wandb"] = {"dir": str(self.output_dir), "name": run_name or f"{engine}-{world}x",
                                    "group": settings.group or None}
            if resumed and resumed.tracker_run_id:  # the resumed run continues the same W&B run: one curve, not two
                init_kwargs["wandb"].update(id=resumed.tracker_run_id, resume="allow")
        accelerator.init_trackers(settings.project, config=_loggable(self.config), init_kwargs=init_kwargs)
        if self.is_main and "wandb" in self.trackers and os.environ.get("WANDB_MODE") == "offline":
            run_dir = accelerator.get_tracker("wandb", unwrap=True).dir
            offline_dir = Path(run_dir).parent
            print(f"[zero_utils] W&B is offline (no API key or network): run saved in {offline_dir}; "
                  f"upload it later with `wandb sync {offline_dir}`.")

    @property
    def run_id(self) -> str | None:
        """The W&B run id (stored in checkpoints so a resumed run continues the same W&B run), or None."""
        if "wandb" in self.trackers and self.is_main:
            return self.accelerator.get_tracker("wandb", unwrap=True).id
        return None

    def log_step(self, result, eval_loss: float | None = None, eval_metrics: dict | None = None) -> None:
        """Append one optimizer step's metrics (`measurement.StepResult.metrics`, and `eval_loss` or
        `eval_metrics` (prefixed `eval_`) when evaluated) to metrics.jsonl and send them to the trackers."""
        metrics = {**result.metrics(), **({"eval_loss": eval_loss} if eval_loss is not None else {}),
                   **{f"eval_{k}": v for k, v in (eval_metrics or {}).items()}}
        if self.trackers:
            values = {k: v for k, v in metrics.items() if k != "step" and v is not None}
            self.accelerator.log(values, step=metrics["step"])
        if self.is_main:
            with open(self.output_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")

    def write_summary(self, meter, last, *, eval_loss: float | None, answer: str, checkpoint, own: dict) -> dict:
        """Write summary.json (and the tracker's run summary) on the main process and return it: the run's facts
        (engine, world size, precision, steps, parameters, global batch, seq_len, the data's info, optimizer groups,
        --prompt and `answer`, the group), `last` step's loss (a `StepResult`, None if no step ran), `eval_loss`,
        `meter.summary()` (a collective: every rank calls this), the fit check's estimate, the final `checkpoint`
        (a path) and its bytes, then the recipe's `own` keys. Every rank must call it."""
        s = self.settings
        summary = {"engine": self.engine.name, "world_size": self.accelerator.num_processes,
                   "mixed_precision": self.accelerator.mixed_precision, "steps": s.max_steps,
                   "final_loss": last.loss if last else None, "eval_loss": eval_loss, **meter.summary(),
                   **self.fit.summary(),  # the estimate next to the measured peak_mem_bytes
                   "num_params": self.num_params, **self.data.global_batch_record(), "seq_len": s.seq_len,
                   "data": self.data.info, "optimizer_param_groups": self.param_groups, "prompt": s.prompt,
                   "answer": answer, "group": s.group or None, "checkpoint": str(checkpoint),
                   "checkpoint_bytes": checkpoint_bytes(checkpoint), **own}
        self.write(summary)
        return summary

    def write(self, summary: dict) -> None:
        """Write `summary` as summary.json (and the tracker's run summary) on the main process, with the software
        versions and the W&B run id."""
        summary = {**summary, "versions": software_versions(), "tracker_run_id": self.run_id}
        if self.is_main:
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            if "wandb" in self.trackers:
                run = self.accelerator.get_tracker("wandb", unwrap=True)
                run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})


def _restart_metrics(path: Path, resume_step: int | None) -> None:
    if resume_step is None or not path.exists():
        path.unlink(missing_ok=True)
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= resume_step]
    path.write_text("".join(line + "\n" for line in kept))


def _loggable(config: dict) -> dict:
    return {k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for k, v in config.items()}


RANK_SPREAD_SHOWN = 0.05  # the summary table names each rank's figure when ranks differ by more than this


def summary_table(summary: dict) -> str:
    """The end-of-run table a person reads: engine, world size, steps, losses, tokens/s, memory (MB = 1e6 bytes).
    A memory row whose ranks differ by more than 5% (`measurement.rank_spread` of its `*_per_rank` list) also shows
    the smallest and largest rank: an uneven shard or a rank that holds more than its share stands out."""
    def fmt(value, spec):
        return format(value, spec) if isinstance(value, (int, float)) else "n/a"

    def spread(key, spec):
        values = s.get(f"{key}_per_rank")
        fraction = rank_spread(values)
        if fraction is None or fraction <= RANK_SPREAD_SHOWN:
            return ""
        low, high = values.index(min(values)), values.index(max(values))
        return (f" (ranks differ by {fraction:.0%}: rank {low} {fmt(values[low] / 1e6, spec)} MB, "
                f"rank {high} {fmt(values[high] / 1e6, spec)} MB)")
    s = summary
    rows = [("engine", s["engine"]), ("world size", s["world_size"]), ("steps", s["steps"]),
            ("final loss", fmt(s["final_loss"], ".4f")), ("eval loss", fmt(s["eval_loss"], ".4f")),
            ("tokens/s (median, global)", fmt(s["tokens_per_s"], ",.0f")
             + (f" (first step {s['first_step_extra_s']:+.1f} s)" if s.get("first_step_extra_s") else "")),
            ("peak memory per rank (max)", fmt((s["peak_mem_bytes"] or 0) / 1e6, ",.1f") + " MB"
             + spread("peak_mem_bytes", ",.1f")),
            ("model states per rank: measured / expected", fmt((s["model_state_bytes"] or 0) / 1e6, ".2f") + " / "
             + fmt(s["model_state_bytes_expected"] / 1e6, ".2f") + " MB" + spread("model_state_bytes", ".2f"))]
    if s.get("peak_mem_bytes_estimated") is not None:  # zero_utils.memory.fit_check's estimate, made before the run
        rows.insert(7, ("peak memory per rank (estimated)", fmt(s["peak_mem_bytes_estimated"] / 1e6, ",.1f") + " MB"))
    if s.get("peak_reserved_bytes") is not None:
        rows.insert(7, ("peak reserved per rank (max)", fmt(s["peak_reserved_bytes"] / 1e6, ",.1f") + " MB"
                        + spread("peak_reserved_bytes", ",.1f")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
