"""`--config run.yaml` (zero_utils.cli) and the presets/ for real models: every preset parses through its recipe's
real flags, command-line flags override the file, and a bad file stops with one sentence that names the problem.
In process: nothing is launched or downloaded."""

from __future__ import annotations

import runpy
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

from zero_utils.cli import parse_settings
from zero_utils.errors import UserError

pytestmark = pytest.mark.unit
PRESETS = sorted((REPO / "presets").glob("*.yaml"))


def recipe_of(preset) -> str:
    first = preset.read_text().splitlines()[0]
    assert first.startswith("# recipe: "), f"{preset.name}: the first line names its recipe"
    return first.removeprefix("# recipe: ").strip()


def settings_class(recipe: str):
    return runpy.run_path(str(REPO / recipe), run_name="preset_test")["Settings"]


def test_there_are_presets_for_real_models():
    assert {p.name for p in PRESETS} >= {"llama-3.2-1b-full.yaml", "llama-3.1-8b-full.yaml", "llama-3.1-8b-lora.yaml"}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_parses_and_sets_only_real_flags(preset):
    recipe = recipe_of(preset)
    settings_cls = settings_class(recipe)
    values = yaml.safe_load(preset.read_text())
    fields = set(settings_cls.__dataclass_fields__)
    assert set(values) <= fields, set(values) - fields
    settings = parse_settings(settings_cls, ["--config", str(preset)])
    for key, value in values.items():
        assert getattr(settings, key) == value, key
    text = preset.read_text()
    assert "GPUs assumed:" in text and "torchtune" in text  # the GPU count and the source of the values


def test_flags_override_the_file_and_the_file_overrides_defaults(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("lr: 2.0e-5\nmax_steps: 7\ngradient_checkpointing: true\n")
    settings_cls = settings_class("recipes/llama_zero3.py")
    settings = parse_settings(settings_cls, ["--config", str(run), "--lr", "1e-4"])
    assert (settings.lr, settings.max_steps, settings.gradient_checkpointing) == (1e-4, 7, True)
    settings = parse_settings(settings_cls, ["--no-gradient_checkpointing", "--config", str(run)])
    assert settings.gradient_checkpointing is False and settings.lr == 2e-5
    assert settings.seq_len == 256  # not in the file: the recipe's default


@pytest.mark.parametrize("content, words", [
    ("weight_decy: 0.1\n", ["'weight_decy'", "not a flag", "did you mean 'weight_decay'"]),
    ("mixed_precision: bf16\n", ["'mixed_precision'", "engine setting", "accelerate"]),
    ("zero_stage: 3\n", ["'zero_stage'", "engine setting"]),
    ("lr: fast\n", ["run.yaml", "--lr", "invalid float value: 'fast'"]),
    ("lr_schedule: linear\n", ["run.yaml", "--lr_schedule", "invalid choice"]),
    ("gradient_checkpointing: yes please\n", ["'gradient_checkpointing'", "true or false"]),
    ("- lr\n", ["mapping"]),
    ("lr: [1, 2]\n", ["'lr'", "one value"]),
])
def test_a_bad_file_is_one_sentence_naming_the_problem(tmp_path, content, words):
    run = tmp_path / "run.yaml"
    run.write_text(content)
    with pytest.raises(UserError) as error:
        parse_settings(settings_class("recipes/llama_zero3.py"), ["--config", str(run)])
    for word in words:
        assert word in str(error.value), (word, str(error.value))


def test_a_missing_file_stops_the_recipe_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "recipes/llama_zero3.py"), "--config", str(tmp_path / "no.yaml")],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: --config {str(tmp_path / 'no.yaml')!r} is not a file; pass a YAML file of recipe flags, e.g. one "
        "in presets/."]
