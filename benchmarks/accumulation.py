"""FSDP2's training peak per rank with gradient accumulation, next to the same run without it, at a model size where
gradients show: what a rank holds between micro-batches (docs/MEMORY.md, "Gradient accumulation").

    python benchmarks/accumulation.py --output_dir runs/accumulation [--accumulation 1 4] [--variants ...]

Builds a 207M-parameter Llama from a config (hidden 1024, 16 layers, SwiGLU 2816, the bundled tokenizer's 872-token
vocabulary) and launches recipes/llama_zero3.py (through benchmarks/recipe_probe.py) under
accelerate_configs/fsdp2.yaml at 2 processes, fp32, micro-batch 1, seq_len 64, 3 steps, with
`MALLOC_MMAP_THRESHOLD_=65536` (glibc otherwise keeps freed blocks under its dynamic threshold on its heap, and the
RSS no longer follows the live tensors). Variants:
    recipe            the recipe as shipped: every micro-batch's gradients reduce-scattered
    checkpointing     the same with --gradient_checkpointing (saved activations of a few MB)
    accelerate        accelerate's default FSDP2 accumulation (BENCH_ACCELERATE_ACCUMULATION=1: unsharded gradients
                      on every rank until a step's last micro-batch)
For each variant and accumulation: the peak per step (`peak_mem_bytes` of metrics.jsonl, max over ranks: each
step's RSS high-water mark, reset when it starts), the training peak (summary.json) and the saved activations of a
micro-batch. Writes accumulation.json and accumulation.md to --output_dir (about 2 minutes a launch on 2 CPU cores;
needs about 6 GB of RAM).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # zero_utils from this checkout
sys.path.insert(0, str(REPO / "benchmarks"))
from memory import make_model  # noqa: E402  (benchmarks/memory.py: the tests' Llama, with overrides)

from zero_utils.launch.launcher import accelerate_launch_command, config_file  # noqa: E402

VARIANTS = {"recipe": ((), {}), "checkpointing": (("--gradient_checkpointing",), {}),
            "accelerate": ((), {"BENCH_ACCELERATE_ACCUMULATION": "1"})}
SIZES = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16,
         "num_key_value_heads": 16, "max_position_embeddings": 256}


def measure(variant: str, accumulation: int, model: str, output_dir: Path) -> dict:
    flags, extra_env = VARIANTS[variant]
    out = output_dir / "runs" / f"{variant}-{accumulation}"
    cmd = accelerate_launch_command(
        REPO / "benchmarks/recipe_probe.py",
        ["--model", model, "--output_dir", out, "--overwrite", "--max_steps", "3", "--seq_len", "64",
         "--per_device_batch_size", "1", "--gradient_accumulation_steps", str(accumulation), "--warmup_steps", "0",
         "--eval_fraction", "0", "--max_new_tokens", "0", "--report_to", "none", *flags],
        config_file=config_file("fsdp2"), num_processes=2, mixed_precision="no")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", "WANDB_MODE": "disabled",
           "MALLOC_MMAP_THRESHOLD_": "65536", **extra_env}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} at accumulation {accumulation} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line)["peak_mem_bytes"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"variant": variant, "accumulation": accumulation, "num_params": summary["num_params"],
            "peak_mem_bytes": summary["peak_mem_bytes"], "peak_mem_bytes_per_step": steps,
            "model_state_bytes": summary["model_state_bytes"],
            "model_state_bytes_expected": summary["model_state_bytes_expected"],
            "saved_activation_bytes": summary["saved_activation_bytes"]}


def write_table(rows: list[dict], path: Path) -> None:
    params = rows[0]["num_params"]
    base = {r["variant"]: r["peak_mem_bytes"] for r in rows if r["accumulation"] == 1}
    lines = [f"FSDP2, 2 ranks, fp32, micro-batch 1, seq_len 64, {params:,} parameters. MB = 1e6 bytes. Whole "
             f"gradients less their shard: 4 P - 4 P / N = {(4 * params - 2 * params) / 1e6:,.0f} MB.", "",
             "| variant | accumulation | training peak / rank, MB | vs accumulation 1, MB | peak per step, MB | "
             "model states (max over moments) / expected, MB | saved activations / micro-batch, MB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        rise = r["peak_mem_bytes"] - base[r["variant"]] if r["variant"] in base else None
        lines.append(f"| {r['variant']} | {r['accumulation']} | {r['peak_mem_bytes'] / 1e6:,.0f} | "
                     f"{'' if rise is None else f'{rise / 1e6:+,.0f}'} | "
                     f"{', '.join(f'{b / 1e6:,.0f}' for b in r['peak_mem_bytes_per_step'])} | "
                     f"{r['model_state_bytes'] / 1e6:,.1f} / {r['model_state_bytes_expected'] / 1e6:,.1f} | "
                     f"{r['saved_activation_bytes'] / 1e6:,.0f} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--accumulation", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "llama-200m", **SIZES)
        for variant in args.variants:
            for accumulation in args.accumulation:
                rows.append(measure(variant, accumulation, model, output_dir))
                r = rows[-1]
                print(f"{variant:>14} x{accumulation}: training peak {r['peak_mem_bytes'] / 1e6:,.0f} MB/rank, "
                      f"per step {[round(b / 1e6) for b in r['peak_mem_bytes_per_step']]}", flush=True)
    (output_dir / "accumulation.json").write_text(json.dumps(rows, indent=2) + "\n")
    write_table(rows, output_dir / "accumulation.md")
    print((output_dir / "accumulation.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
