"""The package as a user installs it, and a recipe copied into a project of their own.

A wheel built from this tree (`pip wheel --no-deps --no-build-isolation`, from a copy of it: the build writes build/
beside the sources), installed with `pip install --no-deps --target T` and used with `PYTHONPATH=T` only (the clone's
editable finder comes after it): zero_utils, its version, the recipes, the accelerate YAMLs, the presets and the
bundled assets all come from T. `zero-recipes copy` (as `python -m zero_utils`) writes a recipe into a folder outside
the repository, and the copy, launched from there under FSDP2 on 2 processes, trains and exports (1 launch); the
LoRA and DPO copies parse --help; an unknown name and a changed file in the way are one sentence each (exit 2).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, free_port, isolated_env
from launch_ledger import SITE

from zero_utils.launch.launcher import accelerate_launch_command

SOURCES_ONLY = shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", ".pytest_cache",
                                      ".ruff_cache", "wandb", "gpu_wheels")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(T, an environment that imports zero_utils from T only, a work folder outside the repository)."""
    root = tmp_path_factory.mktemp("installed")
    shutil.copytree(REPO, root / "src", ignore=SOURCES_ONLY)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "wheel"), str(root / "src")],
                   check=True, capture_output=True)
    wheels = list((root / "wheel").glob("zero_recipes-*.whl"))
    assert len(wheels) == 1, wheels
    subprocess.run([*pip, "install", "--no-deps", "--target", str(root / "T"), str(wheels[0])], check=True,
                   capture_output=True)
    # T only, then the launch ledger's recorder (tests/launch_ledger.py: a folder holding only sitecustomize.py)
    env = {**isolated_env(root), "PYTHONPATH": os.pathsep.join([str(root / "T"), str(SITE)])}
    work = root / "project"
    work.mkdir()
    return root / "T", env, work


def python(env, cwd, *args, check=True):
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.unit
def test_the_wheel_ships_the_library_recipes_yamls_presets_and_assets(installed):
    target, env, work = installed
    code = ("import json, importlib.metadata as m, zero_utils\n"
            "from zero_utils.launch.shipped import shipped, recipe_names\n"
            "from zero_utils.launch.launcher import config_file\n"
            "from zero_utils.assets import BUNDLED_DATASET, BUNDLED_MODEL\n"
            "print(json.dumps({'file': zero_utils.__file__, 'version': zero_utils.__version__,"
            " 'dist': m.version('zero-recipes'), 'recipes': recipe_names(), 'fsdp2': str(config_file('fsdp2')),"
            " 'presets': sorted(p.name for p in shipped('presets').glob('*.yaml')), 'model': BUNDLED_MODEL,"
            " 'data': BUNDLED_DATASET}))")
    found = json.loads(python(env, work, "-c", code).stdout)
    inside = str(target / "zero_utils")
    assert found["file"] == f"{inside}/__init__.py"  # not the clone
    assert found["version"] == found["dist"]  # one source: pyproject reads zero_utils.__version__
    assert found["recipes"] == ["llama_dpo", "llama_dpo_lora", "llama_lora", "llama_zero3"]
    assert found["fsdp2"] == f"{inside}/accelerate_configs/fsdp2.yaml"
    assert found["presets"] == sorted(p.name for p in (REPO / "presets").glob("*.yaml"))
    assert found["model"].startswith(inside) and found["data"].startswith(inside)
    for name in ("recipes/llama_zero3.py", "accelerate_configs/zero3.yaml", "presets/llama-3.1-8b-lora.yaml"):
        assert (target / "zero_utils" / name).read_text() == (REPO / name).read_text()  # the same files
    assert (target / "bin" / "zero-recipes").is_file()  # the console script


@pytest.mark.unit
def test_copy_writes_a_recipe_its_yamls_and_presets_and_refuses_with_one_sentence(installed):
    _, env, work = installed
    dest = work / "copy-test"
    out = python(env, work, "-m", "zero_utils", "copy", "llama_lora", str(dest)).stdout
    assert f"cd {dest} && accelerate launch --config_file accelerate_configs/fsdp2.yaml llama_lora.py" in out
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
        "accelerate_configs/ddp.yaml", "accelerate_configs/fsdp2.yaml", "accelerate_configs/zero3.yaml",
        "llama_lora.py", "presets/llama-3.1-8b-lora.yaml"]
    first_line = (dest / "llama_lora.py").read_text().splitlines()[0]
    assert first_line.endswith("(copied from zero-recipes 0.4.0)")
    assert "recipes/llama_lora.py" not in (dest / "llama_lora.py").read_text()  # its commands run from DEST
    python(env, work, "-m", "zero_utils", "copy", "llama_dpo", str(dest))  # the YAMLs it shares are the same
    for recipe in ("llama_lora.py", "llama_dpo.py"):
        assert "--per_device_batch_size" in python(env, dest, recipe, "--help").stdout
    unknown = python(env, work, "-m", "zero_utils", "copy", "llama_sft", str(dest), check=False)
    (dest / "accelerate_configs" / "fsdp2.yaml").write_text("# mine\n")
    in_the_way = python(env, work, "-m", "zero_utils", "copy", "llama_zero3", str(dest), check=False)
    for proc, sentence in ((unknown, "no recipe named 'llama_sft'; the recipes are: llama_dpo, llama_dpo_lora, "
                                     "llama_lora, llama_zero3"),
                           (in_the_way, "fsdp2.yaml already exists; pass --force to overwrite")):
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and sentence in lines[0], proc.stderr
    assert (dest / "accelerate_configs" / "fsdp2.yaml").read_text() == "# mine\n"  # untouched
    assert not (dest / "llama_zero3.py").exists()  # nothing of a refused copy is written
    python(env, work, "-m", "zero_utils", "copy", "llama_zero3", str(dest), "--force")
    shipped_yaml = (REPO / "accelerate_configs/fsdp2.yaml").read_text()
    assert (dest / "accelerate_configs" / "fsdp2.yaml").read_text() == shipped_yaml  # --force overwrote it


# zero-recipes 0.1 kept its modules in one folder; 0.2 moved them into folders by concern and imported the old names
# too; 0.3 does not (docs/ARCHITECTURE.md's rename table maps each). The 0.1 modules whose names are not folders now:
MODULES_OF_0_1 = """accelerator activation_offload attention checkpoint_export checkpoint_storage cli compare_report
    compiling data_mixture data_sources deepspeed_setup distributed engine errors evidence fit_check hub launcher
    measurement memory_estimate memory_formulas optim packing parallelize peak_terms preference_data
    preference_examples preference_loss prepared_mixture prepared_pairs prepared_rows qlora recipe_copy reference_logps
    reference_model sft_examples shipped stop_signals token_loss tracking transfer versions wrapping""".split()


def recipe_imports() -> str:
    """Every `from zero_utils... import ...` line of the shipped recipes, one name per line."""
    lines = set()
    for recipe in sorted((REPO / "recipes").glob("*.py")):
        for node in ast.walk(ast.parse(recipe.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zero_utils"):
                lines |= {f"from {node.module} import {alias.name}" for alias in node.names}
    return "\n".join(sorted(lines)) + "\n"


@pytest.mark.unit
def test_every_name_the_recipes_import_comes_from_the_wheel_and_no_0_1_name_imports(installed):
    """The zero_utils names of every shipped recipe import from T, each defined in a module of T; every 0.1 module
    name that is not a folder now (memory_formulas, accelerator, ...) is a ModuleNotFoundError."""
    target, env, work = installed
    imports = recipe_imports()
    code = imports + textwrap.dedent("""
        import importlib, json, sys, types
        found = {}
        for line in sys.argv[1].splitlines():  # from M import N: M's file, and the file of the module defining N
            _, module, _, name = line.split()
            value = getattr(importlib.import_module(module), name)
            own = value if isinstance(value, types.ModuleType) else sys.modules.get(getattr(value, "__module__", ""))
            found[name] = [sys.modules[module].__file__, getattr(own, "__file__", None)]
        missing = {}
        for old in sys.argv[2:]:
            try:
                importlib.import_module(f"zero_utils.{old}")
            except ModuleNotFoundError as error:
                missing[old] = error.name
        print(json.dumps({"found": found, "missing": missing}))
        """)
    result = json.loads(python(env, work, "-c", code, imports, *MODULES_OF_0_1).stdout)
    names = {line.split()[-1] for line in imports.splitlines()}
    assert len(names) > 40 and set(result["found"]) == names
    for name, files in result["found"].items():  # strings and dicts have no module of their own: None
        assert all(f is None or f.startswith(str(target / "zero_utils")) for f in files) and files[0], (name, files)
    assert result["missing"] == {old: f"zero_utils.{old}" for old in MODULES_OF_0_1}


@pytest.mark.unit
def test_list_names_each_recipe_with_its_first_line(capsys):
    from zero_utils.launch import recipe_copy

    assert recipe_copy.main(["list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    for line, recipe in zip(lines, sorted((REPO / "recipes").glob("*.py")), strict=True):
        first = recipe.read_text().split('"""')[1].splitlines()[0]
        assert line.split()[0] == recipe.stem and line.endswith(first), line


@pytest.mark.distributed
@pytest.mark.slow
def test_a_copied_recipe_trains_from_its_own_folder_on_the_installed_package(installed):
    """`zero-recipes copy llama_zero3 DEST`, then from DEST: accelerate launch --config_file
    accelerate_configs/fsdp2.yaml --num_processes 2 llama_zero3.py: the bundled model and data by default, 2 steps,
    final/ written, and the workers ran the zero_utils of T (summary.json's versions)."""
    target, env, work = installed
    dest = work / "my-project"
    python(env, work, "-m", "zero_utils", "copy", "llama_zero3", str(dest))
    cmd = accelerate_launch_command("llama_zero3.py", ["--max_steps", "2", "--seq_len", "64", "--eval_fraction", "0",
                                                       "--max_new_tokens", "2", "--report_to", "none",
                                                       "--output_dir", "runs/first"],
                                    config_file="accelerate_configs/fsdp2.yaml", num_processes=2,
                                    main_process_port=free_port(), mixed_precision="no")
    proc = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((dest / "runs/first/summary.json").read_text())
    assert summary["engine"] == "fsdp2" and summary["world_size"] == 2 and summary["steps"] == 2
    assert summary["versions"]["zero_utils_from"] == str(target / "zero_utils")
    assert (dest / "runs/first/final/model.safetensors").is_file()
    assert not (REPO / "runs/first").exists()


@pytest.mark.unit
def test_the_suite_runs_without_the_callers_offline_and_tracker_variables():
    """tests/conftest.py's autouse fixture: a user's HF_HUB_OFFLINE=1 (as many clusters set), HF_DATASETS_OFFLINE,
    WANDB_MODE and TOKENIZERS_PARALLELISM do not reach a test unless it sets them (the README's fast tier passes with
    all four set)."""
    from conftest import CALLER_VARIABLES

    assert not [name for name in CALLER_VARIABLES if name in os.environ]
