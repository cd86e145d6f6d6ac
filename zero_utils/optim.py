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
    """torch AdamW over the trainable parameters; 2-D and larger tensors decay, norms and biases (1-D) do not.

    Build it after FSDP2 sharding so it holds the sharded (DTensor) parameters. Engines: all.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)


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
