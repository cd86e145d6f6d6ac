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


@pytest.fixture
def cpu_bf16(monkeypatch):
    """`cpu_bf16(native)`: this CPU's bf16 capability as torch.cpu reports it, mocked; oneDNN uncapped."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ZERO_RECIPES_CPU_BF16"):
        monkeypatch.delenv(name, raising=False)

    def set_(avx512_bf16: bool, amx: bool = False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    return set_


def test_a_cpu_without_native_bf16_runs_fp32_and_says_how_to_force_bf16(cpu_bf16, monkeypatch, capsys):
    """Issue 67 item 0: on a CPU without AVX512-BF16 or AMX (or with oneDNN capped below them) a bf16 launch builds
    an fp32 Accelerator and says so in one line naming the variable that forces bf16; with native bf16, with the
    variable, or for an fp32 launch nothing changes. The Accelerator is built in process (one process, CPU)."""
    from accelerate.state import AcceleratorState

    from zero_utils.run import accelerator

    def built(requested: str) -> str:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", requested)
        try:
            acc, _ = accelerator.build_accelerator(per_device_batch_size=1, gradient_accumulation_steps=1,
                                                   max_grad_norm=1.0)
            return acc.mixed_precision
        finally:
            AcceleratorState._reset_state(True)

    line = ("mixed precision: fp32, not the launch's bf16: this CPU has no native bf16 (no AVX512-BF16 or AMX), "
            "where a bf16 matmul is about 80x slower than fp32; export ZERO_RECIPES_CPU_BF16=1 to run bf16 anyway.")
    cpu_bf16(avx512_bf16=False)  # an AVX2-only host: torch.backends.cpu.get_cpu_capability() is "AVX2" there
    assert not accelerator.cpu_has_native_bf16()
    assert built("bf16") == "no"
    assert capsys.readouterr().out.splitlines()[0] == line
    assert built("no") == "no" and line not in capsys.readouterr().out
    monkeypatch.setenv("ZERO_RECIPES_CPU_BF16", "1")
    assert built("bf16") == "bf16" and line not in capsys.readouterr().out
    monkeypatch.delenv("ZERO_RECIPES_CPU_BF16")
    for avx512_bf16, amx in ((True, False), (False, True)):  # AVX512-BF16 (this project's host), or AMX
        cpu_bf16(avx512_bf16=avx512_bf16, amx=amx)
        assert accelerator.cpu_has_native_bf16()
        assert built("bf16") == "bf16" and line not in capsys.readouterr().out
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")  # oneDNN capped below its bf16 instructions: emulated again
    assert not accelerator.cpu_has_native_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert accelerator.cpu_has_native_bf16()
