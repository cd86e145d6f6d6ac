"""What a run measures on itself, reported next to what the formulas predict (zero_utils.memory): model-state bytes
per rank walked from the live tensors, device-memory peaks, bytes autograd saves for backward, step time and
tokens/s. `RunMeasurements` is the one object a recipe holds for all of it. Units: bytes, seconds, tokens/s.
Engines: all.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time

import torch

from zero_utils import distributed


class RunMeasurements:
    """The measurements a training loop reports, in a few visible calls:

        meter = RunMeasurements(accelerator, model, optimizer, tokens_per_step=..., expected_model_state_bytes=...)
        for step in ...:
            meter.start_step()
            with meter.count_saved_activations(): ...forward...     # the first forward only
            values = distributed.reduce_step_values(accelerator, sums=..., maxes=meter.peak_memory())
            ...optimizer step...
            metrics = meter.step_metrics(values)                   # time, tokens/s, peaks, model-state bytes
        summary = meter.summary()                                  # every rank: one collective

    Create it after `accelerator.prepare`, right before the loop: memory peaks count from then on (CUDA), so they
    show training, not loading. Model-state bytes are measured once, right after the innermost optimizer's first
    step while gradients are still held: the same moment under every engine, even DeepSpeed, whose step runs inside
    `accelerator.backward`. `step_metrics` takes their maximum over ranks the first time (one collective, once).
    """

    def __init__(self, accelerator, model, optimizer, *, tokens_per_step: int, expected_model_state_bytes: int):
        self.accelerator, self.device = accelerator, accelerator.device
        self.tokens_per_step, self.expected_model_state_bytes = tokens_per_step, expected_model_state_bytes
        self._local_model_states: dict[str, int] = {}
        self._model_states: dict[str, int] = {}  # max over ranks, once measured
        self._saved_activations: dict[str, int] = {}
        self._step_times: list[float] = []
        self._peaks: dict[str, int] = {}  # max over ranks, from the last step's reduction
        self._local_peaks: dict[str, int] = {}  # this rank's, as sent to that reduction
        self._peak_keys = tuple(peak_memory(self.device))  # which peaks this device reports
        self._t0 = time.perf_counter()
        after_inner_step_once(
            optimizer, lambda: self._local_model_states.update(measure_model_state_bytes(model, optimizer)))
        reset_peak_memory(self.device)

    def start_step(self) -> None:
        self._t0 = time.perf_counter()

    def count_saved_activations(self):
        """Context manager around a forward pass: bytes autograd saves for backward, counted the first time."""
        return count_saved_activations(self._saved_activations)

    def peak_memory(self) -> dict[str, int]:
        """This rank's memory peaks so far (see `peak_memory`), to be maxed over ranks with the step's values."""
        self._local_peaks = peak_memory(self.device)
        return self._local_peaks

    def step_metrics(self, reduced: dict[str, float]) -> dict:
        """The step's measurements for its log line: tokens_per_s, the memory peaks (max over ranks, taken from
        `reduced`, the step's `reduce_step_values`), model_state_bytes and model_state_bytes_expected."""
        step_time_s = time.perf_counter() - self._t0
        self._step_times.append(step_time_s)
        if self._local_model_states and not self._model_states:
            self._model_states = distributed.max_over_ranks(self.accelerator, self._local_model_states)
        self._peaks = {k: int(reduced[k]) for k in self._peak_keys}
        return {"tokens_per_s": self.tokens_per_step / step_time_s, **self._peaks,
                "model_state_bytes": self._model_states.get("total"),
                "model_state_bytes_expected": self.expected_model_state_bytes}

    def summary(self) -> dict:
        """Medians of step time and tokens/s, the last peaks (max over ranks), model-state bytes measured (max over
        ranks) and expected (with the params/grads/optimizer breakdown), saved-activation bytes, what the peaks
        measured, in words, and each rank's own peaks and model-state bytes: `peak_mem_bytes_per_rank`
        (`peak_reserved_bytes_per_rank` on CUDA) and `model_state_bytes_per_rank`, lists indexed by rank, so that
        an uneven rank shows (`rank_spread`). A collective: every rank must call it, once, after the loop."""
        local = {f"{k}_per_rank": v for k, v in self._local_peaks.items()}
        if self._local_model_states:
            local["model_state_bytes_per_rank"] = self._local_model_states["total"]
        every_rank = distributed.per_rank(self.accelerator, local) if local else {}
        return {
            "tokens_per_s": statistics.median(self.tokens_per_step / t for t in self._step_times)
            if self._step_times else None,
            "step_time_s": statistics.median(self._step_times) if self._step_times else None,
            "peak_mem_bytes": self._peaks.get("peak_mem_bytes"),
            "peak_reserved_bytes": self._peaks.get("peak_reserved_bytes"),
            "peak_mem_measured": peak_memory_measured(self.device),
            "model_state_bytes": self._model_states.get("total"),
            "saved_activation_bytes": self._saved_activations.get("saved"),
            "model_state_bytes_expected": self.expected_model_state_bytes,
            "model_state_breakdown_bytes": self._model_states or None,
            **every_rank,
        }


def rank_spread(per_rank: list[int | float] | None) -> float | None:
    """How far a per-rank figure's ranks differ: (max - min) / max, e.g. 0.05 when the smallest rank holds 5%
    less than the largest; None without values."""
    if not per_rank or max(per_rank) <= 0:
        return None
    return (max(per_rank) - min(per_rank)) / max(per_rank)


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
    state tensors. Returns {'params', 'grads', 'optimizer', 'total'} in bytes. Communication buckets (DDP's
    reducer, DeepSpeed's reduce and prefetch buckets) are not model states and are not counted; they show in the
    peak memory (`peak_memory`). DDP's live in C++; with `gradient_as_bucket_view=True` (zero_utils.accelerator) they
    are the gradients themselves. Engines: all.
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
    counts["total"] = counts["params"] + counts["grads"] + counts["optimizer"]
    return counts


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: the CUDA caching allocator's allocated peak on GPU (since the last
    `reset_peak_memory`), the RSS high-water mark on CPU (since the process started)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> None:
    """Start the peaks of `peak_memory` afresh, e.g. once set-up (loading, sharding, prepare) is done, so they show
    training alone. CUDA only: the CPU figure is the process's RSS high-water mark, which is not reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, int]:
    """This process's memory peaks, in bytes. CUDA: {"peak_mem_bytes": most bytes allocated in tensors,
    "peak_reserved_bytes": most bytes the caching allocator held (nvidia-smi shows this plus the CUDA context)},
    since the last `reset_peak_memory`. CPU: {"peak_mem_bytes": the RSS high-water mark}. Engines: all."""
    if device.type == "cuda":
        return {"peak_mem_bytes": int(torch.cuda.max_memory_allocated(device)),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}
    return {"peak_mem_bytes": peak_memory_bytes(device)}


def peak_memory_measured(device: torch.device) -> str:
    """What `peak_memory` measured on `device`, in words, for summary.json."""
    if device.type == "cuda":
        return ("CUDA caching allocator per rank since training began (after set-up): peak_mem_bytes = "
                "max_memory_allocated, peak_reserved_bytes = max_memory_reserved (nvidia-smi adds the CUDA context)")
    return "process RSS high-water mark per rank (CPU: includes set-up and host libraries)"


@contextlib.contextmanager
def count_saved_activations(result: dict):
    """Count the bytes autograd saves for backward inside the block (a forward pass) into `result["saved"]`, the
    first time only; parameters saved by reference are not activations and are not counted.

    This is the activation memory of a forward pass, measured exactly and on any device: with activation
    checkpointing only the block inputs are saved, the rest is recomputed in backward. Engines: all.
    """
    if "saved" in result:
        yield
        return
    seen: set[int] = set()
    total = 0

    def pack(tensor):
        nonlocal total
        if tensor.is_leaf and tensor.requires_grad:  # a parameter, held anyway
            return tensor
        key, nbytes = _storage_key_and_bytes(tensor)
        if key not in seen:
            seen.add(key)
            total += nbytes
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield
    result["saved"] = total


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
