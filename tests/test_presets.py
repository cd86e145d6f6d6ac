"""`--config run.yaml` (zero_utils.launch.cli) and the presets/ for real models: every preset parses through its
recipe's real flags, command-line flags override the file, and a bad file stops with one sentence that names the
problem. In process: nothing is launched or downloaded."""

from __future__ import annotations

import dataclasses
import runpy
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

from zero_utils.launch.cli import ENGINE_KEYS, parse_settings
from zero_utils.run.errors import UserError

pytestmark = pytest.mark.unit
PRESETS = sorted((REPO / "presets").glob("*.yaml"))


def recipe_of(preset) -> str:
    """A preset's first line names its recipe: `# recipe: recipes/<name>.py`."""
    first = preset.read_text().splitlines()[0]
    assert first.startswith("# recipe: "), f"{preset.name}: the first line names its recipe"
    return first.removeprefix("# recipe: ").strip()


def settings_class(recipe: str):
    return runpy.run_path(str(REPO / recipe), run_name="preset_test")["Settings"]


def run_file(tmp_path, content: str):
    run = tmp_path / "run.yaml"
    run.write_text(content)
    return run


def test_there_are_presets_for_real_models():
    assert {p.name for p in PRESETS} >= {"llama-3.2-1b-full.yaml", "llama-3.1-8b-full.yaml", "llama-3.1-8b-lora.yaml"}
    assert {recipe_of(p) for p in PRESETS} == {"recipes/llama_zero3.py", "recipes/llama_lora.py",
                                               "recipes/llama_dpo.py"}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_parses_and_sets_only_real_flags(preset):
    settings_cls = settings_class(recipe_of(preset))
    values = yaml.safe_load(preset.read_text())
    mixture = values.pop("dataset_mixture", None)  # the data of an alignment-handbook recipe, as it is
    fields = {f.name for f in dataclasses.fields(settings_cls)}
    assert set(values) <= fields, set(values) - fields
    settings = parse_settings(settings_cls, ["--config", str(preset)])
    for key, value in values.items():
        assert getattr(settings, key) == value, key
    assert mixture is None or settings.dataset == str(preset)  # the file is its own --dataset
    text = preset.read_text()
    assert "GPUs assumed:" in text  # the GPU count, and the source of the values at a commit
    assert "pytorch/torchtune@" in text or "huggingface/alignment-handbook@" in text
    assert f"--config presets/{preset.name}" in text  # its own launch line


def test_a_preset_holds_the_values_of_its_source(monkeypatch):
    """Spot checks, copied by hand from torchtune's recipes/configs/llama3_1/8B_lora.yaml and llama3_2/1B_full.yaml."""
    monkeypatch.chdir(REPO)  # the paths as the presets' launch lines write them
    lora = parse_settings(settings_class("recipes/llama_lora.py"), ["--config", "presets/llama-3.1-8b-lora.yaml"])
    assert (lora.lora_r, lora.lora_alpha, lora.lora_dropout, lora.lr, lora.warmup_steps) == (8, 16, 0.0, 3e-4, 100)
    assert (lora.per_device_batch_size, lora.gradient_accumulation_steps) == (2, 8)
    assert lora.lora_target_modules == "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    full = parse_settings(settings_class("recipes/llama_zero3.py"), ["--config", "presets/llama-3.2-1b-full.yaml"])
    assert (full.lr, full.per_device_batch_size, full.gradient_accumulation_steps, full.lr_schedule) == (
        2e-5, 4, 8, "constant")
    assert (full.adam_beta1, full.adam_beta2, full.adam_eps) == (0.9, 0.999, 1e-8)  # torch.optim.AdamW's defaults
    assert lora.min_lr_ratio == 0.0  # torchtune's get_cosine_schedule_with_warmup decays to 0


def test_the_dpo_preset_holds_alignment_handbooks_zephyr_values(monkeypatch):
    """Copied by hand from alignment-handbook's recipes/zephyr-7b-beta/dpo/config_full.yaml at 19f0345 and the
    transformers TrainingArguments defaults it leaves (adamw_torch: betas (0.9, 0.999), eps 1e-8, weight decay 0)."""
    from zero_utils.data.mixture import mixture_in_file

    monkeypatch.chdir(REPO)
    dpo = parse_settings(settings_class("recipes/llama_dpo.py"), ["--config", "presets/zephyr-7b-dpo-full.yaml"])
    assert dpo.model == "alignment-handbook/zephyr-7b-sft-full" and (dpo.loss, dpo.beta, dpo.lr) == ("sigmoid", 0.01,
                                                                                                    5e-7)
    assert (dpo.per_device_batch_size, dpo.gradient_accumulation_steps, dpo.seq_len, dpo.seed) == (8, 2, 1024, 42)
    assert (dpo.adam_beta1, dpo.adam_beta2, dpo.adam_eps, dpo.weight_decay, dpo.min_lr_ratio) == (
        0.9, 0.999, 1e-8, 0.0, 0.0)
    assert dpo.gradient_checkpointing and dpo.warmup_steps == 48 and dpo.max_steps == 477  # 0.1 and 1 epoch of 128
    mixture = mixture_in_file(dpo.dataset)
    assert [(s.id, s.split, s.weight) for s in mixture.sources] == [
        ("HuggingFaceH4/ultrafeedback_binarized", "train_prefs", 1.0),
        ("HuggingFaceH4/ultrafeedback_binarized", "test_prefs", 1.0)]
    assert (mixture.test_split_size, mixture.seed) == (2000, 0)


def test_flags_override_the_file_and_the_file_overrides_defaults(tmp_path):
    run = run_file(tmp_path, "lr: 2.0e-5\nmax_steps: 7\ngradient_checkpointing: true\n")
    settings_cls = settings_class("recipes/llama_zero3.py")
    settings = parse_settings(settings_cls, ["--config", str(run), "--lr", "1e-4"])
    assert (settings.lr, settings.max_steps, settings.gradient_checkpointing) == (1e-4, 7, True)
    settings = parse_settings(settings_cls, ["--no-gradient_checkpointing", "--config", str(run)])
    assert settings.gradient_checkpointing is False and settings.lr == 2e-5
    assert settings.seq_len == 256  # not in the file: the recipe's default
    assert "config" not in dataclasses.asdict(settings)  # what checkpoints store: the resolved flags, no file name


def test_values_yaml_reads_oddly_still_mean_what_the_flag_would(tmp_path):
    """PyYAML reads `2e-5` as a string and `-x` could pass for a flag: both reach the flag as its value."""
    run = run_file(tmp_path, "lr: 2e-5\ncolumns: -p=prompt\nseed: -1\n")
    settings = parse_settings(settings_class("recipes/llama_zero3.py"), ["--config", str(run)])
    assert (settings.lr, settings.columns, settings.seed) == (2e-5, "-p=prompt", -1)


@pytest.mark.parametrize("content, words", [
    ("weight_decy: 0.1\n", ["run.yaml sets 'weight_decy', which is not a flag of this recipe (did you mean "
                            "'weight_decay'?)"]),
    ("mixed_precision: bf16\n", ["run.yaml sets 'mixed_precision', an engine setting: the accelerate YAML owns it "
                                 "(accelerate launch --config_file ...)"]),
    ("zero_stage: 3\n", ["'zero_stage'", "engine setting"]),
    ("zero_optimization: {stage: 3}\n", ["'zero_optimization'", "engine setting"]),
    ("lr: fast\n", ["run.yaml: argument --lr: invalid float value: 'fast'; fix the value in the file."]),
    ("max_steps: 0\n", ["run.yaml: --max_steps 0 is below its minimum 1; pass a value >= 1; fix the value in the "
                        "file."]),
    ("lr_schedule: linear\n", ["run.yaml: argument --lr_schedule: invalid choice: 'linear'"]),
    ("gradient_checkpointing: yes please\n", ["'gradient_checkpointing'", "true or false"]),
    ("- lr\n", ["must be a mapping"]),
    ("lr: [1, 2]\n", ["sets 'lr' to a list; give one value"]),
    ("resume:\n", ["sets 'resume' to nothing; give one value"]),
    ("lr: 1e-4\n  seed: 3\n", ["is not valid YAML"]),
])
def test_a_bad_file_is_one_sentence_naming_the_problem(tmp_path, content, words):
    run = run_file(tmp_path, content)
    with pytest.raises(UserError) as error:
        parse_settings(settings_class("recipes/llama_zero3.py"), ["--config", str(run)])
    message = str(error.value)
    assert "\n" not in message and str(run) in message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("argv, message", [
    (["--lr", "fast"], "error: argument --lr: invalid float value: 'fast'"),
    (["--max_steps", "0"], "error: --max_steps 0 is below its minimum 1; pass a value >= 1."),
])
def test_a_bad_value_on_the_command_line_reads_as_in_the_file(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_settings(settings_class("recipes/llama_zero3.py"), argv)
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def test_every_accelerate_config_key_is_refused():
    """Drift guard: a key accelerate's config file gains is an engine key here too."""
    from accelerate.commands.config.config_args import ClusterConfig

    assert {f.name for f in dataclasses.fields(ClusterConfig)} <= ENGINE_KEYS
    for recipe in ("recipes/llama_zero3.py", "recipes/llama_lora.py"):
        assert not ENGINE_KEYS & {f.name for f in dataclasses.fields(settings_class(recipe))}


def test_help_names_the_config_flag(capsys):
    with pytest.raises(SystemExit):
        parse_settings(settings_class("recipes/llama_lora.py"), ["--help"])
    assert "--config RUN.yaml" in capsys.readouterr().out


def test_readme_presets_exist():
    readme = (REPO / "README.md").read_text()
    named = {token.strip("`") for token in readme.split() if token.strip("`").startswith("presets/")}
    assert named and all((REPO / name).exists() for name in named), named


def test_a_missing_file_stops_the_recipe_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "recipes/llama_zero3.py"), "--config", str(tmp_path / "no.yaml")],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: --config {str(tmp_path / 'no.yaml')!r} is not a file; pass a YAML file of recipe flags, e.g. one "
        "in presets/."]
