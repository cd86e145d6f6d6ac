"""zero_utils.optim through the recipes' flags: --adam_beta1, --adam_beta2, --adam_eps and --min_lr_ratio reach the
optimizer and the schedule of every recipe, keep their defaults, are refused out of range in one sentence, and a
resume names a changed value as it names any run setting. In a process, against values written out by hand."""

from __future__ import annotations

import math
import runpy

import pytest
import torch
from conftest import REPO

from zero_utils import checkpoint
from zero_utils.cli import parse_settings
from zero_utils.optim import build_adamw, lr_at

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
                               "--min_lr_ratio", "0"])
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
