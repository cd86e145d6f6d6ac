"""Model-state bytes per rank, measured vs the engine formulas, for every engine at several world sizes.

    python benchmarks/memory.py --output_dir runs/memory [--world_sizes 1 2 4] [--mixed_precision no]
        [--gradient_accumulation_steps 2]

Launches the recipe (2 optimizer steps, a 3.3M-parameter Llama built from a config) once per engine and world
size with `accelerate launch`, reads each run's summary.json and writes to --output_dir:
    memory.json    every measurement (bytes, max over ranks and over the moments the recipe measures: after each
                   micro-batch's backward and after the optimizer step, in both steps)
    memory.md      the table (measured / expected / ratio to DDP)
    memory.png     bytes per rank vs world size: measured (points) and formula (lines) per engine
CPU-only machines run it over gloo; the numbers are the same on GPUs (the same tensors are held).
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
sys.path.insert(0, str(REPO))  # zero_utils from this checkout, also where it is not installed (the GPU machine)
from zero_utils.launch.launcher import accelerate_launch_command, config_file  # noqa: E402

ENGINES = ["ddp", "zero1", "zero2", "zero3", "fsdp2", "fsdp2_zero2"]


def make_model(path: Path, **overrides) -> str:
    """The 3.3M-parameter Llama of the tests (hidden 256, 4 layers), config and tokenizer only; `overrides` change
    its config (a larger vocabulary keeps the bundled tokenizer: its ids are a subset)."""
    from transformers import AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(REPO / "zero_utils/assets/tiny-llama")
    sizes = {"vocab_size": len(tokenizer), "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, **overrides}
    LlamaConfig(**sizes, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def measure(engine: str, world: int, model: str, output_dir: Path, mixed_precision: str, accumulation: int) -> dict:
    out = output_dir / "runs" / f"{engine}-{world}"
    cmd = accelerate_launch_command(
        REPO / "recipes/llama_zero3.py",
        ["--model", model, "--output_dir", out, "--overwrite", "--max_steps", "2", "--seq_len", "64",
         "--per_device_batch_size", "2", "--gradient_accumulation_steps", str(accumulation), "--eval_fraction", "0",
         "--max_new_tokens", "0", "--report_to", "none"],
        config_file=config_file(engine) if engine != "single" else None, num_processes=world,
        mixed_precision=mixed_precision)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} at {world} ranks failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"engine": engine, "world_size": world, "measured_bytes": summary["model_state_bytes"],
            "expected_bytes": summary["model_state_bytes_expected"], "num_params": summary["num_params"],
            "breakdown_bytes": summary["model_state_breakdown_bytes"]}


def write_table(rows: list[dict], path: Path, mixed_precision: str, accumulation: int) -> None:
    ddp = {r["world_size"]: r["measured_bytes"] for r in rows if r["engine"] == "ddp"}
    precision = "fp32" if mixed_precision == "no" else mixed_precision
    lines = [f"Model-state bytes per rank (max over ranks), {rows[0]['num_params']:,} parameters, "
             f"{precision}, gradient accumulation {accumulation}. MB = 1e6 bytes.", "",
             "| engine | ranks | measured MB | expected MB | measured / expected | bytes/param | vs DDP |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["measured_bytes"] / r["expected_bytes"]
        versus = r["measured_bytes"] / ddp[r["world_size"]] if r["world_size"] in ddp else float("nan")
        lines.append(f"| {r['engine']} | {r['world_size']} | {r['measured_bytes'] / 1e6:.2f} | "
                     f"{r['expected_bytes'] / 1e6:.2f} | {ratio:.4f} | {r['measured_bytes'] / r['num_params']:.2f} | "
                     f"{versus:.2f} |")
    path.write_text("\n".join(lines) + "\n")


def write_chart(rows: list[dict], path: Path, mixed_precision: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, engine in enumerate(dict.fromkeys(r["engine"] for r in rows)):
        mine = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["world_size"])
        worlds = [r["world_size"] for r in mine]
        color = f"C{i}"
        ax.plot(worlds, [r["expected_bytes"] / 1e6 for r in mine], "-", color=color, alpha=0.6)
        ax.plot(worlds, [r["measured_bytes"] / 1e6 for r in mine], "o", color=color, label=engine)
    ax.set_xscale("log", base=2)
    worlds = sorted({r["world_size"] for r in rows})
    ax.set_xticks(worlds, labels=[str(w) for w in worlds])
    ax.set_xlabel("ranks (processes)")
    ax.set_ylabel("model-state bytes per rank (MB = 1e6 bytes)")
    precision = "fp32" if mixed_precision == "no" else mixed_precision
    ax.set_title(f"Model states per rank: measured (points) vs formula (lines)\n{precision}, "
                 f"{rows[0]['num_params'] / 1e6:.1f}M params (zero1 = zero2, fsdp2 = fsdp2_zero2: points overlap)")
    ax.grid(alpha=0.3)
    ax.legend(title="engine")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--engines", nargs="+", default=ENGINES)
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16"])
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2,
                        help="micro-batches per step: at 2 the holdings between micro-batches are measured too")
    args = parser.parse_args()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "small-llama")
        rows = []
        for world in args.world_sizes:
            for engine in args.engines:
                rows.append(measure(engine, world, model, output_dir, args.mixed_precision,
                                    args.gradient_accumulation_steps))
                r = rows[-1]
                print(f"{engine:>12} x{world}: measured {r['measured_bytes'] / 1e6:8.2f} MB, "
                      f"expected {r['expected_bytes'] / 1e6:8.2f} MB", flush=True)
    (output_dir / "memory.json").write_text(json.dumps(rows, indent=2) + "\n")
    write_table(rows, output_dir / "memory.md", args.mixed_precision, args.gradient_accumulation_steps)
    write_chart(rows, output_dir / "memory.png", args.mixed_precision)
    print(f"wrote {output_dir / 'memory.md'} and {output_dir / 'memory.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
