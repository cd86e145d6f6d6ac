"""How far each engine's bf16 training drifts from fp32 training of the same pretrained model.

    python benchmarks/bf16_drift.py --output_dir runs/bf16_drift [--max_steps 20]

Saves a pretrained checkpoint (the 3.3M-parameter Llama of the tests, fp32 safetensors), fine-tunes it once in
fp32 on one process (the reference) and once per engine in bf16 (every shipped YAML's precision) on 2 processes,
same data, same global batch of 8 rows, and writes to --output_dir:
    drift.json   per engine: the loss curve, the largest relative loss difference to the reference, and the
                 final weights' distance to the reference's, relative to how far the reference moved
                 (||w - w_fp32|| / ||w_fp32 - w_0||, over all parameters)
    drift.md     the table of docs/PRECISION.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # zero_utils from this checkout, also where it is not installed (the GPU machine)
from zero_utils.launch.launcher import accelerate_launch_command, config_file  # noqa: E402

ENGINES = ["ddp", "zero1", "zero2", "zero3", "fsdp2"]


def make_checkpoint(path: Path) -> str:
    import torch
    from memory import make_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config_dir = make_model(path.parent / "config-only")
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(config_dir).save_pretrained(path)
    return str(path)


def fine_tune(engine: str, model: str, output_dir: Path, steps: int, mixed_precision: str) -> Path:
    out = output_dir / "runs" / f"{engine}-{mixed_precision}"
    world = 1 if engine == "single" else 2
    cmd = accelerate_launch_command(
        REPO / "recipes/llama_zero3.py",
        ["--model", model, "--output_dir", out, "--overwrite", "--max_steps", steps, "--seq_len", "128",
         "--per_device_batch_size", 8 // world, "--warmup_steps", "2", "--lr", "1e-3", "--eval_fraction", "0",
         "--max_new_tokens", "0", "--report_to", "none"],
        config_file=config_file(engine) if engine != "single" else None, num_processes=world,
        mixed_precision=mixed_precision)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} {mixed_precision} failed:\n{proc.stderr[-3000:]}")
    return out


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights_distance(a: dict, b: dict) -> float:
    return sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a) ** 0.5


def main() -> None:
    from safetensors.torch import load_file

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=20)
    args = parser.parse_args()
    output_dir = Path(args.output_dir)
    checkpoint = make_checkpoint(output_dir / "pretrained")
    initial = load_file(f"{checkpoint}/model.safetensors")
    reference = fine_tune("single", checkpoint, output_dir, args.max_steps, "no")
    ref_losses, ref_weights = losses(reference), load_file(reference / "final" / "model.safetensors")
    moved = weights_distance(ref_weights, initial)
    rows = []
    for engine in ["single", *ENGINES]:
        run = fine_tune(engine, checkpoint, output_dir, args.max_steps, "bf16")
        curve = losses(run)
        weights = load_file(run / "final" / "model.safetensors")
        rows.append({"engine": engine, "world_size": 1 if engine == "single" else 2, "losses": curve,
                     "max_rel_loss_diff": max(abs(a - b) / b for a, b in zip(curve, ref_losses, strict=True)),
                     "final_rel_loss_diff": (curve[-1] - ref_losses[-1]) / ref_losses[-1],
                     "weights_drift_over_update": weights_distance(weights, ref_weights) / moved})
        print(f"{engine:>6} bf16: max |loss - fp32| / fp32 = {rows[-1]['max_rel_loss_diff']:.2e}, weights drift "
              f"{rows[-1]['weights_drift_over_update']:.3f} of the fp32 update", flush=True)
    (output_dir / "drift.json").write_text(json.dumps({"reference_losses": ref_losses, "steps": args.max_steps,
                                                       "rows": rows}, indent=2))
    lines = [f"bf16 vs fp32 single-process fine-tuning of the same checkpoint, {args.max_steps} steps, global batch "
             "8 x 128 tokens, lr 1e-3.", "",
             "| engine | ranks | max relative loss difference | final loss difference | weights drift / fp32 update |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['engine']} | {r['world_size']} | {r['max_rel_loss_diff']:.2e} | {r['final_rel_loss_diff']:+.2e} | "
              f"{r['weights_drift_over_update']:.3f} |" for r in rows]
    (output_dir / "drift.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
