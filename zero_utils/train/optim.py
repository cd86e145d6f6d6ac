"""AdamW with decoupled weight decay on matrices only, and a learning-rate schedule that is a pure function of the step.

The schedule is applied by setting each param group's `lr` at the start of every optimizer step (as nanoGPT does)
instead of through an LR scheduler object: it works unchanged under every engine (DeepSpeed steps inside
`accelerator.backward`), has no state to checkpoint, and a resumed run with a new `max_steps` follows the new
schedule.
"""

from __future__ import annotations

import math

import torch


def build_adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8):
    """torch AdamW over the trainable parameters; matrices and larger tensors decay, norms and biases (1-D) do not.

    The choice reads each parameter's real shape: under DeepSpeed ZeRO-3 `zero.Init` (pretrained weights with
    `zero3_init_flag: true`) a parameter's data is an empty 1-D partition and `ds_shape` holds its shape, so
    `p.dim()` would put every matrix in the no-decay group. Build it after FSDP2 sharding so it holds the sharded
    (DTensor, global shape) parameters. Engines: all.
    """
    decay, no_decay = param_groups(model)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)


def param_groups(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """The trainable parameters as `build_adamw` groups them, in model order: (matrices, which decay; the rest,
    which do not). Also readable after `accelerator.prepare` (from the unwrapped module), where DeepSpeed has
    regrouped the optimizer's own param groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [p for p in params if is_matrix(p)], [p for p in params if not is_matrix(p)]


def is_matrix(param: torch.Tensor) -> bool:
    """True for a parameter of 2 or more dimensions in the model (DeepSpeed ZeRO-3 partitions: `ds_shape`)."""
    return len(getattr(param, "ds_shape", param.shape)) >= 2


def describe_param_groups(optimizer) -> list[dict]:
    """One dict per param group: {"weight_decay", "tensors", "elements" (whole-model element count, also when
    sharded)}; the same under every engine for the same model. Call it before `accelerator.prepare`."""
    return [{"weight_decay": group["weight_decay"], "tensors": len(group["params"]),
             "elements": sum(getattr(p, "ds_numel", p.numel()) for p in group["params"])}
            for group in optimizer.param_groups]


def lr_at(step: int, *, max_steps: int, peak_lr: float, warmup_steps: int, schedule: str = "cosine",
          min_lr_ratio: float = 0.1) -> float:
    """Learning rate for optimizer step `step` (1-based): linear warmup over `warmup_steps`, then cosine decay to
    `min_lr_ratio * peak_lr` at `max_steps` ('cosine') or flat ('constant')."""
    if warmup_steps > 0 and step <= warmup_steps:
        return peak_lr * step / warmup_steps
    if schedule == "constant" or max_steps <= warmup_steps:
        return peak_lr
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    return peak_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer, lr: float) -> None:
    """Set the learning rate of every param group (works on accelerate's and DeepSpeed's wrapped optimizers)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_gradients(accelerator, model, max_norm: float):
    """Scale the gradients so their global L2 norm is at most `max_norm`; return the norm before clipping (a 0-dim
    fp64 tensor; DeepSpeed's own norm under DeepSpeed).

    DeepSpeed clips inside its engine step (`gradient_clipping`, which `build_accelerator` writes), with the norm
    summed in fp64 and the gradients multiplied by 1 / max(1, (norm + 1e-6) / max_norm). The other engines clip
    here the same way, instead of with torch's `clip_grad_norm_`, which sums in fp32 (1e-5 relative off at 10^8
    parameters on CPU): a clipping factor that differs in the fifth digit is enough for bf16 training to take
    another path (docs/PRECISION.md). A fixed number of ops whatever the parameter count: per device, one foreach
    fp64 norm over the local gradients (FSDP2: this rank's shards) and one foreach multiply, and one all-reduce of the
    sum of squares over the mesh dimensions the gradients are sharded on (FSDP2: the shard group; HSDP: not the
    replicas, which hold the same shards; DDP and one process: none). Needs, for the largest gradient (shard), an
    fp64 copy of it at a time, as DeepSpeed does. Engines: all.
    """
    from accelerate import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.clip_grad_norm_(model.parameters(), max_norm)
    accelerator.unscale_gradients()  # fp16's loss scale; nothing in bf16 and fp32
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    local = []
    for groups, tensors in _local_gradients(grads).items():
        part = _sum_of_squares(tensors, device)
        for group in groups:  # a sharded dimension: each rank holds its shards' part of the sum
            torch.distributed.all_reduce(part, group=group)
        squares += part
        local += tensors
    norm = squares.sqrt()
    scale = 1.0 / torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    for tensors in _by_device(local).values():
        torch._foreach_mul_(tensors, scale.to(tensors[0].device))
    return norm


def _local_gradients(grads: list[torch.Tensor]) -> dict:
    """{the process groups of the mesh dimensions a gradient is sharded on: the local tensors of those gradients}:
    an FSDP2 DTensor gradient's local shard under the groups its sum of squares is all-reduced over (HSDP: the shard
    dimension, not the replicas, which hold the same shards); a plain tensor (DDP, one process) and a replicated
    DTensor under () (whole on every rank: summed once)."""
    from torch.distributed.tensor import DTensor

    by_groups: dict = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            groups = tuple(grad.device_mesh.get_group(dim) for dim, placement in enumerate(grad.placements)
                           if placement.is_shard())
            by_groups.setdefault(groups, []).append(grad.to_local())
        else:
            by_groups.setdefault((), []).append(grad)
    return by_groups


def _by_device(tensors: list[torch.Tensor]) -> dict:
    groups: dict = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return groups


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The fp64 sum of the squared elements of `tensors`, 0-dim on `device`: one foreach norm per device, each
    tensor cast to fp64 before it is squared, as `vector_norm(dtype=float64)` does."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group in _by_device(tensors).values():
        total += torch.stack(torch._foreach_norm(group, 2, dtype=torch.float64)).square().sum().to(device)
    return total
