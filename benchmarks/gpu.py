"""The GPU check: what a lent GPU machine runs first, as one command that ends within --budget_s (6 minutes).

    python benchmarks/gpu.py --download_wheels benchmarks/gpu_wheels   # here, with the package registry (~25 MB)
    python benchmarks/gpu.py --output_dir $OUT/gpu --wheels benchmarks/gpu_wheels   # the GPU machine; never run yet
    python benchmarks/gpu.py --smoke --output_dir runs/gpu-smoke [--wheels DIR]    # a CPU, tiny shapes: the logic
                                                              # (3x each step's timeout, 15 minutes in all)

The GPU machine lent to this project (its image as listed 2026-11-17: Python 3.12.3, torch 2.11.0, transformers
5.17.0, accelerate 1.15.0, peft, pyarrow, ...) has neither `datasets` nor DeepSpeed, and no network.
`--download_wheels DIR` fetches what it lacks, at this environment's versions (requirements.txt's pins), as wheels
for --python_version (3.12): WHEELS, and DeepSpeed built here from its sdist into a pure-Python wheel without ops
(DS_BUILD_OPS=0; the recipe passes torch's AdamW, so no op is needed). `--wheels DIR` installs them there first
(`pip install --no-index --no-deps --target <a private folder>`, put first on PYTHONPATH for every step).

Steps, in order, each in its own process under its own timeout (a step that would start with under MIN_STEP_S of the
budget left is skipped, with that reason), each writing <output_dir>/<step>.json and <step>.log:
  install            the wheels (with --wheels)
  environment        versions, the device, free vs total memory, SDPA backends, the bf16 matmul peak, what this
                     torch lacks that 2.13 has (benchmarks/gpu_steps.py)
  attention          packed sdpa vs unpacked vs flash-attention varlen: time, peak memory, saved bytes, kernels,
                     loss agreement (gpu_steps.py)
  chunked_head       the recipe's chunked output head and loss vs the whole logits at a 128k vocabulary (gpu_steps.py)
  tokenizer_workers  forked tokenizer workers after an NCCL collective: they finish, same tokens, examples/s
  recipe_<engine>_accum<k>  `recipes/llama_zero3.py`, unchanged (through benchmarks/recipe_probe.py, with
                     BENCH_NO_CHECKPOINTS=1: no checkpoint, no final export), on 1 GPU in bf16, a 0.85B Llama
                     built from a config (TinyLlama's shape, 16 layers), the bundled data packed to --seq_len,
                     --batch_size rows per micro-batch, accumulation 1 and 2, under fsdp2.yaml, then zero3.yaml
                     when DeepSpeed imports; then fsdp2 at accumulation 1 compiled as a user asks for it
                     (`--dynamo_backend inductor --dynamo_use_regional_compilation`: each block in place,
                     zero_utils.run.compiling; skipped under --smoke), and fsdp2 with --gradient_checkpointing
                     --activation_offloading. From the run's summary.json: tokens/s (median
                     over steps), the first step's extra seconds (compile time), MFU, the peak memory allocated
                     next to the fit check's estimate, the model-state bytes measured next to
                     the formula's, and what CUDA's sync debug mode reported in step 3 (expected: the one host sync
                     of reduce_step_values, transformers' packed-rows check per forward; tests/scripts/sync_probe.py).
MFU = model FLOPs per token x tokens/s / peak, against the device's published bf16 dense peak and the measured matmul
peak, with model FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B) = 6 N + 12 L h s: N = parameters in
matmuls (all but the input embedding, a lookup), L layers, h hidden size, s seq_len (the full s x s attention).
Writes <output_dir>/gpu.json (every step's status and result) and prints one line per step and a table. Exit status
1 when a step failed or timed out; skipped steps (no DeepSpeed, no budget left) say why and do not fail the check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # zero_utils from this checkout, also where it is not installed (the GPU machine)
from zero_utils.launch.launcher import accelerate_launch_command, config_file  # noqa: E402

# Published dense bf16 peaks (no sparsity), FLOP/s: NVIDIA's H100 SXM / H200 datasheets, A100 datasheet.
PUBLISHED_BF16_PEAK = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}
# What the GPU image lacks for `datasets` and DeepSpeed: their Requires-Dist closure less the image's packages
# (tests/test_benchmarks.py checks it). pandas, python-dateutil and tzdata come with `datasets`; the pydantic
# family with DeepSpeed. wandb is not needed: the check runs with --report_to none.
WHEELS = ["datasets", "dill", "multiprocess", "pandas", "python-dateutil", "tzdata", "hjson", "pydantic",
          "pydantic-core", "annotated-types", "typing-inspection"]
BUILT_HERE = ["deepspeed"]  # sdists, built into wheels by --download_wheels (DeepSpeed: DS_BUILD_OPS=0, no ops)
BUDGET_S, MIN_STEP_S = 360, 20
# --smoke runs beside the test suite's other worker on 2 CPU cores, where the first ZeRO-3 launch builds the private
# DeepSpeed copy's shared-memory op (32 s alone; 120 s ran out beside the other worker's 4-process launches on an
# AVX2 host, 2026-12-07): its steps get three times the GPU timeouts and the whole smoke 15 minutes.
SMOKE_BUDGET_S, SMOKE_TIMEOUT_FACTOR = 900, 3
STEP_TIMEOUT_S = {"install": 120, "environment": 60, "attention": 90, "chunked_head": 90, "tokenizer_workers": 90,
                  "recipe": 120}
RECIPES = [("fsdp2", 1, ""), ("fsdp2", 2, ""), ("zero3", 1, ""), ("zero3", 2, ""), ("fsdp2", 1, "compiled"),
           ("fsdp2", 1, "offloaded")]  # (engine, accumulation, variant: accelerate's regional compilation with
# inductor; --gradient_checkpointing --activation_offloading)
COMPILE = ("--dynamo_backend", "inductor", "--dynamo_use_regional_compilation")  # what a user passes


def download_wheels(folder: Path, python_version: str) -> None:
    """Wheels of WHEELS for CPython `python_version` on x86_64 Linux, and BUILT_HERE built from their sources, at
    this environment's versions, into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "--no-deps", "--dest", str(folder), "--quiet", "--only-binary=:all:",
                    "--python-version", python_version, "--platform", "manylinux2014_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64", *pins], check=True)
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-binary=:all:", "--wheel-dir",
                    str(folder), "--quiet", *[f"{n}=={metadata.version(n)}" for n in BUILT_HERE]], check=True,
                   env={**os.environ, "DS_BUILD_OPS": "0"})
    print(f"{folder}: {len(list(folder.iterdir()))} wheels, "
          f"{sum(f.stat().st_size for f in folder.iterdir()) / 1e6:.1f} MB", flush=True)


def run_step(name: str, cmd: list, output_dir: Path, env: dict, timeout_s: float) -> dict:
    """Run `cmd` in its own process group with its output in <output_dir>/<name>.log; on timeout kill the whole
    group (accelerate launch's workers too). Returns {"step", "status": ok/failed/timeout, "wall_s", ...}."""
    log = output_dir / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        try:
            status = "ok" if proc.wait(timeout=timeout_s) == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "timeout"
    row = {"step": name, "status": status, "wall_s": round(time.perf_counter() - t0, 1), "timeout_s": timeout_s}
    if status != "ok":
        row["log_tail"] = log.read_text(errors="replace")[-3000:]
    return row


def recipe_command(engine: str, accumulation: int, model: str, out: Path, args, variant: str = "") -> list:
    return accelerate_launch_command(
        REPO / "benchmarks/recipe_probe.py",
        ["--model", model, "--output_dir", out, "--overwrite", "--max_steps", args.steps, "--seq_len", args.seq_len,
         "--per_device_batch_size", args.batch_size, "--gradient_accumulation_steps", accumulation,
         "--warmup_steps", "2", "--lr", "3e-4", "--eval_fraction", "0", "--max_new_tokens", "0",
         "--report_to", "none",
         *(("--gradient_checkpointing", "--activation_offloading") if variant == "offloaded" else ())],
        config_file=config_file(engine), num_processes=1, mixed_precision="bf16",
        launch_args=COMPILE if variant == "compiled" else ())


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


def recipe_figures(summary: dict, config, seq_len: int, peaks: dict) -> dict:
    """The recipe run's figures from its summary.json, with MFU against `peaks` ({"measured"/"published": FLOP/s
    or None})."""
    matmul_params = summary["num_params"] - config.vocab_size * config.hidden_size  # all but the input embedding
    flops_per_token = 6 * matmul_params + 12 * config.num_hidden_layers * config.hidden_size * seq_len
    figures = {k: summary.get(k) for k in ("engine", "tokens_per_s", "step_time_s", "peak_mem_bytes",
                                           "peak_reserved_bytes", "peak_mem_bytes_estimated", "peak_mem_measured",
                                           "model_state_bytes", "model_state_bytes_expected", "num_params",
                                           "final_loss", "global_batch_rows")}
    figures["flops_per_token"] = flops_per_token
    figures["first_step_extra_s"] = summary.get("first_step_extra_s")  # compile time in the compiled variant
    figures["saved_activation_bytes"] = summary.get("saved_activation_bytes")  # what stays on the GPU
    figures["cuda_syncs_in_step_3"] = (summary.get("cuda_syncs_in_step_per_rank") or [None])[0]  # rank 0's
    for name, peak in peaks.items():
        figures[f"mfu_{name}_peak"] = flops_per_token * summary["tokens_per_s"] / peak if peak else None
    figures["peak_over_estimate"] = summary["peak_mem_bytes"] / summary["peak_mem_bytes_estimated"]
    figures["model_states_over_expected"] = summary["model_state_bytes"] / summary["model_state_bytes_expected"]
    return figures


def one_line(row: dict) -> str:
    r = row.get("result") or {}
    if row["status"] != "ok":
        return f"{row['step']}: {row['status']} {row.get('reason', '')}".rstrip()
    if row["step"] == "install":
        return f"install: {len(r['installed'])} packages"
    if row["step"] == "environment":
        return (f"environment: {r.get('device')}, torch {r['versions']['torch']}, matmul peak "
                f"{r['matmul_peak_flops'] / 1e12:.3g} TFLOP/s, torch-2.13-only: {sorted(r['torch_2_13_only_missing'])}")
    if row["step"] == "attention":
        return "attention: " + "; ".join(
            f"{k} {v['ms']:.1f} ms, {v['peak_mem_bytes'] / 2**30:.2f} GiB, loss {v['loss']:.4f}"
            f"{'' if v['loss_agrees'] else ' (DISAGREES)'}" if "ms" in v else f"{k} {next(iter(v))}"
            for k, v in r["ways"].items())
    if row["step"] == "chunked_head":
        return (f"chunked_head: peak {r['chunked_over_whole_peak']:.2f}x the whole logits', max token-loss "
                f"difference {r['max_token_loss_difference']:.2g}")
    if row["step"] == "tokenizer_workers":
        w = r["workers"]
        return (f"tokenizer_workers ({r['backend']}): same tokens {r['same_tokens']}, "
                f"{r['num_proc_1']['examples_per_s']:.0f} examples/s in 1 process, "
                f"{r[f'num_proc_{w}']['examples_per_s']:.0f} in {w}")
    if row["step"].startswith("recipe"):
        return (f"{row['step']}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu_measured_peak']:.1%} of the measured "
                f"peak, allocated {r['peak_mem_bytes'] / 2**30:.2f} GiB ({r['peak_over_estimate']:.2f}x the "
                f"estimate), model states {r['model_states_over_expected']:.3f}x the formula")
    return f"{row['step']}: ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, few steps: tests the script, not a GPU")
    parser.add_argument("--download_wheels", metavar="DIR", help="fetch what the GPU image lacks into DIR, then exit")
    parser.add_argument("--python_version", default="3.12", help="Python of the fetched wheels")
    parser.add_argument("--wheels", metavar="DIR", help="install the wheels of --download_wheels from DIR first")
    parser.add_argument("--budget_s", type=float, default=None,
                        help=f"the whole check ends within this (default: {BUDGET_S}; --smoke: {SMOKE_BUDGET_S})")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=4, help="rows of seq_len tokens per micro-batch")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if args.download_wheels:
        download_wheels(Path(args.download_wheels), args.python_version)
        return
    if not args.output_dir:
        parser.error("--output_dir is required (or --download_wheels DIR)")
    args.budget_s = args.budget_s or (SMOKE_BUDGET_S if args.smoke else BUDGET_S)
    timeout_factor = SMOKE_TIMEOUT_FACTOR if args.smoke else 1
    deadline = time.monotonic() + args.budget_s
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.seq_len, args.batch_size, args.steps = 64, 2, 3
    site = Path(tempfile.mkdtemp(prefix="gpu_check_site_"))  # --wheels go here; first on every step's PYTHONPATH
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(REPO),
                                                                      os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HOME": str(output_dir / "hf_home"), "BENCH_NO_CHECKPOINTS": "1",
           # what CUDA reports as synchronising in step 3 (tests/scripts/sync_probe.py; one step, no Python tracking)
           "ZERO_RECIPES_HARNESS_CUDA_SYNC_PROBE": "3",
           # DeepSpeed JIT-builds ops against its own sources (on CPU its shared-memory comm op, at every launch):
           # the private copy's build goes here, so the machine's op cache stays built for its own DeepSpeed.
           "TORCH_EXTENSIONS_DIR": str(output_dir / "torch_extensions")}
    rows = []

    def step(name: str, kind: str, cmd: list, skip_reason: str = "", result=None) -> None:
        """Run one step unless skipped; `result()` reads what it showed (default: its <name>.json)."""
        left = deadline - time.monotonic()
        if skip_reason or left < MIN_STEP_S:
            row = {"step": name, "status": "skipped",
                   "reason": skip_reason or f"{left:.0f} s of the {args.budget_s:.0f} s budget left"}
        else:
            row = run_step(name, cmd, output_dir, env, min(STEP_TIMEOUT_S[kind] * timeout_factor, left))
            if row["status"] == "ok":
                try:
                    row["result"] = result() if result else json.loads((output_dir / f"{name}.json").read_text())
                except (OSError, KeyError, ValueError, TypeError, ZeroDivisionError) as e:
                    row.update(status="failed", reason=f"its result could not be read: {type(e).__name__}: {e}")
        rows.append(row)
        print(one_line(row), flush=True)

    try:
        if args.wheels:
            step("install", "install", [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                                        "--disable-pip-version-check", "--target", site,
                                        *sorted(Path(args.wheels).glob("*.whl"))],
                 result=lambda: {"installed": sorted(p.name for p in site.glob("*.dist-info"))})
        for name in ("environment", "attention", "chunked_head", "tokenizer_workers"):
            step(name, name, [sys.executable, REPO / "benchmarks/gpu_steps.py", name, "--output",
                              output_dir / f"{name}.json", *(["--smoke"] if args.smoke else [])])
        environment = next((r.get("result") for r in rows if r["step"] == "environment"), None) or {}
        device = environment.get("device", "")
        peaks = {"measured": environment.get("matmul_peak_flops"),
                 "published": next((p for key, p in PUBLISHED_BF16_PEAK.items() if key in device), None)}
        model = make_model(output_dir / "model", args.smoke, args.seq_len)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
        for engine, accumulation, variant in RECIPES:
            name = f"recipe_{engine}_accum{accumulation}{'_' + variant if variant else ''}"
            summary = output_dir / name / "summary.json"
            no_deepspeed = engine.startswith("zero") and environment.get("deepspeed_imports") is not True
            skip_reason = (f"DeepSpeed does not import: {environment.get('deepspeed_imports')}" if no_deepspeed
                           else "--smoke: compiling on a CPU takes minutes (tests/test_compile.py runs this path)"
                           if variant == "compiled" and args.smoke else "")
            step(name, "recipe", recipe_command(engine, accumulation, model, output_dir / name, args, variant),
                 skip_reason=skip_reason, result=lambda summary=summary: recipe_figures(
                     json.loads(summary.read_text()), config, args.seq_len, peaks))
    finally:
        shutil.rmtree(site, ignore_errors=True)
    report = {"date": time.strftime("%Y-%m-%d"), "smoke": args.smoke, "budget_s": args.budget_s,
              "wall_s": round(args.budget_s - (deadline - time.monotonic()), 1), "seq_len": args.seq_len,
              "batch_size": args.batch_size, "steps": args.steps, "published_bf16_peak_flops": peaks["published"],
              "mfu_formula": "(6 * matmul_params + 12 * layers * hidden * seq_len) * tokens_per_s / peak",
              "results": rows}
    (output_dir / "gpu.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print("\n| step | status | wall s | what it showed |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['step']} | {row['status']} | {row.get('wall_s', '')} | {one_line(row).split(': ', 1)[-1]} |")
    if any(r["status"] in ("failed", "timeout") for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
