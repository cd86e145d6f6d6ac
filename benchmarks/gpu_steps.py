"""The GPU check's in-process steps (benchmarks/gpu.py runs each in its own process, under its own timeout):

    python benchmarks/gpu_steps.py environment --output env.json [--smoke]
    python benchmarks/gpu_steps.py attention --output attention.json [--smoke]
    python benchmarks/gpu_steps.py chunked_head --output chunked_head.json [--smoke]
    python benchmarks/gpu_steps.py tokenizer_workers --output tokenizer_workers.json [--smoke]

environment        versions (torch, CUDA, NCCL, every package the recipe imports), the device, its free and total
                   memory, the SDPA backends torch has enabled, the bf16 matmul peak measured (a loop of n^3
                   `torch.matmul`, 2 n^3 FLOPs each), and what this torch lacks that the code would use on 2.13.
attention          one batch of packed rows (examples of random lengths filling each row, position ids restarting
                   at each example) through a Llama built from a config, forward and backward, three ways: packed
                   with sdpa (transformers' block-diagonal mask from position_ids), unpacked (each example its
                   own row of batch 1: plain causal sdpa, no mask), and packed with flash-attention's varlen kernel
                   (`attention.varlen_kwargs`, when flash_attn imports). Per way: milliseconds per forward+backward
                   (median of 3 after a warm-up), peak memory, bytes saved for backward, the attention kernels that
                   ran (torch.profiler), and the mean next-token loss within examples, which must agree.
chunked_head       the recipe's loss (`token_loss.TokenLosses`) at Llama-3's vocabulary (128,256), chunked (1,024
                   tokens at a time) and the whole logits: peak memory, milliseconds, the mean loss and the largest
                   token-loss difference between them.
tokenizer_workers  after an NCCL collective (gloo on CPU) in this process, the bundled 4,000 examples tokenized
                   by 1 process and by forked worker processes (`preparation.made`, what --num_proc
                   does): that the workers finish, give the same tokens, and examples/s of each.

Each step writes one JSON object to --output. --smoke: CPU, tiny shapes (checks the logic, measures nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # zero_utils from this checkout, also where it is not installed (the GPU machine)

PACKAGES = ["torch", "transformers", "accelerate", "tokenizers", "peft", "datasets", "deepspeed", "safetensors",
            "huggingface-hub", "numpy", "pyarrow", "pandas", "dill", "multiprocess", "pydantic", "wandb",
            "flash-attn", "triton"]
# What zero_utils would use on torch >= 2.13 and does instead on an older torch (the GPU image has 2.11).
TORCH_2_13_ONLY = {
    "FSDPModule.reset_iter_state": "zero_utils.model.wrapping.reshard_after_inference reshards every FSDP module "
                                   "instead (reshard_every_group); the first backward after an eval or generation "
                                   "forward all-gathers the output-head group once more",
    "FSDPState._fsdp_param_groups": "zero_utils.model.wrapping.fsdp2_held_gradients reads the one _fsdp_param_group of "
                                    "each module instead",
}


def _device(smoke: bool):
    import torch

    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("the GPU check needs a CUDA GPU; pass --smoke to check its logic on a CPU")
    return torch.device("cuda")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def matmul_peak(device, n: int, iters: int) -> float:
    """bf16 FLOP/s of an n x n x n `torch.matmul` loop (2 n^3 FLOPs each), after 3 warm-up products."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def environment(smoke: bool) -> dict:
    import torch

    device = _device(smoke)
    report = {"python": platform.python_version(), "versions": {name: _version(name) for name in PACKAGES},
              "torch_cuda": torch.version.cuda, "cpus": os.cpu_count(), "device": "cpu"}
    for name in ("datasets", "deepspeed", "flash_attn"):  # installed is not importable: say which import fails
        try:
            module = __import__(name)
            report[f"{name}_imports"], report[f"{name}_from"] = True, str(Path(module.__file__).parent.parent)
        except Exception as e:  # noqa: BLE001 - any failure is the finding
            report[f"{name}_imports"] = f"{type(e).__name__}: {e}"[:500]
    from torch.distributed.fsdp import FSDPModule

    missing = {"FSDPModule.reset_iter_state": not hasattr(FSDPModule, "reset_iter_state")}
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

        missing["FSDPState._fsdp_param_groups"] = "_fsdp_param_groups" not in FSDPState.__init__.__code__.co_names
    except ImportError:
        missing["FSDPState._fsdp_param_groups"] = True
    report["torch_2_13_only_missing"] = {name: TORCH_2_13_ONLY[name] for name, gone in missing.items() if gone}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        report.update(device=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability()),
                      nccl=".".join(map(str, torch.cuda.nccl.version())), memory_free_bytes=free,
                      memory_total_bytes=total, bf16_supported=torch.cuda.is_bf16_supported(),
                      sdpa_backends={"flash": torch.backends.cuda.flash_sdp_enabled(),
                                     "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                     "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                     "math": torch.backends.cuda.math_sdp_enabled()})
    n, iters = (256, 3) if smoke else (8192, 50)
    report["matmul_n"], report["matmul_peak_flops"] = n, matmul_peak(device, n, iters)
    return report


def _llama(device, dtype, *, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, seq_len: int,
           attn_implementation: str = "sdpa"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=seq_len, tie_word_embeddings=False)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def packed_rows(rows: int, seq_len: int, vocab_size: int, seed: int = 0):
    """Rows of `seq_len` tokens filled with examples of random lengths (seq_len/8 to seq_len/2 tokens; the last of a
    row takes what is left). Returns (input_ids [rows, seq_len], position_ids [rows, seq_len] restarting at 0 at
    each example, the examples as (row, start, length))."""
    import torch

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (rows, seq_len), generator=g)
    position_ids = torch.zeros(rows, seq_len, dtype=torch.long)
    examples = []
    for row in range(rows):
        start = 0
        while start < seq_len:
            length = int(torch.randint(seq_len // 8, seq_len // 2 + 1, (1,), generator=g))
            length = seq_len - start if seq_len - start < length + seq_len // 8 else length
            position_ids[row, start:start + length] = torch.arange(length)
            examples.append((row, start, length))
            start += length
    return input_ids, position_ids, examples


def _within_example_loss_sum(logits, input_ids, position_ids):
    """Summed next-token cross-entropy where the next token belongs to the same example; and the count."""
    import torch.nn.functional as F

    targets = input_ids[:, 1:].clone()
    targets[position_ids[:, 1:] == 0] = -100  # the next token starts another example
    losses = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                             reduction="sum")
    return losses, int((targets != -100).sum())


def _measure(run, device, repeats: int = 3) -> dict:
    """Warm-up once, then time `run()` (a forward+backward returning (loss_sum, count)) `repeats` times; its peak
    memory, the bytes autograd saved, and the attention kernels of one profiled call."""
    from torch.profiler import ProfilerActivity, profile

    from zero_utils.train.measurement import count_saved_activations, peak_memory_bytes, reset_peak_memory

    run()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        loss_sum, count = run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    reset_peak_memory(device)
    saved = {}
    with count_saved_activations(saved):
        loss_sum, count = run()
    peak = peak_memory_bytes(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        _sync(device)
    words = ("attention", "attn", "flash", "fmha", "sdpa", "scaled_dot_product")
    kernels = sorted({e.name for e in prof.events() if any(w in e.name.lower() for w in words)})
    return {"ms": 1000 * statistics.median(times), "peak_mem_bytes": peak, "saved_bytes": saved["saved"],
            "kernels": kernels[:40], "loss": float(loss_sum) / count, "loss_tokens": count,
            "peak_memory_measured": "max_memory_allocated" if device.type == "cuda" else "process RSS high-water mark"}


def attention(smoke: bool) -> dict:
    import torch

    from zero_utils.data.attention import varlen_kwargs

    device = _device(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    shape = (dict(vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2, seq_len=128) if smoke else
             dict(vocab_size=32000, hidden=2048, layers=4, heads=32, kv_heads=8, seq_len=4096))
    rows = 2
    input_ids, position_ids, examples = packed_rows(rows, shape["seq_len"], shape["vocab_size"])
    input_ids, position_ids = input_ids.to(device), position_ids.to(device)
    model = _llama(device, dtype, **shape)

    def packed(**kwargs):
        def run():
            logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs).logits
            loss_sum, count = _within_example_loss_sum(logits, input_ids, position_ids)
            loss_sum.backward()
            model.zero_grad(set_to_none=True)
            return loss_sum.detach(), count
        return run

    def unpacked():
        total, count = torch.zeros((), device=device), 0
        for row, start, length in examples:
            ids, pos = input_ids[row:row + 1, start:start + length], position_ids[row:row + 1, start:start + length]
            logits = model(input_ids=ids, use_cache=False).logits
            loss_sum, n = _within_example_loss_sum(logits, ids, pos)
            loss_sum.backward()
            total, count = total + loss_sum.detach(), count + n
        model.zero_grad(set_to_none=True)
        return total, count

    report = {"rows": rows, "examples": len(examples), **shape, "dtype": str(dtype).removeprefix("torch."),
              "ways": {"packed_sdpa": _measure(packed(), device), "unpacked_sdpa": _measure(unpacked, device)}}
    try:
        import flash_attn  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or built for another torch
        report["ways"]["flash_varlen"] = {"skipped": f"flash_attn does not import: {type(e).__name__}: {e}"[:300]}
    else:
        try:  # transformers checks the kernel here; a flash_attn built for another torch fails in its first call
            model.set_attn_implementation("flash_attention_2")
            report["ways"]["flash_varlen"] = _measure(packed(**varlen_kwargs(position_ids)), device)
        except Exception as e:  # noqa: BLE001 - the other two ways are still worth their figures
            report["ways"]["flash_varlen"] = {"failed": f"{type(e).__name__}: {e}"[:500]}
    reference = report["ways"]["unpacked_sdpa"]["loss"]
    tolerance = 1e-4 if smoke else 2e-2  # fp32 on CPU; bf16 attention in different kernel orders on GPU
    for way in report["ways"].values():
        if "loss" in way:
            way["loss_agrees"] = abs(way["loss"] - reference) <= tolerance * abs(reference)
    return report


def chunked_head(smoke: bool) -> dict:
    import torch
    from accelerate import Accelerator

    from zero_utils.data.training import MicroBatch
    from zero_utils.train.measurement import peak_memory_bytes, reset_peak_memory
    from zero_utils.train.token_loss import TokenLosses

    device = _device(smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    shape = (dict(vocab_size=1000, hidden=64, layers=1, heads=4, kv_heads=2, seq_len=256) if smoke else
             dict(vocab_size=128_256, hidden=2048, layers=2, heads=32, kv_heads=8, seq_len=4096))
    chunk = 40 if smoke else 1024
    accelerator = Accelerator(cpu=smoke)
    input_ids, position_ids, _ = packed_rows(1, shape["seq_len"], shape["vocab_size"], seed=1)
    labels = input_ids[:, 1:].clone()
    labels = torch.cat([labels, torch.full((1, 1), -100)], dim=1)
    micro = MicroBatch({"input_ids": input_ids.to(device), "position_ids": position_ids.to(device), "use_cache": False},
                       labels.to(device))
    report = {"chunk_tokens": chunk, **shape, "dtype": str(dtype).removeprefix("torch.")}
    token_losses = {}
    for name, chunk_tokens in (("chunked", chunk), ("whole_logits", 0)):
        model = _llama(device, dtype, **shape)
        losses_of = TokenLosses(model, chunk_tokens, -100, accelerator)
        for _ in range(2):  # the second is measured
            _sync(device)
            reset_peak_memory(device)
            t0 = time.perf_counter()
            losses = losses_of(model, micro)
            (losses.sum() / micro.num_loss_tokens).backward()
            _sync(device)
            elapsed = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
        token_losses[name] = losses.detach().float()
        report[name] = {"ms": 1000 * elapsed, "peak_mem_bytes": peak_memory_bytes(device),
                        "loss": float(token_losses[name].sum() / micro.num_loss_tokens),
                        "chunked": losses_of.chunk_tokens > 0}
        del model, losses_of, losses
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["max_token_loss_difference"] = float((token_losses["chunked"] - token_losses["whole_logits"]).abs().max())
    report["chunked_over_whole_peak"] = report["chunked"]["peak_mem_bytes"] / report["whole_logits"]["peak_mem_bytes"]
    return report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokenizer_workers(smoke: bool) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from zero_utils.data.preparation import made
    from zero_utils.data.sft_rows import SFTRows
    from zero_utils.data.source_stream import SourceStream

    device = _device(smoke)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    total = torch.ones(1, device=device)
    dist.all_reduce(total)  # NCCL's communicator and its threads exist from here on, as in a recipe
    _sync(device)
    stream = SourceStream.open(str(REPO / "zero_utils/assets/sft_tiny.jsonl"), {}, eval_fraction=0.0, seed=0)
    examples = stream.sources[0].data
    tokenizer = AutoTokenizer.from_pretrained(REPO / "zero_utils/assets/tiny-llama")
    maker = SFTRows(256, 0)
    layouts = [maker.layout(examples.column_names, None, {})]
    workers = 2 if smoke else 4
    report = {"backend": dist.get_backend(), "examples": len(examples), "collective_result": float(total)}
    tokens = {}
    for num_proc in (1, workers):
        t0 = time.perf_counter()
        tokens[num_proc] = [(ids.tolist(), labels.tolist()) for (ids, labels), _ in
                            made(stream, stream.parts()["train"], maker, tokenizer, layouts, num_proc)]
        elapsed = time.perf_counter() - t0
        report[f"num_proc_{num_proc}"] = {"examples_per_s": len(examples) / elapsed, "s": elapsed,
                                          "tokens": sum(len(ids) for ids, _ in tokens[num_proc])}
    report["workers"] = workers
    report["same_tokens"] = tokens[1] == tokens[workers]
    dist.destroy_process_group()
    return report


STEPS = {"environment": environment, "attention": attention, "chunked_head": chunked_head,
         "tokenizer_workers": tokenizer_workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--output", required=True, help="the JSON file this step writes")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the logic, measures nothing")
    args = parser.parse_args()
    report = STEPS[args.step](args.smoke)
    Path(args.output).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
