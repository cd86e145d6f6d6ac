"""The recipe's own cost at world size 1, before and after a change, side by side: recipes/llama_zero3.py of this
checkout, the same recipe of another checkout (e.g. `git worktree add /tmp/before <commit>`), and
benchmarks/plain_loop.py (the equal-work plain PyTorch loop), interleaved A B C A B C ... so that a slow minute of
the shared machine hits all three.

    python benchmarks/overhead.py --output_dir runs/overhead --before /tmp/before --repeats 5

Throughput of a run = global tokens per step / median step time over the steps after the first 4 (as
benchmarks/run.py times it). Prints and writes overhead.json: per repeat and as median (min-max), each recipe's
tokens/s over the plain loop's of the same repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import make_model  # noqa: E402  (the 3.3M-parameter Llama of the tests)

from zero_utils.launch.launcher import accelerate_launch_command, free_port  # noqa: E402

UNTIMED_STEPS = 4


def tokens_per_s(run_dir: Path, seq_len: int) -> float:
    """Global tokens per step over the median step time after UNTIMED_STEPS, from a recipe's metrics.jsonl."""
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = summary["global_batch_rows"] * seq_len
    return tokens / statistics.median([tokens / m["tokens_per_s"] for m in metrics][UNTIMED_STEPS:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--before", required=True, help="another checkout of this repository (the baseline)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max_steps", type=int, default=12)
    parser.add_argument("--seq_len", type=int, default=256)
    args = parser.parse_args(argv)
    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(out / "model") if not (out / "model/config.json").exists() else str(out / "model")
    common = ["--model", model, "--seq_len", str(args.seq_len), "--per_device_batch_size", "4",
              "--max_steps", str(args.max_steps)]
    recipe_flags = [*common, "--overwrite", "--eval_fraction", "0", "--max_new_tokens", "0", "--report_to", "none"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    candidates = {  # name: (checkout, script, flags)
        "after": (REPO, "recipes/llama_zero3.py", recipe_flags),
        "before": (Path(args.before).resolve(), "recipes/llama_zero3.py", recipe_flags),
        "plain_loop": (REPO, "benchmarks/plain_loop.py", [*common, "--untimed_steps", str(UNTIMED_STEPS)]),
    }
    rows = {name: [] for name in candidates}
    for repeat in range(args.repeats):
        for name, (tree, script, flags) in candidates.items():
            run_dir = out / "runs" / f"{name}-r{repeat}"
            cmd = accelerate_launch_command(tree / script, ["--output_dir", run_dir, *flags], num_processes=1,
                                            main_process_port=free_port(), mixed_precision="no")
            proc = subprocess.run(cmd, cwd=tree, env={**env, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
            rows[name].append(json.loads((run_dir / "plain_loop.json").read_text())["tokens_per_s"]
                              if name == "plain_loop" else tokens_per_s(run_dir, args.seq_len))
            print(f"repeat {repeat + 1}: {name} {rows[name][-1]:.0f} tokens/s", flush=True)

    def spread(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}

    results = {"command": " ".join(["python", "benchmarks/overhead.py", *(argv or sys.argv[1:])]),
               "tokens_per_s": {name: spread(v) for name, v in rows.items()},
               **{f"{name}_over_plain": spread([a / b for a, b in zip(rows[name], rows["plain_loop"], strict=True)])
                  for name in ("after", "before")}}
    (out / "overhead.json").write_text(json.dumps(results, indent=2) + "\n")
    for name in ("after", "before"):
        s = results[f"{name}_over_plain"]
        print(f"{name} / plain loop, tokens/s: {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
