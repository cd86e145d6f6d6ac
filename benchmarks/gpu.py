"""The GPU check: the recipe itself on one CUDA GPU, bf16, a ~1.1B-parameter Llama built from a config.

    python benchmarks/gpu.py --download_wheels benchmarks/gpu_wheels   # here, with the package registry: ~6 MB
    python benchmarks/gpu.py --output_dir $OUT/gpu --wheels benchmarks/gpu_wheels   # GPU machine; never run yet
    python benchmarks/gpu.py --smoke --output_dir runs/gpu-smoke        # a CPU, tiny model: checks the logic

The GPU machine lent to this project has torch, transformers, accelerate, peft, pandas and pyarrow but not
`datasets` or DeepSpeed, and no network: `--download_wheels` fetches the few pure-Python wheels (and DeepSpeed's
source) that are missing, at the versions of requirements.txt, and `--wheels` installs them there into a private
folder (DeepSpeed without its ops: the recipe passes torch AdamW, so none is needed).

1. The bf16 matmul peak of this GPU, measured: a loop of 8192^3 `torch.matmul` (2 n^3 FLOPs each).
2. `recipes/llama_zero3.py`, unchanged, launched by `accelerate launch --num_processes 1 --mixed_precision bf16`
   through benchmarks/recipe_probe.py, once per variant: FSDP2 (fsdp2.yaml), FSDP2 with every decoder block
   compiled (`BENCH_COMPILE_BLOCKS=1`, `nn.Module.compile` in place, as torchtitan compiles per block) and
   DeepSpeed ZeRO-3 (zero3.yaml) when DeepSpeed imports. The bundled instruction data, packed to --seq_len.
3. Per variant, from the run's own summary.json: tokens/s (median over the steps), MFU against the device's
   published bf16 dense peak and against the measured matmul peak, the peak CUDA memory allocated and reserved
   (since set-up ended) next to the recipe's fit-check estimate made before the run, the model-state bytes
   measured and expected.
MFU = model FLOPs per token x tokens/s / peak, with model FLOPs per token (PaLM, Chowdhery et al. 2022,
appendix B) = 6 N + 12 L h s: N = parameters in matmuls (all but the input embedding, a lookup), L layers,
h hidden size, s seq_len (the full s x s attention, not halved for the causal mask).
Writes --output_dir/gpu.json and prints one table.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # zero_utils from this checkout, also where it is not installed (the GPU machine)
from zero_utils.launcher import accelerate_launch_command, config_file  # noqa: E402

# Published dense bf16 peaks (no sparsity), FLOP/s: NVIDIA's H100 SXM / H200 datasheets, A100 datasheet.
PUBLISHED_BF16_PEAK = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}
# What the GPU machine lacks for the recipe (datasets and DeepSpeed, and what they need beyond its packages).
WHEELS = ["datasets", "dill", "multiprocess", "hjson", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection"]
SDISTS = ["deepspeed"]

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--output_dir")
parser.add_argument("--smoke", action="store_true", help="CPU, tiny config, few steps: tests the script, not a GPU")
parser.add_argument("--download_wheels", metavar="DIR", help="fetch the missing packages into DIR, then exit")
parser.add_argument("--wheels", metavar="DIR", help="install the packages of --download_wheels from DIR first")
parser.add_argument("--seq_len", type=int, default=2048)
parser.add_argument("--batch_size", type=int, default=4, help="rows of seq_len tokens per step")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--variants", nargs="+", default=["fsdp2", "fsdp2+compile", "zero3"])
args = parser.parse_args()


def download_wheels(folder: Path) -> None:
    """Python 3.12 x86_64 wheels of WHEELS and the source of SDISTS, at this environment's versions."""
    folder.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    common = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(folder), "--quiet"]
    subprocess.run([*common, "--only-binary=:all:", "--python-version", "3.12", "--platform",
                    "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64", *pins], check=True)
    subprocess.run([*common, "--no-binary=:all:", *[f"{n}=={metadata.version(n)}" for n in SDISTS]], check=True)
    print(f"{folder}: {sum(f.stat().st_size for f in folder.iterdir()) / 1e6:.1f} MB", flush=True)


def install_wheels(folder: Path) -> Path:
    """Install every package of `folder` into a private site folder (no index, no build isolation: DeepSpeed's
    setup needs the machine's torch); returns the folder to put on PYTHONPATH."""
    site = Path(tempfile.mkdtemp(prefix="gpu_site_"))
    files = [str(f) for f in sorted(folder.iterdir())]
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    "--no-build-isolation", "--target", str(site), *files], check=True, env=env)
    return site


def make_model(folder: Path, smoke: bool, seq_len: int) -> str:
    from transformers import AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(REPO / "zero_utils/assets/tiny-llama")
    if smoke:
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len)
    else:  # TinyLlama-1.1B's shape with 16 layers: hidden 2048, SwiGLU 5632, GQA 32/8 heads, vocab 32000
        config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=seq_len)
    config.tie_word_embeddings = False
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def matmul_peak(device, n: int, iters: int) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def run_variant(variant: str, model: str, out: Path, env: dict) -> dict:
    engine, compiled = variant.split("+")[0], variant.endswith("+compile")
    cmd = accelerate_launch_command(
        REPO / "benchmarks/recipe_probe.py",
        ["--model", model, "--output_dir", out, "--overwrite", "--max_steps", args.steps, "--seq_len", args.seq_len,
         "--per_device_batch_size", args.batch_size, "--warmup_steps", "2", "--lr", "3e-4", "--eval_fraction", "0",
         "--max_new_tokens", "0", "--report_to", "none"],
        config_file=config_file(engine), num_processes=1, mixed_precision="bf16")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**env, "BENCH_COMPILE_BLOCKS": str(int(compiled))})
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"variant": variant, "error": proc.stderr[-3000:], "wall_s": wall_s}
    summary = json.loads((out / "summary.json").read_text())
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # GBs at this size; the figures are in summary.json
    shutil.rmtree(out / "final", ignore_errors=True)
    return {"variant": variant, "engine": summary["engine"], "compile": compiled, "wall_s": wall_s,
            **{k: summary[k] for k in ("tokens_per_s", "step_time_s", "peak_mem_bytes", "peak_reserved_bytes",
                                       "peak_mem_bytes_estimated", "peak_mem_measured", "model_state_bytes",
                                       "model_state_bytes_expected",
                                       "num_params", "final_loss")}}


def main() -> None:
    if args.download_wheels:
        download_wheels(Path(args.download_wheels))
        return
    import torch

    if not args.output_dir:
        raise SystemExit("--output_dir is required.")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU; use --smoke to check it on a CPU.")
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.wheels:
        env["PYTHONPATH"] = os.pathsep.join([str(install_wheels(Path(args.wheels))), env["PYTHONPATH"]])
    if args.smoke:
        device, n, iters = torch.device("cpu"), 256, 5
        args.seq_len, args.batch_size, args.steps = 64, 2, 3
        args.variants = [v for v in args.variants if not v.endswith("+compile")]  # inductor on CPU: minutes
    else:
        device, n, iters = torch.device("cuda"), 8192, 50
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    published = next((peak for key, peak in PUBLISHED_BF16_PEAK.items() if key in device_name), None)
    measured_peak = matmul_peak(device, n, iters)
    print(f"{device_name}: bf16 matmul peak ({n}^3) {measured_peak / 1e12:.3g} TFLOP/s, published "
          f"{published / 1e12 if published else float('nan'):.4g}", flush=True)
    model = make_model(output_dir / "model", args.smoke, args.seq_len)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    L, h, s = config.num_hidden_layers, config.hidden_size, args.seq_len
    results = []
    for variant in args.variants:
        r = run_variant(variant, model, output_dir / variant.replace("+", "_"), env)
        if "error" not in r:
            matmul_params = r["num_params"] - config.vocab_size * h  # all but the input embedding
            flops_per_token = 6 * matmul_params + 12 * L * h * s
            r.update(flops_per_token=flops_per_token, mfu_measured_peak=flops_per_token * r["tokens_per_s"] /
                     measured_peak, mfu_published_peak=(flops_per_token * r["tokens_per_s"] / published
                                                        if published else None))
            print(f"{variant:>14}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu_measured_peak']:.1%} of the "
                  f"measured peak, allocated {r['peak_mem_bytes'] / 2**30:.2f} GiB", flush=True)
        else:
            print(f"{variant:>14}: failed\n{r['error']}", flush=True)
        results.append(r)
    report = {"date": time.strftime("%Y-%m-%d"), "device": device_name, "smoke": args.smoke,
              "torch": torch.__version__, "seq_len": s, "batch_size": args.batch_size, "steps": args.steps,
              "matmul_peak_flops": measured_peak, "published_bf16_peak_flops": published, "variants": results,
              "mfu_formula": "(6 * matmul_params + 12 * layers * hidden * seq_len) * tokens_per_s / peak"}
    (output_dir / "gpu.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print("\n| variant | tokens/s | MFU (published peak) | MFU (measured peak) | allocated GiB | reserved GiB | "
          "estimated GiB |\n|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | failed | | | | | |")
            continue
        published_mfu = f"{r['mfu_published_peak']:.1%}" if r["mfu_published_peak"] else "n/a"
        reserved = f"{r['peak_reserved_bytes'] / 2**30:.2f}" if r["peak_reserved_bytes"] else "n/a"
        print(f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {published_mfu} | {r['mfu_measured_peak']:.1%} | "
              f"{r['peak_mem_bytes'] / 2**30:.2f} | {reserved} | {r['peak_mem_bytes_estimated'] / 2**30:.2f} |")
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
