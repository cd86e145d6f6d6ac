"""ZERO_RECIPES_HARNESS_LOSS_PROBE=1 (tests/scripts/harness.py): what the first training step creates at the loss.

From the start of step 1 to its `end_step` (forward, backward and clipping of every micro-batch; under DeepSpeed
the update too) a `TorchDispatchMode` sees the output of every aten op, transient ones included (the logits'
gradient never reaches a saved-tensor hook). It records the largest output whose last dimension is the output
head's vocabulary, in tokens' worth of logits (numel / vocab; views are skipped: they allocate nothing). Under
FSDP2 it also counts the all-gathers of the parameter group that holds the output head. `result()` is what the
harness adds to summary.json as "loss_probe_per_rank".
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_state: dict = {"vocab": None, "head": None, "max_logits_tokens": 0, "head_all_gathers": 0, "active": False,
                "done": False}


class _LargestLogits(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == _state["vocab"]:
                    _state["max_logits_tokens"] = max(_state["max_logits_tokens"], t.numel() // _state["vocab"])
        return out


_mode = _LargestLogits()


def _count_head_gathers() -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    unshard = FSDPParamGroup.unshard

    def counted(self, *args, **kwargs):
        pending = self._all_gather_result is None and not self.is_unsharded
        result = unshard(self, *args, **kwargs)
        if (_state["active"] and pending and self._all_gather_result is not None
                and any(module is _state["head"] for module in self.modules)):
            _state["head_all_gathers"] += 1
        return result

    FSDPParamGroup.unshard = counted


def install() -> None:
    _count_head_gathers()


def start(model, accelerator) -> None:
    """At the start of step 1: remember the head and its vocabulary, start recording."""
    if _state["done"]:
        return
    head = accelerator.unwrap_model(model).get_output_embeddings()
    _state.update(vocab=getattr(head.weight, "ds_shape", head.weight.shape)[0], head=head, active=True)
    _mode.__enter__()


def stop() -> None:
    if _state["active"]:
        _mode.__exit__(None, None, None)
        _state.update(active=False, done=True)


def result() -> dict:
    return {k: _state[k] for k in ("vocab", "max_logits_tokens", "head_all_gathers")}
