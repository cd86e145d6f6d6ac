"""DPO beside trl: the same model, pairs, global batches, optimizer and steps through recipes/llama_dpo.py and through
trl's DPOTrainer, each under the same accelerate YAMLs, side by side.

    pip install --no-deps trl==1.16.0      # the benchmark's only extra (measured with trl 1.16.0); never a dependency
    python benchmarks/trl_dpo.py --output_dir runs/trl_dpo [--configs fsdp2 zero3] [--steps 8] [--skip_trl]

Both sides: the bundled model's config with weights drawn from --seed, saved once to --output_dir/base (trl builds
its reference from a model's path; the recipe reads it as any pretrained --model), sigmoid loss, --beta, fp32
(--mixed_precision no), AdamW (0.9, 0.999, eps 1e-8, no weight decay: transformers' defaults), a constant --lr, no
warmup, gradients clipped at 1.0, --per_device_batch_size pairs on each of --world_size processes, --seq_len tokens.
The pairs are the bundled ones; trl gets them as chat messages (it applies the chat template to conversational
pairs; the recipe applies it to string pairs), in the recipe's order: step s trains the recipe's global batch of
step s (`zero_utils.data.training.global_batch_indices`) through a sequential sampler.

trl runs in its own process (benchmarks/trl_dpo_worker.py), after zero_utils.run.accelerator's CPU adaptation: without
it accelerate selects FSDP only for accelerator devices and trl's Trainer under fsdp2.yaml would silently run DDP. Each
side's real engine is read from its Accelerator; a mismatch is an error row, not a result. Written to --output_dir:
results.json and results.md (per config and side: the engine, step 1's and the last step's loss, the largest loss
difference to ours, the last reward margin, the peak memory per rank during training, the reference model's bytes per
rank, the median step time, the launch's wall time; ratios to ours), each side's launch log and outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ["fsdp2", "zero3"]

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--output_dir", required=True)
parser.add_argument("--configs", nargs="+", default=CONFIGS, help="YAML names (default: %(default)s)")
parser.add_argument("--world_size", type=int, default=2)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--per_device_batch_size", type=int, default=4, help="pairs per process per step")
parser.add_argument("--seq_len", type=int, default=128)
parser.add_argument("--lr", type=float, default=1e-4)
parser.add_argument("--beta", type=float, default=0.1)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--skip_trl", action="store_true", help="our side and the table only (no trl needed)")
parser.add_argument("--trl_path", default="", help="a folder put first on trl's PYTHONPATH (a pip --target)")


def ordered_pairs(out: Path, steps: int, global_batch: int, seed: int) -> int:
    """Write the bundled pairs of steps 1..`steps`, in the recipe's order, as chat messages for trl; return the
    number of bundled pairs (the recipe's train split with --eval_fraction 0)."""
    from zero_utils.assets import BUNDLED_PREFERENCES
    from zero_utils.data.training import global_batch_indices

    rows = [json.loads(line) for line in Path(BUNDLED_PREFERENCES).read_text().splitlines() if line.strip()]
    with open(out, "w") as f:
        for step in range(1, steps + 1):
            for i in global_batch_indices(len(rows), global_batch, step, seed):
                row = rows[i]
                f.write(json.dumps({"prompt": [{"role": "user", "content": row["prompt"]}],
                                    "chosen": [{"role": "assistant", "content": row["chosen"]}],
                                    "rejected": [{"role": "assistant", "content": row["rejected"]}]}) + "\n")
    return len(rows)


def _launch(config: str, world: int, script: list[str], log: Path, pythonpath: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(REPO), os.environ.get("PYTHONPATH", "")]),
           "TQDM_DISABLE": "1", "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / f"{config}.yaml"), "--num_processes", str(world), "--mixed_precision",
           "no", *script]
    started = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"exit code {code}; see {log}")
    return time.perf_counter() - started


def saved_base(out: Path, seed: int) -> Path:
    """The bundled model's config with weights drawn from `seed`, and its tokenizer, saved to out/base (fp32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from zero_utils.assets import BUNDLED_MODEL

    base = out / "base"
    if not (base / "model.safetensors").is_file():
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BUNDLED_MODEL)).save_pretrained(base)
        AutoTokenizer.from_pretrained(BUNDLED_MODEL).save_pretrained(base)
    return base


def run_ours(config: str, args, out: Path, pairs: int) -> dict:
    folder = out / f"ours-{config}"
    folder.mkdir(parents=True, exist_ok=True)
    wall = _launch(config, args.world_size, [
        str(REPO / "recipes/llama_dpo.py"), "--model", str(out / "base"), "--output_dir", str(folder), "--overwrite",
        "--max_steps", str(args.steps),
        "--per_device_batch_size", str(args.per_device_batch_size), "--seq_len", str(args.seq_len), "--lr",
        str(args.lr), "--beta", str(args.beta), "--seed", str(args.seed), "--warmup_steps", "0", "--lr_schedule",
        "constant", "--adam_beta2", "0.999", "--weight_decay", "0", "--max_grad_norm", "1.0", "--eval_fraction", "0",
        "--eval_every", "0", "--max_new_tokens", "0", "--report_to", "none"], folder / "launch.log", [])
    summary = json.loads((folder / "summary.json").read_text())
    train = summary["data"]["train"]
    if train["pairs"] != pairs or train["dropped"]:
        raise RuntimeError(f"the recipe kept {train['pairs']} of {pairs} pairs: trl's order would not match")
    steps = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"engine": summary["engine"], "wall_s": wall, "step_time_s": summary["step_time_s"],
            "peak_mem_bytes": max(summary["peak_mem_bytes_per_rank"]),
            "reference_state_bytes": summary["reference_state_bytes"],
            "steps": [{"step": m["step"], "loss": m["loss"], "margins": m["reward_margin"],
                       "chosen": m["reward_chosen"], "rejected": m["reward_rejected"]} for m in steps]}


def run_trl(config: str, args, out: Path, pairs_file: Path) -> dict:
    folder = out / f"trl-{config}"
    folder.mkdir(parents=True, exist_ok=True)
    wall = _launch(config, args.world_size, [
        str(REPO / "benchmarks/trl_dpo_worker.py"), "--model", str(out / "base"), "--pairs", str(pairs_file),
        "--result", str(folder / "result.json"), "--output_dir", str(folder), "--steps", str(args.steps),
        "--per_device_batch_size", str(args.per_device_batch_size), "--seq_len", str(args.seq_len), "--lr",
        str(args.lr), "--beta", str(args.beta), "--seed", str(args.seed)], folder / "launch.log",
        [args.trl_path] if args.trl_path else [])
    result = json.loads((folder / "result.json").read_text())
    return {"engine": result["engine"], "wall_s": wall, "step_time_s": statistics.median(result["step_time_s"]),
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in result["per_rank"]),
            "reference_state_bytes": max(r["reference_state_bytes"] for r in result["per_rank"]),
            "steps": result["steps"]}


def table(rows: list[dict], command: str) -> list[str]:
    """results.md: one line per config and side; ratios to ours of the same config. `rows`: {"config", "side",
    and run_ours'/run_trl's keys, or "error"}."""
    lines = [f"DPO beside trl (`{command}`): CPU, {'fp32'}, the bundled tiny model; MB = 1e6 bytes.", "",
             "| config | side | engine | loss step 1 | loss last | max abs loss diff to ours | reward margin last | "
             "peak memory / rank, MB | reference / rank, MB | step time, s | wall time, s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ours = {r["config"]: r for r in rows if r["side"] == "ours" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['side']} | failed: {r['error']} | | | | | | | | |")
            continue
        base = ours.get(r["config"])

        def ratio(key, scale=1.0, digits=2, r=r, base=base):
            value = f"{r[key] / scale:.{digits}f}"
            return value if r is base or not base or not base[key] else f"{value} ({r[key] / base[key]:.2f}x)"

        diff = (max(abs(a["loss"] - b["loss"]) for a, b in zip(r["steps"], base["steps"], strict=False))
                if base and r is not base else 0.0)
        lines.append(f"| {r['config']} | {r['side']} | {r['engine']} | {r['steps'][0]['loss']:.6f} | "
                     f"{r['steps'][-1]['loss']:.6f} | {diff:.2e} | {r['steps'][-1]['margins']:.4f} | "
                     f"{ratio('peak_mem_bytes', 1e6, 1)} | {ratio('reference_state_bytes', 1e6, 3)} | "
                     f"{ratio('step_time_s', 1, 3)} | {ratio('wall_s', 1, 1)} |")
    return lines


def main() -> None:
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs_file = out / "pairs_in_order.jsonl"
    pairs = ordered_pairs(pairs_file, args.steps, args.per_device_batch_size * args.world_size, args.seed)
    saved_base(out, args.seed)
    rows = []
    for config in args.configs:
        sides = [("ours", lambda c=config: run_ours(c, args, out, pairs))]
        if not args.skip_trl:
            sides.append(("trl", lambda c=config: run_trl(c, args, out, pairs_file)))
        for side, run in sides:
            try:
                row = {"config": config, "side": side, **run()}
                if row["engine"] != config:  # what the Accelerator really ran is not what the YAML names
                    row = {"config": config, "side": side, "error": f"ran {row['engine']}, not {config}"}
            except (RuntimeError, OSError, KeyError, ValueError) as error:
                row = {"config": config, "side": side, "error": str(error)}
            rows.append(row)
            print(f"{config} {side}: {row.get('error') or 'ok'}", flush=True)
    command = "python benchmarks/trl_dpo.py " + " ".join(sys.argv[1:])
    lines = table(rows, command)
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(1 if any("error" in r for r in rows) else 0)


if __name__ == "__main__":
    main()
