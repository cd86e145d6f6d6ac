"""Throughput, MFU and peak memory of a ~1B-parameter Llama on one GPU, FSDP2 at world size 1, bf16.

    python benchmarks/gpu.py --output_dir runs/gpu                 # one H100/H200; about 5 minutes
    python benchmarks/gpu.py --smoke --output_dir runs/gpu-smoke   # CPU, tiny config, seconds: checks the logic

1. The bf16 matmul peak of this GPU, measured: a loop of 8192 x 8192 x 8192 torch.matmul (2 n^3 FLOPs each).
2. Four variants, each on a fresh model with random weights: eager / torch.compile (each block compiled, as
   torchtitan does) x without / with activation checkpointing (non-reentrant, every block). FSDP2 `fully_shard` on
   a 1-rank process group in the order zero_utils.wrapping uses (each block, then final norm + head, then root),
   bf16 compute, fp32 master weights and gradient reduction; torch AdamW (zero_utils.optim.build_adamw).
3. Per variant: tokens/s (median step time over the steps after --untimed_steps), MFU, peak memory
   (torch.cuda.max_memory_allocated; process RSS high-water on CPU).
MFU = model FLOPs per token x tokens/s / measured matmul peak, with model FLOPs per token (PaLM, Chowdhery et al.
2022, appendix B) = 6 N + 12 L h s: N = parameters that take part in matmuls (all but the input embedding, a
lookup), L layers, h hidden size, s seq_len. The attention term counts the full s x s score and value matmuls
(forward and backward), not halved for the causal mask. Recomputation under activation checkpointing is not
counted (it is work the model does not need): MFU, not hardware FLOPs utilisation.
Writes --output_dir/gpu.json and prints one table.
"""

import argparse
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig

from zero_utils.memory import peak_memory_bytes
from zero_utils.optim import build_adamw

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--output_dir", required=True)
parser.add_argument("--smoke", action="store_true", help="CPU, tiny config, few steps: tests the script, not a GPU")
parser.add_argument("--seq_len", type=int, default=2048)
parser.add_argument("--batch_size", type=int, default=4, help="rows of seq_len tokens per step")
parser.add_argument("--steps", type=int, default=13)
parser.add_argument("--untimed_steps", type=int, default=3, help="first steps left out (compilation, allocator)")
parser.add_argument("--variants", nargs="+", default=["eager", "eager+ac", "compile", "compile+ac"])
args = parser.parse_args()

if args.smoke:
    device, dtype, matmul_n, matmul_iters = torch.device("cpu"), torch.bfloat16, 256, 5
    args.seq_len, args.batch_size, args.steps, args.untimed_steps = 64, 2, 4, 2
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len)
else:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU; use --smoke to check it on a CPU.")
    device, dtype, matmul_n, matmul_iters = torch.device("cuda"), torch.bfloat16, 8192, 50
    # ~1B-class Llama (TinyLlama-1.1B's shape with 16 layers): hidden 2048, 16 layers, SwiGLU 5632, GQA 32/8 heads.
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=args.seq_len,
                         tie_word_embeddings=False)
config.use_cache = False


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ 1. matmul peak
a = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
b = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
for _ in range(3):
    a @ b
sync()
t0 = time.perf_counter()
for _ in range(matmul_iters):
    a @ b
sync()
peak_flops = 2 * matmul_n**3 * matmul_iters / (time.perf_counter() - t0)
del a, b
print(f"bf16 matmul peak ({matmul_n}^3): {peak_flops / 1e12:.3g} TFLOP/s", flush=True)

# ------------------------------------------------------------------------------------------ 1-rank process group
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                        world_size=1)
mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (1,))
mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def build(compile_blocks: bool, activation_checkpointing: bool):
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    blocks = list(model.model.layers)
    for block in blocks:
        if compile_blocks:
            block.compile()
    # zero_utils.wrapping's order: each block (the last stays gathered for backward), norm + head, then the root.
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard([model.model.norm, model.lm_head], mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    return model


L, h, s = config.num_hidden_layers, config.hidden_size, args.seq_len
results = []
for variant in args.variants:
    compile_blocks, ac = variant.startswith("compile"), variant.endswith("+ac")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build(compile_blocks, ac)
    num_params = sum(p.numel() for p in model.parameters())  # DTensors report their global size
    matmul_params = num_params - model.get_input_embeddings().weight.numel()
    flops_per_token = 6 * matmul_params + 12 * L * h * s
    optimizer = build_adamw(model, 3e-4, weight_decay=0.1)
    generator = torch.Generator(device="cpu").manual_seed(0)
    step_times_s = []
    for _ in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch_size, s + 1), generator=generator).to(device)
        sync()
        t0 = time.perf_counter()
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        sync()
        step_times_s.append(time.perf_counter() - t0)
    tokens_per_s = args.batch_size * s / statistics.median(step_times_s[args.untimed_steps:])
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else peak_memory_bytes(device)
    results.append({"variant": variant, "compile": compile_blocks, "activation_checkpointing": ac,
                    "tokens_per_s": tokens_per_s, "mfu": flops_per_token * tokens_per_s / peak_flops,
                    "peak_mem_bytes": peak, "step_times_s": step_times_s, "final_loss": loss.item()})
    print(f"{variant:>12}: {tokens_per_s:,.0f} tokens/s, MFU {results[-1]['mfu']:.1%}, peak {peak / 2**30:.2f} GiB",
          flush=True)
    del model, optimizer, logits, loss

report = {
    "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device.type == "cuda" else
    platform.processor() or "cpu", "smoke": args.smoke, "torch": torch.__version__, "num_params": num_params,
    "matmul_params": matmul_params, "flops_per_token": flops_per_token, "config": config.to_dict(),
    "seq_len": s, "batch_size": args.batch_size, "matmul_peak_flops": peak_flops, "variants": results,
    "mfu_formula": "(6 * matmul_params + 12 * layers * hidden * seq_len) * tokens_per_s / matmul_peak_flops"}
Path(args.output_dir).mkdir(parents=True, exist_ok=True)
Path(args.output_dir, "gpu.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
print(f"\n{num_params / 1e6:,.1f}M parameters ({matmul_params / 1e6:,.1f}M in matmuls), seq_len {s}, batch "
      f"{args.batch_size}, {report['device']}, matmul peak {peak_flops / 1e12:.3g} TFLOP/s, "
      f"{flops_per_token / 1e9:.3g} GFLOP/token\n")
print("| variant | tokens/s | MFU | peak memory GiB |\n|---|---|---|---|")
for r in results:
    print(f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['peak_mem_bytes'] / 2**30:.2f} |")
dist.destroy_process_group()
os._exit(0)  # skip interpreter finalization (gloo teardown, as in zero_utils.runtime.finish)
