"""Host-to-device copies that do not make the host wait for the GPU.

A copy from pageable host memory to a CUDA device makes the host wait until the GPU has finished the work queued
before it (CUDA synchronises the stream first), so a training step that copies its micro-batches that way stalls
once per tensor. `to_device` pins each host tensor first (page-locked memory from torch's caching host allocator,
which keeps the block until the copy has run) and copies it with `non_blocking=True`: the copy queues behind the
GPU's work and the host goes on to the next micro-batch. On a CPU run it is the plain `.to(device)`.

It imports only torch.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device` (a torch.device or its name), copied without blocking the host: a CPU tensor bound for
    a CUDA device is pinned first, then copied with `non_blocking=True`; a tensor already there is returned as is.
    Any shape and dtype. Engines: all (the copy happens before the engine sees the batch)."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
