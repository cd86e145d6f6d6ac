"""Measurement: what a run measures on itself, reported next to what the formulas predict
(zero_utils.formulas.model_states): model-state bytes per rank walked from the live tensors, device-memory peaks, bytes
autograd saves for backward, step time and tokens/s, and a checkpoint's disk use. `RunMeasurements` is the one
object a recipe holds for all of it. Units: bytes, seconds, tokens/s. Engines: all.
"""

from __future__ import annotations

import contextlib
import math
import re
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zero_utils.formulas.model_states import expected_model_state_bytes, numel
from zero_utils.model.wrapping import fsdp2_held_gradients, reshard_after_inference
from zero_utils.run import distributed, errors, stop_signals
from zero_utils.run.engine import Engine, shard_group_size
from zero_utils.train.optim import param_groups

# Model-state bytes are measured in the first steps that update only: Adam's state exists after the first update, so
# the second such step's micro-batches hold everything an engine ever holds; later steps hold the same.
MEASURED_STEPS = 2


@dataclass
class StepResult:
    """One optimizer step as every rank saw it, from `RunMeasurements.end_step`: the global loss (mean over the
    global batch's answer tokens), the clipped gradient norm, this step's learning rate, whether any rank received
    a stop signal (`stop`), whether the update is skipped (`skipped`: a non-finite loss), and the measurements of
    its log line. Units: bytes, seconds, tokens/s."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    stop: bool
    skipped: bool
    peaks: dict = field(default_factory=dict)  # max over ranks, this step's own: peak_mem_bytes (+ peak_reserved_bytes)
    model_state_bytes: int | None = None
    model_state_bytes_expected: int | None = None
    step_time_s: float | None = None  # from start_step to the optimizer's update (set once it has happened)
    tokens_per_s: float | None = None
    means: dict = field(default_factory=dict)  # end_step's `extra_sums`, over all ranks, / loss_tokens

    def metrics(self) -> dict:
        """The step's line of metrics.jsonl (and of the trackers)."""
        return {"step": self.step, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm, **self.means,
                "tokens_per_s": self.tokens_per_s, **self.peaks, "model_state_bytes": self.model_state_bytes,
                "model_state_bytes_expected": self.model_state_bytes_expected}


class RunMeasurements:
    """What a training loop measures, and the one call that ends each step:

        meter = RunMeasurements(accelerator, engine, model, optimizer, tokens_per_step=...)   # after prepare
        for step in ...:
            meter.start_step()
            for micro in ...:
                with accelerator.accumulate(model), meter.micro_batch(): ...forward, backward...
            result = meter.end_step(step, lr=..., loss_sum=..., loss_tokens=..., grad_norm=...)
            if result.skipped: continue                             # a non-finite loss: no update
            ...optimizer step...
        summary = meter.summary()                                  # every rank: one collective

    `end_step` makes the step's one collective and one host sync: the loss sum, the gradient norm, the memory peaks
    and whether a stop signal reached any rank travel together (`distributed.reduce_step_values`). A non-finite loss
    marks the step skipped; past `max_bad_steps` such steps it raises `errors.non_finite_loss`, naming
    `newest_checkpoint()` (the last good one) so that nothing is saved over it.

    The expected model-state bytes are the formula's (`formulas.model_states.expected_model_state_bytes`) for this
    engine, world size, precision, the trainable parameters in the optimizer's groups (`optim.param_groups`, the split
    `build_adamw` makes) and the frozen ones (LoRA's base).

    Model-state bytes are measured where they peak, until `MEASURED_STEPS` steps have updated (Adam's state exists
    only after the first update, so the second step's accumulation window holds the most; a skipped step does not
    count): after each micro-batch's backward (`micro_batch`), before the update (gradients of the micro-batches so
    far, FSDP2's accumulated ones included), and right after the innermost optimizer's step while gradients are
    still held (a hook on it: the same moment under every engine, even DeepSpeed, whose step runs inside
    `accelerator.backward`). The largest total over those moments, max over ranks, is `model_state_bytes`; it stays
    fixed after the second step. (The walks after micro-batches fall inside those steps' timed window:
    milliseconds.)

    Memory peaks are each step's own: reset at `start_step` (CUDA: the allocator's peak; CPU: the RSS high-water
    mark, reset through /proc/self/clear_refs), read and reset again at `end_step`, and read once more after the
    update, so a step's line covers its forward and backward passes and the update before it (under DDP and FSDP2
    the update follows `end_step`'s collective; under DeepSpeed it runs inside backward, in its own step). Eval and
    checkpoint saves between steps are in no step's peak; `summary()` keeps the run's maximum, the last update
    included. The step time runs from `start_step` to the innermost optimizer's update, or under DeepSpeed (whose
    update runs inside backward) to the end of `end_step`'s host sync.
    """

    def __init__(self, accelerator, engine: Engine, model, optimizer, *, tokens_per_step: int,
                 max_bad_steps: int = 0, newest_checkpoint=lambda: None):
        self.accelerator, self.device, self.engine = accelerator, accelerator.device, engine
        self.model, self.optimizer = model, optimizer
        self.tokens_per_step, self.max_bad_steps, self.newest_checkpoint = tokens_per_step, max_bad_steps, \
            newest_checkpoint
        module = getattr(model, "module", model)
        shapes = [[tuple(getattr(p, "ds_shape", p.shape)) for p in group]
                  for group in param_groups(module) if group]  # the optimizer's groups
        frozen = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if not p.requires_grad)
        self.expected_model_state_bytes = expected_model_state_bytes(
            engine, sum(map(numel, (s for group in shapes for s in group))), accelerator.num_processes,
            accelerator.mixed_precision, param_groups=shapes, shard_group_size=shard_group_size(accelerator),
            frozen_params=frozen,  # a frozen base (LoRA) is held as parameters only
            # [ZeRO-1] its whole gradients are seen between micro-batches only (at accumulation 1 inside its step)
            gradient_accumulation_steps=accelerator.gradient_accumulation_steps)
        self.bad_steps = 0
        self._steps_updated, self._updated_this_step = 0, False  # steps whose update ran; this step's
        self._local_model_states: dict[str, int] = {}  # this rank's largest measurement so far
        self._model_states: dict[str, int] = {}  # max over ranks, once measured
        self._saved_activations: dict[str, int] = {}
        self._step_times: list[float] = []
        self._peak_keys = tuple(peak_memory(self.device))  # which peaks this device reports
        self._local_run_peaks: dict[str, int] = {}  # this rank's, over the steps and updates so far
        self._update_peaks: dict[str, int] = {}  # this rank's peak in an update that followed end_step
        self._t0 = time.perf_counter()
        self._current: StepResult | None = None  # this step's result once end_step made it
        # Under DeepSpeed the innermost optimizer steps inside `accelerator.backward`: a hook on it is the one moment
        # every engine shares, right after the update while gradients are still held.
        innermost(optimizer).register_step_post_hook(self._on_update)

    def start_step(self) -> None:
        """Start an optimizer step: its timer and its own memory peaks."""
        self._steps_updated += self._updated_this_step
        self._t0, self._current, self._updated_this_step = time.perf_counter(), None, False
        reset_peak_memory(self.device)

    @contextlib.contextmanager
    def micro_batch(self, offload=None):
        """Context manager around one micro-batch's forward and backward: counts the bytes autograd saves for
        backward (the first forward), and in the first `MEASURED_STEPS` updating steps measures the model states this
        rank holds after the backward, unless the update already ran in it (DeepSpeed's last micro-batch), under
        `offload`'s hooks when given (`activation_offload.ActivationOffload`: what it moves is not counted)."""
        with count_saved_activations(self._saved_activations, offload):
            yield
        if self._steps_updated < MEASURED_STEPS and not self._updated_this_step:
            self._measure_model_states()

    def _measure_model_states(self) -> None:
        measured = measure_model_state_bytes(self.model, self.optimizer)
        if measured["total"] > self._local_model_states.get("total", -1):
            self._local_model_states = measured

    def end_step(self, step: int, *, lr: float, loss_sum: torch.Tensor, loss_tokens: int, grad_norm,
                 extra_sums: dict[str, torch.Tensor] | None = None) -> StepResult:
        """End optimizer step `step` on every rank, before the optimizer's update: one collective (this rank's
        token-loss sum, its gradient norm as the engine returns it, its memory peaks, its stop request, and any
        `extra_sums`, e.g. a preference loss's rewards) and one host sync. `loss_tokens` is what the loss is a mean
        over (answer tokens; pairs for a preference loss); each extra sum is divided by it too (`StepResult.means`).
        Returns the step's `StepResult`; raises the non-finite-loss stop past `max_bad_steps`."""
        # this step's, with the update before it (see the class docstring)
        local_peaks = _max_per_key(peak_memory(self.device), self._update_peaks)
        self._update_peaks = {}
        self._local_run_peaks = _max_per_key(self._local_run_peaks, local_peaks)
        reset_peak_memory(self.device)  # what follows (DDP, FSDP2: the update) is read in `_on_update`
        extra_sums = extra_sums or {}
        values = distributed.reduce_step_values(
            self.accelerator, sums={"loss_sum": loss_sum, **extra_sums},
            maxes={"grad_norm": distributed.local_scalar(grad_norm), "stop": 1.0 if stop_signals.received() else 0.0,
                   **local_peaks})
        loss = values["loss_sum"] / loss_tokens
        result = StepResult(step, loss, lr, values["grad_norm"], stop=values["stop"] > 0,
                            skipped=not math.isfinite(loss), means={k: values[k] / loss_tokens for k in extra_sums})
        if result.skipped:
            # the update is skipped (DeepSpeed has already applied it inside backward) and nothing is saved:
            # the last good checkpoint stays the newest
            self.bad_steps += 1
            if self.bad_steps > self.max_bad_steps:
                raise errors.non_finite_loss(loss, step, self.bad_steps, self.max_bad_steps,
                                             newest_checkpoint=self.newest_checkpoint())
            self.accelerator.print(f"warning: non-finite loss at step {step}, update skipped ({self.bad_steps} so far)")
            return result
        result.peaks = {k: int(values[k]) for k in self._peak_keys}
        result.model_state_bytes = self._model_states.get("total")
        result.model_state_bytes_expected = self.expected_model_state_bytes
        self._current = result
        if self.engine.is_deepspeed:  # [DeepSpeed] the update ran inside backward: timed after this host sync
            self._time(result, time.perf_counter())
        return result

    def _on_update(self, *_) -> None:
        updated_at = time.perf_counter()
        self._updated_this_step = True
        if self._current is not None:  # DDP, FSDP2: the update follows end_step; its peak goes to the next one
            self._update_peaks = peak_memory(self.device)
            self._local_run_peaks = _max_per_key(self._local_run_peaks, self._update_peaks)
        if self._steps_updated < MEASURED_STEPS:  # the model states where they peak (not timed)
            self._measure_model_states()
            # every rank steps its optimizer at this point, so the maximum over ranks can be taken here
            self._model_states = distributed.max_over_ranks(self.accelerator, self._local_model_states)
            if self._current is not None:  # DDP, FSDP2, as above
                self._current.model_state_bytes = self._model_states["total"]
        if self._current is not None and self._current.step_time_s is None:  # DDP, FSDP2, as above
            self._time(self._current, updated_at)

    def _time(self, result: StepResult, updated_at: float) -> None:
        result.step_time_s = updated_at - self._t0
        result.tokens_per_s = self.tokens_per_step / result.step_time_s
        self._step_times.append(result.step_time_s)

    def eval_loss(self, token_loss_sum, micro_batches) -> float:
        """The mean loss over the answer tokens of held-out `micro_batches` (`data.training.MicroBatch`, this rank's
        share), all ranks together: `token_loss_sum(micro)` is the summed token loss of one micro-batch, as in training.
        `eval_means` with the answer tokens as the count. Every rank must call it with as many micro-batches
        (`TrainingData.eval_batches` does)."""
        return self.eval_means(lambda micro: {"loss": token_loss_sum(micro), "count": micro.num_loss_tokens},
                               micro_batches)["loss"]

    def eval_means(self, batch_sums, micro_batches) -> dict[str, float]:
        """Means over held-out data, all ranks together: `batch_sums(batch)` returns {name: summed tensor, ...,
        "count": what the sums are over} for one of this rank's `micro_batches`; returns {name: sum / count}. Eval
        mode, no gradients, one all-reduce; [FSDP2] what the forwards left gathered is freed after. Every rank must
        call it with as many batches."""
        self.model.eval()
        totals = None
        with torch.no_grad():
            for batch in micro_batches:
                sums = batch_sums(batch)
                values = torch.stack([v.float() for v in sums.values()])
                totals, names = (values if totals is None else totals + values), list(sums)
        reshard_after_inference(self.model)  # [FSDP2] free what eval left gathered
        self.model.train()
        totals = self.accelerator.reduce(totals, "sum")
        means = (totals / totals[names.index("count")]).tolist()
        return {name: mean for name, mean in zip(names, means, strict=True) if name != "count"}

    def summary(self) -> dict:
        """Medians of step time and tokens/s, the first step's extra seconds (compile time), the run's peaks (max
        over ranks and steps, the last update included), model-state bytes measured (max over ranks and the
        measured moments) and expected (with the params/grads/optimizer breakdown), saved-activation bytes, what the
        peaks measured, in words, and each rank's own peaks and model-state bytes: `peak_mem_bytes_per_rank`
        (`peak_reserved_bytes_per_rank` on CUDA) and `model_state_bytes_per_rank`, lists indexed by rank, so that an
        uneven rank shows (`rank_spread`). A collective: every rank must call it, once, after the loop."""
        local = {f"{k}_per_rank": v for k, v in self._local_run_peaks.items()}
        if self._local_model_states:
            local["model_state_bytes_per_rank"] = self._local_model_states["total"]
        every_rank = distributed.per_rank(self.accelerator, local) if local else {}
        peaks = {k: max(every_rank[f"{k}_per_rank"]) for k in self._local_run_peaks}
        return {
            "tokens_per_s": statistics.median(self.tokens_per_step / t for t in self._step_times)
            if self._step_times else None,
            "step_time_s": statistics.median(self._step_times) if self._step_times else None,
            # the first step beyond the median of the others: compile time (zero_utils.run.compiling), else warm-up
            "first_step_extra_s": self._step_times[0] - statistics.median(self._step_times[1:])
            if len(self._step_times) > 1 else None,
            "peak_mem_bytes": peaks.get("peak_mem_bytes"),
            "peak_reserved_bytes": peaks.get("peak_reserved_bytes"),
            "peak_mem_measured": peak_memory_measured(self.device),
            "model_state_bytes": self._model_states.get("total"),
            "saved_activation_bytes": self._saved_activations.get("saved"),
            "model_state_bytes_expected": self.expected_model_state_bytes,
            "model_state_breakdown_bytes": self._model_states or None,
            **every_rank,
        }


def _max_per_key(peaks: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """Element-wise maximum of two {name: bytes} dicts (a key missing from one counts as 0), keys in a fixed order
    (`peaks`' first): the order every rank sends them in one collective."""
    return {k: max(peaks.get(k, 0), more.get(k, 0)) for k in dict.fromkeys([*peaks, *more])}


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
    twice). Covers DTensor local shards (FSDP2), DeepSpeed partitions and fp32 master copies, the optimizer's
    state tensors, and [FSDP2] the gradients it holds outside `.grad` between micro-batches
    (`wrapping.fsdp2_held_gradients`). Returns {'params', 'grads', 'optimizer', 'total'} in bytes. Communication
    buckets (DDP's reducer, DeepSpeed's reduce and prefetch buckets) are not model states and are not counted; they
    show in the peak memory (`peak_memory`). DDP's live in C++; with `gradient_as_bucket_view=True`
    (zero_utils.run.accelerator) they are the gradients themselves. Engines: all.
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
    for grad in fsdp2_held_gradients(module):
        add("grads", grad)
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


_PROC_STATUS, _PROC_CLEAR_REFS = "/proc/self/status", "/proc/self/clear_refs"
_cpu_peak_resets: list[bool] = []  # [whether writing to clear_refs worked], once tried


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process since the last `reset_peak_memory`: the CUDA caching allocator's allocated peak
    on GPU; on CPU the RSS high-water mark (`VmHWM` of /proc/self/status; `ru_maxrss` where there is no /proc, which
    counts from the process's start). Bytes."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open(_PROC_STATUS) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> bool:
    """Start the peaks of `peak_memory` afresh (at every training step, so each step's line shows its own). CUDA:
    `reset_peak_memory_stats`. CPU: writes `5` to /proc/self/clear_refs, which sets the RSS high-water mark to the
    current RSS (Linux >= 4.0; `ru_maxrss` cannot be reset). Returns whether the peak was reset: False on a CPU host
    whose kernel refuses the write, where the CPU peak keeps counting from the process's start."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    if _cpu_peak_resets == [False]:
        return False
    try:
        with open(_PROC_CLEAR_REFS, "w") as f:
            f.write("5")
        ok = True
    except OSError:
        ok = False
    _cpu_peak_resets[:] = [ok]
    return ok


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
        return ("CUDA caching allocator per rank during training, each step's reset: peak_mem_bytes = "
                "max_memory_allocated, peak_reserved_bytes = max_memory_reserved (nvidia-smi adds the CUDA context)")
    if _cpu_peak_resets == [False]:
        return "process RSS high-water mark per rank since the process started (this kernel refused a reset)"
    return "process RSS high-water mark per rank during training, each step's reset (/proc/self/clear_refs)"


@contextlib.contextmanager
def count_saved_activations(result: dict, offload=None):
    """Count the bytes autograd saves for backward inside the block (a forward pass) into `result["saved"]`, the
    first time only; parameters saved by reference are not activations and are not counted; under `offload`'s hooks
    (an `ActivationOffload`) only what stays on the device counts.

    This is the activation memory of a forward pass, measured exactly and on any device: with activation
    checkpointing only the block inputs are saved, the rest is recomputed in backward. Engines: all.
    """
    if "saved" in result:
        with offload.hooks() if offload is not None else contextlib.nullcontext():
            yield
        return
    seen: set[int] = set()
    total = 0

    def pack(tensor):
        nonlocal total
        packed = offload.pack(tensor) if offload is not None else tensor
        if packed is not tensor or (tensor.is_leaf and tensor.requires_grad):  # moved to the host, or a parameter
            return packed
        key, nbytes = _storage_key_and_bytes(tensor)
        if key not in seen:
            seen.add(key)
            total += nbytes
        return tensor

    unpack = offload.unpack if offload is not None else (lambda tensor: tensor)
    with offload.forward() if offload is not None else contextlib.nullcontext(), \
            torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
    result["saved"] = total


def innermost(optimizer):
    """The torch optimizer that updates the weights, under accelerate's and DeepSpeed's wrappers."""
    while hasattr(optimizer, "optimizer"):  # accelerate wrapper -> DeepSpeed ZeRO optimizer -> torch optimizer
        optimizer = optimizer.optimizer
    return optimizer


def checkpoint_bytes(path: Path) -> dict:
    """Disk use of a checkpoint folder, measured: total bytes and the largest per-rank share of its model/optimizer
    files (DCP's `__<rank>_<n>.distcp`, DeepSpeed's `zero_pp_rank_<rank>_*`). Units: bytes. Engines: all."""
    total = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    per_rank: dict[int, int] = {}
    for f in Path(path).rglob("*"):
        match = re.search(r"(?:__(\d+)_\d+\.distcp|zero_pp_rank_(\d+)_)", f.name)
        if f.is_file() and match:
            rank = int(match.group(1) or match.group(2))
            per_rank[rank] = per_rank.get(rank, 0) + f.stat().st_size
    return {"total": total, "max_per_rank": max(per_rank.values()) if per_rank else total}
