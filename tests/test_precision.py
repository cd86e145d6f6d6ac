"""Numerics the recipe decides itself, in process: the gradient clipping every non-DeepSpeed engine does as
DeepSpeed does (the launches that compare engines in bf16: tests/test_pretrained.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from accelerate import DistributedType

from zero_utils.train.optim import clip_gradients


def _model_with_gradients(seed: int = 0) -> tuple[torch.nn.ParameterList, list[torch.Tensor]]:
    torch.manual_seed(seed)
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2**20)), torch.nn.Parameter(torch.zeros(64, 3))])
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params, [p.grad.clone() for p in params]


def _exact_norm(grads) -> float:
    return math.sqrt(math.fsum(x * x for g in grads for x in g.double().flatten().tolist()))


ACCELERATOR = SimpleNamespace(distributed_type=DistributedType.NO, unscale_gradients=lambda: None)


def test_clip_gradients_sums_the_norm_in_fp64_and_scales_as_deepspeed():
    """The norm is the exact one (math.fsum) to 1e-12, where torch's fp32-summed norm (what accelerate's
    clip_grad_norm_ returns) is off by more than 1e-6 already at 10^6 elements; the gradients are multiplied by
    DeepSpeed's factor 1 / ((norm + 1e-6) / max_norm) (`unscale_and_clip_grads`, loss scale 1), bit for bit."""
    model, grads = _model_with_gradients()
    exact = _exact_norm(grads)
    assert abs(float(torch.nn.utils.get_total_norm(grads)) - exact) / exact > 1e-6  # the fp32 sum clipped otherwise
    norm = clip_gradients(ACCELERATOR, model, max_norm=0.5)
    assert float(norm) == pytest.approx(exact, rel=1e-12, abs=0)
    factor = 1.0 / ((exact + 1e-6) / 0.5)
    for param, grad in zip(model, grads, strict=True):
        assert torch.equal(param.grad, grad * factor)


def test_clip_gradients_leaves_gradients_below_the_threshold_alone():
    model, grads = _model_with_gradients(seed=1)
    norm = clip_gradients(ACCELERATOR, model, max_norm=1e3)
    assert float(norm) == pytest.approx(_exact_norm(grads), rel=1e-12, abs=0)
    for param, grad in zip(model, grads, strict=True):
        assert torch.equal(param.grad, grad)
