"""Peak memory and tokens/s of the loss at Llama-3's vocabulary, chunked (the default) against the whole logits.

    python benchmarks/chunked_loss.py --output_dir runs/chunked_loss [--engines fsdp2 zero3] [--max_steps 4]

A Llama built from a config (random weights, no download): Llama-3's vocabulary of 128,256 tokens, hidden 256,
2 blocks, untied head (65.7M parameters, 98% of them the embedding and the head), trained by the README's recipe on
its bundled data: 2 processes, fp32, micro-batch 1 row of 2,048 tokens, --max_steps steps, once with
--loss_chunk_tokens 1024 (the default) and once with 0 (the whole logits), side by side, per engine. Writes
results.json and results.md (the table of docs/MEMORY.md): each run's peak memory per rank (the maximum over ranks;
process RSS on CPU, the allocator's peak on GPU), the median tokens/s over the steps after the first, and the
ratios. The loss stage of the whole logits holds about 10 bytes per logit (bf16 or fp32 logits, an fp32 copy, the
fp32 log-softmax): 2,048 x 128,256 x 10 B = 2.6 GB per row here. About 8 minutes on 2 CPU cores; peak host
memory ~10 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # zero_utils from this checkout, also where it is not installed
from zero_utils.launch.launcher import accelerate_launch_command, config_file  # noqa: E402

VOCAB, SEQ_LEN, CHUNK = 128_256, 2048, 1024


def train(engine: str, chunk: int, model: str, output_dir: Path, steps: int) -> dict:
    out = output_dir / "runs" / f"{engine}-chunk{chunk}"
    cmd = accelerate_launch_command(
        REPO / "recipes/llama_zero3.py",
        ["--model", model, "--output_dir", out, "--overwrite", "--max_steps", steps, "--seq_len", SEQ_LEN,
         "--per_device_batch_size", "1", "--loss_chunk_tokens", chunk, "--eval_fraction", "0",
         "--max_new_tokens", "0", "--report_to", "none"],
        config_file=config_file(engine), num_processes=2, mixed_precision="no")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} --loss_chunk_tokens {chunk} failed:\n{proc.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = sorted(m["tokens_per_s"] for m in metrics[1:])
    return {"engine": engine, "loss_chunk_tokens": chunk, "peak_mem_bytes": json.loads(
        (out / "summary.json").read_text())["peak_mem_bytes"], "tokens_per_s": speeds[len(speeds) // 2],
            "losses": [m["loss"] for m in metrics]}


def main() -> None:
    from memory import make_model  # benchmarks/memory.py: the tests' Llama, here with Llama-3's vocabulary

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--engines", nargs="+", default=["fsdp2", "zero3"])
    parser.add_argument("--max_steps", type=int, default=4)
    args = parser.parse_args()
    output_dir = Path(args.output_dir)
    model = make_model(output_dir / "llama-vocab128k", vocab_size=VOCAB, num_hidden_layers=2,
                       max_position_embeddings=SEQ_LEN)
    rows, lines = [], ["| engine | --loss_chunk_tokens | peak memory per rank (GB) | tokens/s | chunked / whole: "
                       "memory | chunked / whole: tokens/s |", "|---|---|---|---|---|---|"]
    for engine in args.engines:
        chunked, whole = (train(engine, chunk, model, output_dir, args.max_steps) for chunk in (CHUNK, 0))
        rows += [chunked, whole]
        for run in (chunked, whole):
            lines.append(f"| {engine} | {run['loss_chunk_tokens']} | {run['peak_mem_bytes'] / 1e9:.2f} | "
                         f"{run['tokens_per_s']:.0f} | "
                         + (f"{chunked['peak_mem_bytes'] / whole['peak_mem_bytes']:.2f} | "
                            f"{chunked['tokens_per_s'] / whole['tokens_per_s']:.2f} |" if run is chunked else "| |"))
        print("\n".join(lines[-2:]), flush=True)
    (output_dir / "results.json").write_text(json.dumps(rows, indent=2))
    (output_dir / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
