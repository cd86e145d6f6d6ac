"""What the DPO recipe's frozen reference model costs per rank under each engine, measured next to its formula.

    python benchmarks/dpo_reference.py --output_dir runs/dpo_reference [--configs ddp zero1 ...] [--world_size 2]
    python benchmarks/dpo_reference.py --recipe recipes/llama_dpo_lora.py --configs ddp zero3 fsdp2 \
        --output_dir runs/dpo_lora_reference      # LoRA-DPO: the reference is the policy with its adapters off
    python benchmarks/dpo_reference.py --reference precomputed --configs ddp zero3 fsdp2 \
        --output_dir runs/dpo_precomputed         # the reference's log-probs computed once, the reference freed

Runs `--recipe` (default recipes/llama_dpo.py; sigmoid loss, the bundled model and pairs, each YAML as shipped:
bf16 mixed precision) for 3 steps under every config, side by side, through `python -m zero_utils.compare` (its
report and charts land in --output_dir too), and writes results.json and results.md: per config the reference's
bytes per rank measured from its tensors (`reference_state_bytes`, the maximum over ranks), its formula
(`reference_state_bytes_expected`: 2 bytes x Psi in bf16, divided by the ranks where the engine shards
parameters; LoRA-DPO: the fit check's reference term, 0), the ratio to DDP's, and the policy's model states next to
them. About 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ["ddp", "zero1", "zero2", "zero3", "fsdp2", "fsdp2_zero2", "zero3_offload", "fsdp2_offload"]

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--output_dir", required=True)
parser.add_argument("--configs", nargs="+", default=CONFIGS)
parser.add_argument("--world_size", type=int, default=2)
parser.add_argument("--recipe", default="recipes/llama_dpo.py", help="llama_dpo.py or llama_dpo_lora.py under recipes/")
parser.add_argument("--reference", default="model", choices=["model", "precomputed"], help="recipes/llama_dpo.py's "
                    "--reference (precomputed: training holds 8 bytes a pair of it)")


def main() -> None:
    args = parser.parse_args()
    out = Path(args.output_dir)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    compare = [sys.executable, "-m", "zero_utils.compare", "--recipe", args.recipe, "--configs",
               *args.configs, "--num_processes", str(args.world_size), "--max_steps", "3", "--output_dir",
               str(out), "--report_to", "none", "--", "--max_new_tokens", "0", "--eval_every", "0",
               *(["--reference", args.reference] if args.reference != "model" else [])]
    proc = subprocess.run(compare, cwd=REPO, env=env)
    rows = []
    for config in args.configs:
        summary_path = out / f"{config}-{args.world_size}x" / "summary.json"
        if not summary_path.is_file():
            rows.append({"config": config, "error": "no summary.json (see its launch.log)"})
            continue
        s = json.loads(summary_path.read_text())
        rows.append({"config": config, "engine": s["engine"], "mixed_precision": s["mixed_precision"],
                     "num_params": s["num_params"], "reference_state_bytes": s["reference_state_bytes"],
                     "reference_state_bytes_expected": s.get("reference_state_bytes_expected",
                                                             s["fit_check"]["reference_bytes"]),  # LoRA-DPO: 0
                     "model_state_bytes": s["model_state_bytes"],
                     "reference_model": s.get("reference_state_bytes_expected") is not None})  # LoRA-DPO: none
    ddp = next((r for r in rows if r.get("engine") == "ddp"), None)
    flags = f"--recipe {args.recipe} --reference {args.reference} --configs {' '.join(args.configs)}"
    lines = [f"DPO reference per rank during training, {args.recipe} --reference {args.reference}, {args.world_size} "
             f"processes, bundled model, YAMLs as shipped (`python benchmarks/dpo_reference.py {flags} --output_dir "
             f"{args.output_dir}`); MB = 1e6 bytes.", "",
             "| config | reference measured, MB | formula, MB | measured / formula | x DDP | policy model states, MB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error']} | | | | |")
            continue
        ratio = f"{r['reference_state_bytes'] / ddp['reference_state_bytes']:.2f}" if ddp and ddp[
            "reference_state_bytes"] else ""
        measured_over_formula = (f"{r['reference_state_bytes'] / r['reference_state_bytes_expected']:.4f}"
                                 if r["reference_state_bytes_expected"] else "")
        measured = f"{r['reference_state_bytes'] / 1e6:.3f}" if r["reference_model"] else "none built (adapters off)"
        lines.append(f"| {r['config']} | {measured} | "
                     f"{r['reference_state_bytes_expected'] / 1e6:.3f} | {measured_over_formula} | {ratio} | "
                     f"{r['model_state_bytes'] / 1e6:.2f} |")
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
