"""Will this run fit: a check every recipe makes before it builds the model. It estimates the run's peak memory per
rank with the memory estimator (zero_utils.memory.estimate: the same numbers `python -m zero_utils.memory` prints
for the same settings), prints it term by term next to the device's capacity, and applies the estimator's rule
(`fits`: SAFETY_MARGIN kept free). Within 15% of the usable memory it warns; beyond it, every rank stops with one
sentence naming the engine or setting that fits and its launch line (`UserError`: exit 2).

Capacity: `--device_memory` if given (to plan for a GPU you do not have); else on CUDA what this process can have,
`min(total, free + reserved by this process)` from `torch.cuda.mem_get_info` (another process's memory and NCCL's
buffers are not free: it is read after a first collective, when NCCL has made them), or on CPU the host memory
available now (psutil, capped by a cgroup limit) shared by the node's local processes. Every rank reads its own,
and the smallest is the one verdict all ranks act on (one small collective).
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from zero_utils.data.attention import VARLEN, packing_path
from zero_utils.formulas.peak_terms import TERM_NAMES
from zero_utils.memory.estimate import (
    FitVerdict,
    Setup,
    architecture_from_config,
    fit_verdict,
    format_bytes,
    meta_model,
    parse_bytes,
)
from zero_utils.model.deepspeed_setup import zero3_init_disabled
from zero_utils.run.distributed import local_world_size, per_rank
from zero_utils.run.engine import Engine, sequence_parallel_size
from zero_utils.run.errors import UserError


@dataclass(frozen=True)
class FitCheck:
    """The check's result: the estimate's `setup`, its `verdict` (None with `--no-fit_check`), where the capacity
    came from (`capacity_source`)."""

    setup: Setup | None
    verdict: FitVerdict | None
    capacity_source: str = ""

    def summary(self) -> dict:
        """For summary.json and the tracker's config: `peak_mem_bytes_estimated` (bytes per rank, next to the
        measured `peak_mem_bytes`) and `fit_check` (the terms, capacity and verdict; None when skipped)."""
        if self.verdict is None:
            return {"peak_mem_bytes_estimated": None, "fit_check": None}
        v, states = self.verdict, self.verdict.estimate.model_states
        return {"peak_mem_bytes_estimated": v.total_bytes, "fit_check": {
            "engine": v.estimate.engine.name, "params_bytes": states.gpu["params"], "grads_bytes": states.gpu["grads"],
            "optimizer_bytes": states.gpu["optimizer"], "reference_bytes": v.estimate.reference_bytes,
            "activation_bytes": v.estimate.activation_bytes,
            "transient_bytes": v.estimate.transient_bytes, "offloaded_bytes": v.estimate.cpu_bytes,
            **{f"{name}_bytes": value for name, value in v.estimate.peak_terms.items()},
            "total_bytes": v.total_bytes, "capacity_bytes": v.capacity_bytes, "capacity_source": self.capacity_source,
            "usable_bytes": v.usable_bytes, "status": v.status,
            "inputs": {k: val for k, val in asdict(self.setup).items() if k != "arch"}}}


def host_memory_available_bytes() -> int:
    """Host memory a process can still take, in bytes: psutil's `available`, capped by the cgroup (v2 or v1)
    memory limit less its usage where a container sets one."""
    import psutil

    available = psutil.virtual_memory().available
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit, usage = (Path(path).read_text().strip() for path in (limit_file, usage_file))
            if limit.isdigit() and int(limit) < 2**60:
                available = min(available, max(0, int(limit) - int(usage)))
                break
        except OSError:
            continue
    return available


def device_capacity(device: torch.device, local_processes: int, device_memory: str = "") -> tuple[int, str]:
    """(bytes one rank may use, where that number came from): `device_memory` ('80GB', '80GiB', '80e9') if given,
    else on CUDA `min(total, free + reserved by this process)` (`torch.cuda.mem_get_info`: call it after a first
    collective), else the available host memory / `local_processes`."""
    if device_memory:
        return parse_bytes(device_memory, "--device_memory"), "--device_memory"
    if device.type == "cuda":  # [CUDA] what is free now, and what this process's allocator already holds
        free, total = torch.cuda.mem_get_info(device)
        capacity = min(total, free + torch.cuda.memory_reserved(device))
        return capacity, (f"{torch.cuda.get_device_name(device)}: {format_bytes(capacity)} free or held by this "
                          f"process of {format_bytes(total)}")
    return (host_memory_available_bytes() // local_processes,
            f"host memory available / {local_processes} local process(es)")


def lora_fraction(base, lora_config) -> float:
    """The LoRA adapters' parameters over the base model's: the estimator's --lora_fraction for a run with this peft
    `LoraConfig`. `base`: the model on the meta device (`meta_model`), which gets the adapters (nothing allocated)."""
    from peft import get_peft_model

    base_params = sum(p.numel() for p in base.parameters())
    adapters = sum(p.numel() for p in get_peft_model(base, lora_config).parameters() if p.requires_grad)
    return adapters / base_params


def _recipe_path() -> str:
    path = os.path.abspath(sys.argv[0])
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


_REFERENCE_TERMS = {"model": "reference", "adapters": "reference (adapters off)",
                    "precomputed": "reference (precomputed, freed)"}


def _term_line(check: FitCheck) -> str:
    v, s = check.verdict, check.setup
    states = v.estimate.model_states
    precision = "bf16 mixed precision" if s.dtype == "bf16" else "fp32"
    loss = f"{s.loss_chunk_tokens}-token loss chunks" if s.loss_chunk_tokens else "whole logits"
    shapes = ((TERM_NAMES[name], value) for name, value in v.estimate.peak_terms.items() if value)
    terms = " + ".join(f"{name} {format_bytes(value)}" for name, value in (
        ("params", states.gpu["params"]), ("grads", states.gpu["grads"]), ("optimizer", states.gpu["optimizer"]),
        *(((_REFERENCE_TERMS[s.reference], v.estimate.reference_bytes),) if s.reference != "none" else ()),
        ("activations", v.estimate.activation_bytes), ("transient", v.estimate.transient_bytes), *shapes))
    on_host = v.total_bytes - v.estimate.total_bytes  # what an engine offloads, when host memory is the device
    if on_host:
        terms += f" + offloaded {format_bytes(on_host)}"
    verdict = {"fits": "fits", "tight": "fits, tightly", "too_big": "does NOT fit"}[v.status]
    offloaded = (f"; {format_bytes(v.estimate.cpu_bytes)} per rank offloaded to host memory"
                 if v.estimate.cpu_bytes and not on_host else "")
    return (f"fit check [{v.estimate.engine}{' HSDP' if s.hsdp else ''}, {s.num_gpus * s.num_nodes} rank(s), "
            f"{precision}, micro-batch {s.micro_batch_size} x seq_len {s.seq_len}"
            f"{f' over sequence parallelism {s.sequence_parallel}' if s.sequence_parallel > 1 else ''}, "
            f"{'activation checkpointing, ' if s.activation_checkpointing else ''}"
            f"{'activation offloading, ' if s.activation_offloading else ''}{loss}"
            f"{f', LoRA {s.lora_fraction:.4%} trained' if s.lora_fraction < 1 else ''}]: {terms} = "
            f"{format_bytes(v.total_bytes)} per rank; capacity {format_bytes(v.capacity_bytes)} "
            f"({check.capacity_source}), usable {format_bytes(v.usable_bytes)} -> {verdict}{offloaded}")


def _attention_kind(attn_implementation: str) -> str:
    """The estimator's attention: "eager", "flash" (varlen offsets, no mask) or "sdpa" (transformers' default)."""
    if attn_implementation == "eager":
        return "eager"
    return "flash" if packing_path(attn_implementation) == VARLEN else "sdpa"


def check_fit(accelerator, engine: Engine, model_config, *, seq_len: int, micro_batch_size: int,
              activation_checkpointing: bool, attn_implementation: str, loss_chunk_tokens: int,
              device_memory: str = "", enabled: bool = True, lora_config=None, trust_remote_code: bool = False,
              refuse: bool = True, reference: str = "none", packed_rows: bool = True,
              activation_offloading: bool = False, frozen_config=None) -> FitCheck:
    """Estimate this run's peak memory per rank before the model is built, print it term by term next to the
    capacity, and stop every rank with one sentence (`UserError`) when it does not fit (unless `refuse` is False:
    then a warning). Every rank must call it (one collective agrees on the smallest capacity). `enabled=False`
    (`--no-fit_check`) skips it all. `lora_config`: a peft LoraConfig (only the adapters train). `reference`: what a
    preference loss compares the policy with: "model", a frozen copy held too (recipes/llama_dpo.py); "adapters", the
    LoRA policy's own forward with its adapters off (recipes/llama_dpo_lora.py: 0 bytes); "precomputed", a copy
    freed before the policy is built (recipes/llama_dpo.py --reference precomputed: 0 bytes during training);
    "none". `frozen_config`: with reference "model", the config of a frozen model other than the policy (a
    distillation teacher, zero_utils.train.frozen_model), counted with its own parameters. `packed_rows`: the SFT
    recipes pack rows (under sdpa a block mask, zero_utils.formulas.peak_terms); the DPO
    recipes pad their pairs (False). `activation_offloading` (--activation_offloading, which needs
    `activation_checkpointing`): the blocks' inputs counted in host memory. Engines: all.
    Returns a `FitCheck` whose `summary()` goes into summary.json next to the measured peak."""
    if activation_offloading and not activation_checkpointing:  # checked with the fit check off too
        raise UserError("--activation_offloading moves the checkpointed blocks' inputs to host memory: add "
                        "--gradient_checkpointing.")
    if not enabled:
        return FitCheck(None, None)
    with zero3_init_disabled(accelerator):  # the meta build must not be partitioned by DeepSpeed
        base = meta_model(model_config, trust_remote_code)
        arch = architecture_from_config(model_config, base)
        fraction = lora_fraction(base, lora_config) if lora_config is not None else 1.0  # adds the adapters: after
        frozen_params = (architecture_from_config(frozen_config, meta_model(frozen_config, trust_remote_code))
                         .num_params if frozen_config is not None else None)
    world = accelerator.num_processes
    local = local_world_size(accelerator)
    setup = Setup(num_params=arch.num_params, num_gpus=local, num_nodes=max(1, world // local), hsdp=engine.hsdp,
                  dtype="fp32" if accelerator.mixed_precision == "no" else "bf16", lora_fraction=fraction,
                  arch=arch, seq_len=seq_len, micro_batch_size=micro_batch_size,
                  activation_checkpointing=activation_checkpointing, activation_offloading=activation_offloading,
                  attention=_attention_kind(attn_implementation), packed_rows=packed_rows,
                  loss_chunk_tokens=loss_chunk_tokens, reference=reference, reference_params=frozen_params,
                  sequence_parallel=sequence_parallel_size())  # [SP] a rank's share of every row
    accelerator.wait_for_everyone()  # [CUDA] NCCL makes its buffers at the first collective: read free memory after
    capacity, source = device_capacity(accelerator.device, local, device_memory)
    capacity = min(per_rank(accelerator, {"capacity": capacity})["capacity"])  # one verdict on every rank
    verdict = fit_verdict(setup, engine, capacity, device_is_host=accelerator.device.type == "cpu",
                          recipe=_recipe_path())
    check = FitCheck(setup, verdict, source)
    accelerator.print(_term_line(check))
    if verdict.status == "tight":
        accelerator.print(f"warning: the estimate is {verdict.total_bytes / verdict.usable_bytes:.0%} of the usable "
                          "memory: activations of other shapes, fragmentation or another process may not fit.")
    elif verdict.status == "too_big":
        sentence = (f"this run needs an estimated {format_bytes(verdict.total_bytes)} per rank under {engine}, more "
                    f"than the {format_bytes(verdict.usable_bytes)} usable of {format_bytes(capacity)} "
                    f"({source}); {verdict.advice}. Pass --no-fit_check to start it anyway.")
        if refuse:
            raise UserError(sentence)
        accelerator.print(f"warning: {sentence}")
    return check
