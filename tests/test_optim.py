"""zero_utils.train.optim through the recipes' flags: --adam_beta1, --adam_beta2, --adam_eps and --min_lr_ratio reach
the optimizer and the schedule of every recipe, keep their defaults, are refused out of range in one sentence, and a
resume names a changed value as it names any run setting. In a process, against values written out by hand."""

from __future__ import annotations

import json
import math
import runpy
import subprocess

import pytest
import torch
from accelerate import DistributedType
from conftest import REPO

from zero_utils.checkpoint import policy as checkpoint
from zero_utils.launch.cli import parse_settings
from zero_utils.train.optim import build_adamw, lr_at

pytestmark = pytest.mark.unit
RECIPES = sorted(f"recipes/{path.name}" for path in (REPO / "recipes").glob("*.py"))


def settings_class(recipe: str):
    return runpy.run_path(str(REPO / recipe), run_name="flags")["Settings"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_optimizer_flags_reach_adamw_and_keep_their_defaults(recipe):
    """Defaults (0.9, 0.95), 1e-8, 10%: the recipes' values before these were flags. Given values land in both of
    build_adamw's param groups, as the recipe passes them."""
    cls = settings_class(recipe)
    default = parse_settings(cls, [])
    assert (default.adam_beta1, default.adam_beta2, default.adam_eps, default.min_lr_ratio) == (0.9, 0.95, 1e-8, 0.1)
    cfg = parse_settings(cls, ["--adam_beta1", "0.8", "--adam_beta2", "0.999", "--adam_eps", "1e-6",
                               "--min_lr_ratio", "0", "--lr", "1e-4"])  # DPO's --lr has no number until resolved
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_adamw(model, cfg.lr, cfg.weight_decay, (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_eps)
    assert len(optimizer.param_groups) == 2
    for group in optimizer.param_groups:
        assert group["betas"] == (0.8, 0.999) and group["eps"] == 1e-6
    source = (REPO / recipe).read_text()  # the recipe passes them: the same call in each
    assert "build_adamw(model, cfg.lr, cfg.weight_decay, (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_eps)" in source
    assert "min_lr_ratio=cfg.min_lr_ratio" in source


def test_the_cosine_floor_by_hand():
    """Peak 1.0, 10 warmup steps of 110: at step 60 (half-way through the decay) cos = 0, so the rate is the floor
    plus half of what lies above it; at the last step the floor itself: 0.1 by default, 0 with --min_lr_ratio 0."""
    at = dict(max_steps=110, peak_lr=1.0, warmup_steps=10)
    assert lr_at(60, **at) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(60, **at, min_lr_ratio=0.0) == pytest.approx(0.5)
    assert lr_at(110, **at) == pytest.approx(0.1) and lr_at(110, **at, min_lr_ratio=0.0) == pytest.approx(0.0)
    assert lr_at(35, **at, min_lr_ratio=0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_out_of_range_values_are_one_sentence(capsys):
    cls = settings_class("recipes/llama_zero3.py")
    for argv, sentence in ((["--adam_beta2", "1.0"], "--adam_beta2 1.0 must stay below 1.0; pass a value < 1.0."),
                           (["--adam_eps=-1e-8"], "--adam_eps -1e-08 is below its minimum 0.0")):
        with pytest.raises(SystemExit) as stopped:
            parse_settings(cls, argv)
        assert stopped.value.code == 2 and sentence in capsys.readouterr().err


def test_a_resume_names_a_changed_optimizer_setting():
    saved = {"adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8, "min_lr_ratio": 0.1}
    current = {**saved, "adam_beta2": 0.999, "min_lr_ratio": 0.0}
    assert checkpoint.changed_settings(saved, current) == [
        "the run resumes with settings that differ from the checkpoint's: adam_beta2 0.95 -> 0.999, "
        "min_lr_ratio 0.1 -> 0.0."]


class _OneProcess:
    """What clip_gradients asks of an Accelerator, for one process without an engine."""

    distributed_type = DistributedType.NO

    def unscale_gradients(self):
        pass


def _model_with_gradients(tensors: int, seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(7, 5)) for _ in range(tensors)])
    for p in model:
        p.grad = torch.randn(p.shape, generator=generator) * 3
    return model


def test_clipping_matches_fsum_in_fp64_and_scales_as_deepspeed_does():
    """One process: the norm is sqrt(math.fsum of the fp64 squares) of every gradient element, and each gradient is
    multiplied by DeepSpeed's factor 1 / max(1, (norm + 1e-6) / max_norm)."""
    from zero_utils.train.optim import clip_gradients

    model = _model_with_gradients(6)
    before = [p.grad.clone() for p in model]
    expected = math.sqrt(math.fsum(float(x) ** 2 for g in before for x in g.double().flatten()))
    norm = clip_gradients(_OneProcess(), model, max_norm=expected / 3)
    assert norm.dtype == torch.float64 and float(norm) == pytest.approx(expected, rel=1e-14)
    factor = 1.0 / ((expected + 1e-6) / (expected / 3))
    for p, g in zip(model, before, strict=True):
        torch.testing.assert_close(p.grad, g * factor, rtol=1e-6, atol=0)


def test_clipping_dispatches_as_many_ops_for_ten_times_the_tensors():
    """The ops clip_gradients dispatches (a TorchDispatchMode sees the top-level aten calls) are the same in number
    for 4 and 40 gradient tensors: foreach norms and multiplies, not one op per gradient (580 at 8B before)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from zero_utils.train.optim import clip_gradients

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    counts = []
    for tensors in (4, 40):
        model = _model_with_gradients(tensors)
        with Count() as count:
            clip_gradients(_OneProcess(), model, max_norm=1.0)
        counts.append(len(count.ops))
    assert counts[0] == counts[1] < 20, counts


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("config", ["ddp", "fsdp2"])
def test_clipping_on_two_ranks_matches_fsum_of_the_whole_gradients(tmp_path, config):
    """2 ranks (tests/scripts/clip_probe.py): under DDP (whole gradients on every rank, no all-reduce of the norm)
    and FSDP2 (each rank's shards, one all-reduce) the norm equals sqrt(math.fsum) of every gathered gradient
    element's fp64 square, and every element is scaled by DeepSpeed's factor. HSDP's sum over the shard group, not
    the replicas: tests/test_multinode.py's HSDP run logs the 4-rank run's grad_norm at every step."""
    from conftest import isolated_env

    from zero_utils.launch.launcher import accelerate_launch_command, config_file, free_port

    out = tmp_path / "clip.json"
    cmd = accelerate_launch_command(REPO / "tests/scripts/clip_probe.py", [str(out)], config_file=config_file(config),
                                    num_processes=2, main_process_port=free_port(), mixed_precision="no")
    proc = subprocess.run(cmd, cwd=REPO, env=isolated_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["engine"] == config
    assert found["norm"] == pytest.approx(found["fsum_norm"], rel=1e-12)
    assert found["largest_scale_error"] < 1e-6


def test_offload_configs_give_each_process_its_cores(monkeypatch):
    """The host optimizer step of zero3_offload and fsdp2_offload: 16 cores (a mocked affinity) and 2 local
    processes under the launcher's OMP_NUM_THREADS=1 give 8 threads each (on this 2-core machine with 2 processes
    the answer, 1, would equal the launcher's and prove nothing); a user's OMP_NUM_THREADS, an engine that steps on
    the device and one core per process change nothing."""
    from zero_utils.run.accelerator import use_cores_for_host_steps
    from zero_utils.run.engine import Engine

    before = torch.get_num_threads()
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    try:
        for name in ("zero3_offload", "fsdp2_offload"):
            torch.set_num_threads(1)
            assert use_cores_for_host_steps(Engine.parse(name)) == 8 and torch.get_num_threads() == 8
        assert use_cores_for_host_steps(Engine.parse("zero3")) is None
        assert use_cores_for_host_steps(Engine.parse("fsdp2_offload"), cores=2) is None  # one core each
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert use_cores_for_host_steps(Engine.parse("fsdp2_offload")) is None
    finally:
        torch.set_num_threads(before)
