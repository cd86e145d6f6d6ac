"""Memory of model states per rank: what the ZeRO formulas predict, and what a rank really holds.

Model states are parameters + gradients + optimizer state (Adam: two moments). Formulas (Psi = parameter count,
N = ranks; the ZeRO paper's mixed-precision Adam with K = 12):

    engine       mixed precision (bf16)          fp32 training, as each engine stores it right after the step
    ddp          16 Psi                          16 Psi (params 4 + grads 4 + Adam 8)
    zero1/zero2  2 Psi + 14 Psi / N (paper:      4 Psi + 16 Psi / N (fp32 params; fp32 master 4, Adam 8 and an
                 ZeRO-1 4 Psi + 12 Psi / N)      fp32 gradient partition 4, all partitioned)
    zero3        16 Psi / N                      24 Psi / N (params 4, master 4, Adam 8, grads 4 + 4, partitioned)
    fsdp2        16 Psi / N                      16 Psi / N (no master copy: the fp32 shard is the master)

The fp32 column is what DeepSpeed 0.19.8 and torch 2.13 were measured to hold (DESIGN.md section 4). Engines:
ddp, single, zero1, zero2, zero3 (+_offload), fsdp2, fsdp2_zero2 (+_offload). Units: bytes.
"""

from __future__ import annotations

import resource

import torch

# bytes per parameter: (replicated on every rank, divided over N ranks), at the moment right after the step.
_BYTES_PER_PARAM = {
    "fp32": {"ddp": (16, 0), "single": (16, 0), "zero1": (4, 16), "zero2": (4, 16), "zero3": (0, 24), "fsdp2": (0, 16)},
    "mixed": {"ddp": (16, 0), "single": (16, 0), "zero1": (4, 12), "zero2": (2, 14), "zero3": (0, 16), "fsdp2": (0, 16)},
}


def expected_model_state_bytes(engine: str, num_params: int, world_size: int, mixed_precision: str = "no") -> int:
    """Model-state bytes one rank holds for `engine` (see the module table), `num_params` trainable parameters,
    `world_size` ranks and accelerate's `mixed_precision` ('no' = fp32, 'bf16'/'fp16' = mixed)."""
    base = engine.replace("_offload", "").replace("fsdp2_zero2", "fsdp2")
    table = _BYTES_PER_PARAM["fp32" if mixed_precision in ("no", "fp32", None) else "mixed"]
    replicated, sharded = table[base]
    return int(num_params * replicated + num_params * sharded / world_size)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _storage_key_and_bytes(t: torch.Tensor):
    t = _local(t)
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def measure_model_state_bytes(model: torch.nn.Module, optimizer) -> dict:
    """Bytes this rank holds in parameters, gradients and optimizer state, walked from the live tensors.

    Counts each storage once (views into DeepSpeed's flat buffers or DDP's gradient buckets are not counted
    twice). Covers DTensor local shards (FSDP2), DeepSpeed partitions and fp32 master copies, and the optimizer's
    state tensors. Returns {'params', 'grads', 'optimizer', 'total'} in bytes. Engines: all.
    """
    seen: set[int] = set()
    counts = {"params": 0, "grads": 0, "optimizer": 0}

    def add(kind: str, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        key, nbytes = _storage_key_and_bytes(t)
        if key in seen or nbytes == 0:
            return
        seen.add(key)
        counts[kind] += nbytes

    module = getattr(model, "module", model)
    for p in module.parameters():
        add("params", p.ds_tensor if hasattr(p, "ds_tensor") else p)
        add("grads", p.grad)
    zero_opt = getattr(getattr(optimizer, "optimizer", optimizer), "optimizer", None)
    inner = getattr(optimizer, "optimizer", optimizer)
    deepspeed_opt = inner if hasattr(inner, "loss_scaler") or hasattr(inner, "partition_count") else None
    if deepspeed_opt is not None:
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):  # fp32 master partitions
            for master in getattr(deepspeed_opt, name, []) or []:
                add("optimizer", master)
                add("grads", master.grad)
        for name in ("averaged_gradients", "grad_partitions_flat_buffer"):
            held = getattr(deepspeed_opt, name, None)
            values = held.values() if isinstance(held, dict) else [held]
            for v in values:
                for t in (v if isinstance(v, (list, tuple)) else [v]):
                    add("grads", t)
        base = deepspeed_opt.optimizer
    else:
        base = zero_opt if zero_opt is not None and hasattr(zero_opt, "state") else inner
    for state in getattr(base, "state", {}).values():
        for t in state.values():
            add("optimizer", t)
    counts["total"] = sum(counts.values())
    return counts


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: the CUDA caching allocator's peak on GPU, the RSS high-water mark on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def after_inner_step_once(optimizer, callback) -> None:
    """Call `callback()` once, right after the first step of the innermost torch optimizer (the one that updates
    the weights), while gradients are still held.

    Under DeepSpeed that step runs inside `accelerator.backward`, so a hook is the only way to see this moment;
    the same hook gives every engine the same moment of measurement. Engines: all.
    """
    inner = optimizer
    while hasattr(inner, "optimizer"):  # accelerate wrapper -> DeepSpeed ZeRO optimizer -> torch optimizer
        inner = inner.optimizer
    handle = None

    def hook(*_):
        handle.remove()
        callback()

    handle = inner.register_step_post_hook(hook)
