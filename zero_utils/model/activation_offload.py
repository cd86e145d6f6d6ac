"""Activation offloading: what gradient checkpointing keeps on the device, moved to host memory between a block's
forward and its recompute (the recipes' --activation_offloading, with --gradient_checkpointing).

With checkpointing every block keeps only its inputs for backward (torch's non-reentrant checkpoint saves them
through autograd, outside the block's own recompute hooks), plus the few tensors saved between blocks (the final
norm's input, each loss chunk's hidden states). `ActivationOffload.hooks()` is a `saved_tensors_hooks` context over
a micro-batch's forward: every such tensor of at least `min_bytes` is copied to host memory when autograd saves it
and copied back when backward needs it (a tensor saved by several blocks, the position embeddings or a block mask,
goes out once, and comes back once while any of them still holds it). Parameters are never moved.

On CUDA the host copy is pinned and both copies run on a side stream: the copy out waits for the tensor's producer
and the device memory is released to the allocator only when the copy is done (`record_stream`); the copy back
makes the compute stream wait for it (torchtune's `OffloadActivations` works the same way). On a CPU the same code
path runs with nothing to gain: the "host" copy is another CPU tensor.

Engines: all (the hooks see the tensors autograd saves, under any wrapper). Counters: `offloaded` and `restored`
(tensors) and `offloaded_bytes`, since the object was made.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

MIN_OFFLOAD_BYTES = 2**20  # smaller tensors stay: their copies cost more than they free (torchtune's default: 1 MiB)


class _OnHost:
    """A saved tensor's host copy, and how to bring it back."""

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host, self.device = host, device
        self.restored = lambda: None  # a weak reference to the device copy while some backward still holds it


class ActivationOffload:
    """Move the tensors autograd saves outside checkpointed blocks to host memory and back (module docstring).

        offload = ActivationOffload(accelerator.device)
        with offload.hooks():          # the micro-batch's forward; backward brings each tensor back once
            loss = ...
    """

    def __init__(self, device, *, min_bytes: int | None = None):
        self.device = torch.device(device)
        self.min_bytes = MIN_OFFLOAD_BYTES if min_bytes is None else min_bytes
        self.offloaded = self.restored = self.offloaded_bytes = 0
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._packed: dict[int, tuple] = {}  # id(tensor) -> (weak ref, its _OnHost): a tensor saved twice moves once

    @contextlib.contextmanager
    def hooks(self):
        """The `saved_tensors_hooks` context for one micro-batch's forward."""
        with self.forward(), torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    @contextlib.contextmanager
    def forward(self):
        """One forward's bookkeeping, for a caller that installs `pack` and `unpack` in hooks of its own
        (`zero_utils.train.measurement.count_saved_activations`): a tensor saved twice in it moves once."""
        self._packed = {}
        try:
            yield
        finally:
            self._packed = {}

    def moves(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` goes to host memory: not a parameter, at least `min_bytes`."""
        return not (tensor.is_leaf and tensor.requires_grad) and \
            tensor.numel() * tensor.element_size() >= self.min_bytes

    def pack(self, tensor: torch.Tensor):
        if not self.moves(tensor):
            return tensor
        seen = self._packed.get(id(tensor))
        if seen is not None and seen[0]() is tensor:
            return seen[1]
        if self._stream is not None:  # [CUDA] pinned, on the side stream, after the tensor's producer
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self._stream)  # its memory is reused only once the copy is done
        else:
            host = tensor.detach().to("cpu", copy=True)
        on_host = _OnHost(host, tensor.device)
        self._packed[id(tensor)] = (weakref.ref(tensor), on_host)  # weak: the device copy may be freed now
        self.offloaded += 1
        self.offloaded_bytes += host.numel() * host.element_size()
        return on_host

    def unpack(self, packed):
        if not isinstance(packed, _OnHost):
            return packed
        restored = packed.restored()  # several blocks saved it and one of them still holds the device copy
        if restored is None:
            if self._stream is not None:  # [CUDA] back on the side stream; the compute stream waits for it
                with torch.cuda.stream(self._stream):
                    restored = packed.host.to(packed.device, non_blocking=True)
                torch.cuda.current_stream(packed.device).wait_stream(self._stream)
                restored.record_stream(torch.cuda.current_stream(packed.device))
            else:
                restored = packed.host.to(packed.device, copy=True)
            packed.restored = weakref.ref(restored)  # freed as soon as backward is done with it
            self.restored += 1
        return restored

    def describe(self) -> str:
        """One line for the start of a run."""
        if self._stream is None:
            return ("activation offloading: the checkpointed blocks' inputs copied to host memory and back (on this "
                    "CPU nothing is saved by it: the code path a GPU runs)")
        return ("activation offloading: the checkpointed blocks' inputs in pinned host memory between each block's "
                "forward and its recompute, copied on a side stream")
