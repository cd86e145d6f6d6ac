"""Drift guards: every accelerate YAML names the engine its file name says, written for GPU users."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import CONFIGS, ENGINE_CONFIGS, HARNESS, REPO

pytestmark = pytest.mark.unit
RECIPES = sorted(f"recipes/{path.name}" for path in (REPO / "recipes").glob("*.py"))


def load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())


def test_every_config_is_tested_and_every_tested_config_exists():
    """The engine matrix: every shipped YAML but the multi-node ones (tests/test_multinode.py) and the
    sequence-parallel ones (their base engine + a parallelism_config block: tests/test_sequence_parallel.py)."""
    shipped = sorted(p.stem for p in CONFIGS.glob("*.yaml")
                     if not p.stem.startswith("multinode") and not p.stem.endswith("_sp"))
    assert shipped == sorted(ENGINE_CONFIGS)


@pytest.mark.parametrize("name", ENGINE_CONFIGS)
def test_config_names_its_engine(name):
    cfg = load(name)
    assert cfg["mixed_precision"] == "bf16" and cfg["num_processes"] == 8 and cfg["use_cpu"] is False
    if name == "ddp":
        assert cfg["distributed_type"] == "MULTI_GPU"
    elif name.startswith("zero"):
        ds = cfg["deepspeed_config"]
        assert cfg["distributed_type"] == "DEEPSPEED" and ds["zero_stage"] == int(name[4])
        # one source of truth: accumulation and clipping come from the recipe's flags
        assert "gradient_accumulation_steps" not in ds and "gradient_clipping" not in ds
        offload = name.endswith("_offload")
        assert (ds["offload_optimizer_device"] == "cpu") == offload and (ds["offload_param_device"] == "cpu") == offload
        if ds["zero_stage"] == 3:
            assert ds["zero3_save_16bit_model"] is True
    else:
        fsdp = cfg["fsdp_config"]
        assert cfg["distributed_type"] == "FSDP" and fsdp["fsdp_version"] == 2
        assert fsdp["fsdp_reshard_after_forward"] is (name != "fsdp2_zero2")
        assert fsdp["fsdp_offload_params"] is name.endswith("_offload")


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_help_runs(recipe):
    out = subprocess.run([sys.executable, str(REPO / recipe), "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--model", "--dataset", "--output_dir", "--max_steps", "--per_device_batch_size", "--seq_len",
                 "--gradient_accumulation_steps", "--lr", "--seed", "--save_every", "--resume", "--report_to"):
        assert flag in out.stdout


def test_unknown_flag_is_an_error_that_names_it():
    out = subprocess.run([sys.executable, str(REPO / "recipes/llama_zero3.py"), "--max_stepz", "3"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--max_stepz" in out.stderr


def test_value_out_of_range_is_an_error_that_names_it():
    out = subprocess.run([sys.executable, str(REPO / "recipes/llama_zero3.py"), "--per_device_batch_size", "0"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--per_device_batch_size 0" in out.stderr


def test_zero_utils_never_imports_recipes():
    for path in (REPO / "zero_utils").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("recipes"), path
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("recipes") for a in node.names), path


def allowed_imports() -> dict[str, set[str]]:
    """docs/ARCHITECTURE.md's tiers table: each zero_utils folder -> the folders it may import."""
    text = (REPO / "docs/ARCHITECTURE.md").read_text()
    table = text[text.index("| folder | tier | may import |"):].split("\n\n")[0].splitlines()[2:]
    rows = [[cell.strip() for cell in row.strip("|").split("|")] for row in table]
    return {folder: {other.strip() for other in allowed.split(",") if other.strip()} for folder, _, allowed in rows}


def zero_utils_imports(path: Path) -> set[str]:
    """The zero_utils modules a Python file imports, anywhere in it (function-level imports included), as dotted
    paths below zero_utils: "run.errors" for a module, "data" for a folder's __init__."""
    def module_or_package(dotted: str) -> str:
        return dotted if (REPO / "zero_utils" / f"{dotted.replace('.', '/')}.py").exists() or "." not in dotted \
            else dotted.rsplit(".", 1)[0]
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "zero_utils":
            below = node.module.partition(".")[2]  # the names imported from it: modules, or attributes of one
            names = {a.name for a in node.names if not a.name.startswith("__")}  # not the package's __version__
            imported |= {module_or_package(".".join(filter(None, [below, name]))) for name in names}
        elif isinstance(node, ast.Import):
            imported |= {a.name.partition(".")[2] for a in node.names if a.name.startswith("zero_utils.")}
    return imported


def imports_outside_the_table(package: Path, allowed: dict[str, set[str]]) -> list[str]:
    """Every import, in `package`'s folders, of a folder the importer's row does not name (or of a name that is no
    folder), as "zero_utils.<folder>.<module> imports zero_utils.<name>, not in <folder>'s row"."""
    found = []
    for path in sorted(package.glob("*/*.py")):
        folder = path.parent.name
        assert folder in allowed, f"add zero_utils/{folder}/ to docs/ARCHITECTURE.md's tiers table"
        for other in sorted(zero_utils_imports(path)):
            other_folder = other.split(".")[0]
            if other_folder != folder and other_folder not in allowed[folder]:
                found.append(f"zero_utils.{folder}.{path.stem} imports zero_utils.{other}, not in {folder}'s row")
    return found


def tiers(allowed: dict[str, set[str]]) -> dict[str, int]:
    """Each folder's tier: 0 for a folder that imports none, else one above the highest it may import; a cycle
    raises."""
    tier: dict[str, int] = {}
    while len(tier) < len(allowed):
        ready = {f: max((tier[o] + 1 for o in deps), default=0) for f, deps in allowed.items()
                 if f not in tier and all(o in tier for o in deps)}
        assert ready, f"the tiers table has a cycle among {sorted(set(allowed) - set(tier))}"
        tier.update(ready)
    return tier


def test_zero_utils_folders_import_only_what_the_tiers_table_allows(tmp_path):
    """docs/ARCHITECTURE.md's table is the rule: every folder in it, every import within its row, no cycle, each
    folder's stated tier the one its row gives, siblings (one tier) independent; a planted import outside it (the
    formulas reaching up to the estimator; data reaching a sibling) fails, naming both folders."""
    allowed = allowed_imports()
    folders = sorted(p.name for p in (REPO / "zero_utils").iterdir() if (p / "__init__.py").is_file())
    assert sorted(allowed) == folders
    assert imports_outside_the_table(REPO / "zero_utils", allowed) == []
    tier = tiers(allowed)
    text = (REPO / "docs/ARCHITECTURE.md").read_text()
    stated = dict(re.findall(r"^\| (\w+) \| (\d) \|", text, re.M))
    assert {f: int(t) for f, t in stated.items()} == tier  # the table's tier column is what its rows make
    assert all(tier[other] < tier[folder] for folder, deps in allowed.items() for other in deps)  # no sibling edge
    print("tiers:", {t: sorted(f for f in tier if tier[f] == t) for t in sorted(set(tier.values()))})
    shutil.copytree(REPO / "zero_utils", tmp_path / "zero_utils", ignore=shutil.ignore_patterns("__pycache__"))
    with (tmp_path / "zero_utils/formulas/model_states.py").open("a") as f:
        f.write("\n\ndef _upward():\n    from zero_utils.memory.estimate import ENGINES\n    return ENGINES\n")
    with (tmp_path / "zero_utils/data/packing.py").open("a") as f:
        f.write("\n\ndef _sibling():\n    from zero_utils.checkpoint import policy\n    return policy\n")
    assert imports_outside_the_table(tmp_path / "zero_utils", allowed) == [
        "zero_utils.data.packing imports zero_utils.checkpoint.policy, not in data's row",
        "zero_utils.formulas.model_states imports zero_utils.memory.estimate, not in formulas's row"]


def test_each_folder_holds_a_few_modules_and_says_what():
    """A folder is a concern a reader comes with: at most 12 modules, and an __init__ whose docstring names them
    (assets holds files, and their paths in its __init__)."""
    for folder in allowed_imports():
        modules = sorted(p.stem for p in (REPO / "zero_utils" / folder).glob("*.py"))
        modules = [m for m in modules if not m.startswith("__")]
        assert len(modules) <= 12 and (modules or folder == "assets"), (folder, modules)
        doc = ast.get_docstring(ast.parse((REPO / "zero_utils" / folder / "__init__.py").read_text())) or ""
        assert doc and all(re.search(rf"\b{m}\b", doc) for m in modules), (folder, doc)


def test_memory_formulas_are_pure_arithmetic():
    """The formula modules (formulas/: memory, peak_terms) load neither torch nor accelerate, DeepSpeed or
    transformers (directly or through what they import): the estimator and a reader of the formulas need no
    distributed stack."""
    code = ("import sys, zero_utils.formulas.model_states, zero_utils.formulas.peak_terms; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'accelerate', 'deepspeed', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


MAX_MODULE_LINES = 500  # a guide for a reader (issue 68): nothing is squeezed to fit it
MARKED = {"recipes/llama_lora.py": "recipes/llama_zero3.py", "recipes/llama_dpo_lora.py": "recipes/llama_dpo.py"}


def test_every_zero_utils_module_has_one_job_in_at_most_450_lines():
    """A module's size bounds how many jobs it can hide; each opens with a docstring saying what it owns."""
    for path in sorted((REPO / "zero_utils").rglob("*.py")):
        name = path.relative_to(REPO)
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_MODULE_LINES, f"{name}: {lines} lines; split it by job"
        assert ast.get_docstring(ast.parse(path.read_text())), f"{name} has no module docstring"


@pytest.mark.parametrize("lora, base", sorted(MARKED.items()))
def test_lora_recipe_is_its_base_recipe_plus_lines_marked_lora(lora, base):
    """recipes/llama_lora.py's docstring says every line that differs from llama_zero3.py is marked [LoRA], and
    llama_dpo_lora.py's the same of llama_dpo.py: below the docstrings, every added or changed line carries the
    mark (blank lines aside)."""
    import difflib

    def body(path):
        text = (REPO / path).read_text()
        return text[text.index('"""', 3) + 3:].splitlines()

    assert f"This file is {Path(base).name} with every line that differs" in " ".join(
        (REPO / lora).read_text().split())
    added = [line for line in difflib.ndiff(body(base), body(lora)) if line.startswith("+ ") and line[2:].strip()]
    assert added and all("[LoRA]" in line for line in added), [line for line in added if "[LoRA]" not in line]


def test_readme_commands_point_at_real_files():
    readme = (REPO / "README.md").read_text()
    for name in ENGINE_CONFIGS:
        assert f"accelerate_configs/{name}.yaml" in readme
    for token in readme.split():
        if token.startswith(("recipes/", "accelerate_configs/")) and token.endswith((".py", ".yaml")):
            assert (REPO / token.strip("`")).exists(), token


def test_ruff_clean():
    ruff = Path(sys.executable).parent / "ruff"
    out = subprocess.run([str(ruff), "check", str(REPO)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]


def test_stale_torch_extensions_lock_is_named_and_a_fresh_one_is_not(tmp_path, monkeypatch):
    """A lock left by a killed DeepSpeed op build makes every later launch wait forever: it is reported with the
    file to remove, while a lock as young as a running build is left alone (a private folder, never the real one)."""
    import os
    import time

    from zero_utils.run import accelerator
    from zero_utils.run.errors import UserError

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    accelerator.check_extension_locks()  # just taken: a build in progress
    os.utime(lock, (time.time() - 3600,) * 2)
    with pytest.raises(UserError, match=rf"{lock} is 60 minutes old.*rm {lock}$"):
        accelerator.check_extension_locks()


def _tracked_text_files() -> list[Path]:
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / f for f in files if f.endswith((".md", ".py", ".yaml", ".sbatch", ".toml", ".txt"))
            and not f.startswith("docs/compare/") and (REPO / f).exists()]  # docs/compare/: a report as written


def test_every_zero_utils_name_in_the_repository_exists():
    """Docs, YAML comments and docstrings name `zero_utils.<folder>.<module>[.<attribute>]`: each must import and
    resolve, so a module that is renamed or split cannot leave stale names behind (four YAMLs and a benchmark kept
    naming the runtime module after it was split by job). Names of 0.1, 0.2 and 0.3 that no longer import may stand
    only on a line that says "0.1", "0.2" or "0.3" and in docs/ARCHITECTURE.md's rename table."""
    import importlib
    import re

    import zero_utils
    from zero_utils.launch.shipped import FOLDERS, shipped

    stale = []
    for path in _tracked_text_files():
        text = path.read_text()
        describing_old = {name for line in text.splitlines()
                          if re.search(r"\b0\.[123]\b", line) or line.startswith("| `zero_utils.")
                          for name in re.findall(r"\bzero_utils(?:\.[A-Za-z_]\w*)+", line)}
        for name in sorted(set(re.findall(r"\bzero_utils(?:\.[A-Za-z_]\w*)+", text)) - describing_old):
            top, *attributes = name.split(".")[1:]
            if top in FOLDERS and shipped(top).is_dir() or (top.startswith("__") and hasattr(zero_utils, top)):
                continue  # the shipped folders (packages of the installed wheel), the package's __version__, __file__
            obj, parts = zero_utils, ["zero_utils"]
            for part in [top, *attributes]:
                parts.append(part)
                try:  # an attribute, or a module of a folder
                    obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(".".join(parts))
                except ModuleNotFoundError:
                    stale.append(f"{path.relative_to(REPO)}: {name}")
                    break
    assert not stale, stale


def test_every_repository_path_in_the_docs_exists():
    """A file the docs, comments or docstrings name (`benchmarks/gpu.py`, `docs/MEMORY.md`, ...) exists, from the
    repository root or from the naming file's folder (markdown links)."""
    import re

    top = "zero_utils|recipes|benchmarks|docs|tests|accelerate_configs|presets|examples|tools"
    missing = []
    for path in _tracked_text_files():
        for name in set(re.findall(rf"(?<![\w./-])((?:{top})/[\w./-]*\.(?:py|md|yaml|sbatch|jsonl?|sh|png))",
                                   path.read_text())):
            if name.startswith(("recipes/configs/", "recipes/zephyr-")):  # torchtune's and alignment-handbook's
                # config paths, cited as the presets' sources
                continue
            if not (REPO / name).exists() and not (path.parent / name).exists():
                missing.append(f"{path.relative_to(REPO)}: {name}")
    assert not missing, missing


def test_fast_tier_launches_each_engine_family_and_reaches_every_module():
    """`pytest -m "not slow"` (the tier to run while working, README) keeps one real 2-process launch per engine
    family and reaches every zero_utils module: through the tests' own imports, or through the recipe those
    launches run (tests/scripts/harness.py runs recipes/llama_zero3.py), module imports followed transitively."""
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
                                "-p", "no:cacheprovider"], cwd=REPO, capture_output=True, text=True, check=True)
    fast = {line for line in collected.stdout.splitlines() if "::" in line}
    for config in ("ddp", "zero3", "fsdp2"):
        assert f"tests/test_engines.py::test_config_trains_and_names_its_engine[{config}]" in fast
    entry_points = {REPO / line.split("::")[0] for line in fast} | {REPO / "recipes/llama_zero3.py", HARNESS}
    reached = set().union(*(zero_utils_imports(path) for path in entry_points))
    todo = list(reached)
    while todo:
        module = REPO / "zero_utils" / todo.pop().replace(".", "/")
        for other in zero_utils_imports(module / "__init__.py" if module.is_dir() else module.with_suffix(".py")) \
                - reached:
            reached.add(other)
            todo.append(other)
    modules = {f"{path.parent.name}.{path.stem}" for path in (REPO / "zero_utils").glob("*/*.py")
               if not path.stem.startswith("__")}  # not the entry points (__main__) and folders' re-exports
    assert modules <= reached, f"no fast test reaches {sorted(modules - reached)}"


# zero_utils modules each recipe may import: the full recipe's 12 (the bundled paths from zero_utils.assets since 0.3),
# the LoRA one 3 more, the DPO one 4 more, the LoRA-DPO one 3 more than the DPO one.
MAX_ZERO_UTILS_IMPORTS = {"recipes/llama_zero3.py": 12, "recipes/llama_lora.py": 12 + 3, "recipes/llama_dpo.py": 12 + 4,
                          "recipes/llama_dpo_lora.py": 12 + 4 + 3}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_reads_as_components(recipe):
    """The recipe's shape as docs/ARCHITECTURE.md states it: a loop of at most 35 lines; no engine tested in it
    (engine-specific steps live in zero_utils.model.parallelize); an incompatible checkpoint refused before the model is
    loaded; the fit check made before the data is prepared and the model built; the full recipe imports at most 12
    zero_utils modules (the LoRA one at most 3 more, on [LoRA] lines; the DPO one 4 more: its data, loss and
    reference; the LoRA-DPO one at most 3 more than the DPO one, on [LoRA] lines)."""
    tree = ast.parse((REPO / recipe).read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.For) and getattr(n.target, "id", "") == "step")
    assert loop.end_lineno - loop.lineno + 1 <= 35  # a guide for a reader (issue 68), not a target
    tested = [n.attr for n in ast.walk(main) if isinstance(n, ast.Attribute) and n.attr.startswith("is_")
              and getattr(n.value, "id", "") == "engine"]
    assert not tested, tested

    def first_call(name: str) -> int:
        return min(n.lineno for n in ast.walk(main) if isinstance(n, ast.Call)
                   and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name))

    assert first_call("check") < first_call("load_causal_lm")
    assert first_call("check_fit") < min(first_call("prepare"), first_call("load_causal_lm"))
    assert len(zero_utils_imports(REPO / recipe)) <= MAX_ZERO_UTILS_IMPORTS[recipe]
    # the LoRA recipes' further modules are their own [LoRA] lines: distributed, deepspeed_setup, qlora
    base = MARKED.get(recipe, "recipes/llama_zero3.py")
    extra = zero_utils_imports(REPO / recipe) - zero_utils_imports(REPO / base)
    if recipe.endswith("llama_dpo.py"):
        assert extra == {"preference.data", "preference.loss", "preference.reference"}, extra
        return
    marked = [line for line in (REPO / recipe).read_text().splitlines() if line.startswith("from zero_utils")
              and "[LoRA]" in line]
    assert all(any(re.search(rf"\b{name.split('.')[-1]}\b", line) for line in marked) for name in extra), \
        (extra, marked)
    assert len(extra) <= 3


# ---------------------------------------------------------------------------------------------- README and docs/
README_MAX_LINES = 250
# Flags the docs name that belong to other tools: torchrun and SLURM's launch, pytest, pip, trl (compared against).
OTHER_TOOLS_FLAGS = {"--nnodes", "--nproc_per_node", "--max_restarts", "--nodes", "--cpus-per-task", "--durations",
                     "--no-deps", "--no-build-isolation", "--no-index", "--target", "--quiet", "--dry-run", "--report",
                     "--force-reinstall", "--index-url", "--extra-index-url", "--upgrade", "--only-binary",
                     "--platform", "--python-version", "--dest", "--user", "--basetemp", "--collect-only",
                     "--junitxml", "--maxfail", "--lf", "--per_device_train_batch_size", "--dist",
                     "--no-loadscope-reorder", "--ignored", "--exclude"}


def _docs_pages() -> list[Path]:
    return sorted((REPO / "docs").glob("*.md"))


def _recipe_settings() -> dict[str, type]:
    """{recipe file name: its Settings dataclass}, read without running the recipe."""
    import runpy

    return {path.name: runpy.run_path(str(path), run_name="flags")["Settings"]
            for path in sorted((REPO / "recipes").glob("*.py"))}


def _cli_flags() -> set[str]:
    """Every `--flag` an argparse parser of this repository declares (zero_utils, benchmarks, tools; the suite's own
    pytest options, tests/launch_ledger.py), read from the source, and from the module CLIs' own parsers; every recipe
    flag (and its --no- form); every `accelerate launch` option from accelerate's own parser."""
    from accelerate.commands.launch import launch_command_parser

    flags = set()
    for path in [*REPO.glob("zero_utils/**/*.py"), *REPO.glob("benchmarks/*.py"), *REPO.glob("tools/*.py"),
                 REPO / "tests/launch_ledger.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("add_argument", "addoption"):
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    for settings in _recipe_settings().values():
        for name, field in settings.__dataclass_fields__.items():
            flags |= {f"--{name}"} | ({f"--no-{name}"} if field.type in (bool, "bool") else set())
    flags |= {"--config", "--help"}
    from zero_utils.compare import runner as compare
    from zero_utils.launch import recipe_copy
    from zero_utils.memory import command as memory

    for parser in (launch_command_parser(), memory._parser(), compare._parser(), recipe_copy._parser()):
        flags |= {o for action in parser._actions for o in action.option_strings}  # flags made in loops too
    return flags


def test_readme_is_short_and_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, len(readme.splitlines())
    unlinked = [p.name for p in _docs_pages() if f"](docs/{p.name})" not in readme]
    assert not unlinked, f"README links no {unlinked}"


def test_every_flag_the_docs_name_exists():
    """A `--flag` in README or docs/ belongs to a recipe, a zero_utils / benchmarks / tools command, `accelerate
    launch`, or the short list of other tools' flags: a renamed or removed flag cannot stay in the docs."""
    import re

    known = _cli_flags() | OTHER_TOOLS_FLAGS
    unknown = []
    for path in [REPO / "README.md", *_docs_pages()]:
        for flag in sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]", path.read_text()))):
            if flag not in known:
                unknown.append(f"{path.relative_to(REPO)}: {flag}")
    assert not unknown, unknown


def _readme_commands() -> list[list[str]]:
    """The README's fenced shell commands, continuation lines joined, comments dropped, split as a shell does."""
    import re
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            while "&&" in tokens:  # `cd DEST && accelerate launch ...`: the part after the last &&
                tokens = tokens[tokens.index("&&") + 1:]
            if tokens:
                commands.append(tokens)
    return commands


def test_readme_commands_parse_their_flags(capsys):
    """Every fenced `accelerate launch ... <recipe>.py` in README parses its launcher options with accelerate's own
    parser and its recipe flags with the recipe's (a --config preset included), and every `python -m
    zero_utils...` command with its module's parser: in process, nothing runs."""
    from accelerate.commands.launch import launch_command_parser

    from zero_utils.compare.runner import _parser as compare_parser
    from zero_utils.launch import recipe_copy
    from zero_utils.launch.cli import parse_settings
    from zero_utils.memory import command as memory

    settings = _recipe_settings()
    checked = []
    for tokens in _readme_commands():
        if tokens[:2] == ["accelerate", "launch"]:
            script = next(i for i, t in enumerate(tokens) if t.endswith(".py"))
            launch_command_parser().parse_args([*tokens[2:script], "recipe.py"])  # exits on an unknown option
            parse_settings(settings[Path(tokens[script]).name], tokens[script + 1:])
            checked.append(Path(tokens[script]).name)
        elif tokens[:3] == ["python", "-m", "zero_utils.memory"]:
            memory._parser().parse_args(tokens[3:])
            checked.append("zero_utils.memory")
        elif tokens[:3] == ["python", "-m", "zero_utils.compare"]:
            split = tokens.index("--") if "--" in tokens else len(tokens)
            args, rest = compare_parser().parse_known_args(tokens[3:split])
            assert not rest, rest
            parse_settings(settings["llama_zero3.py"], tokens[split + 1:])  # after --: the default recipe's
            checked.append("zero_utils.compare")
        elif tokens[0] == "zero-recipes" or tokens[:3] == ["python", "-m", "zero_utils"]:
            recipe_copy._parser().parse_args(tokens[1:] if tokens[0] == "zero-recipes" else tokens[3:])
            checked.append("zero-recipes")
    assert {"llama_zero3.py", "llama_lora.py", "llama_dpo.py", "zero_utils.memory", "zero_utils.compare",
            "zero-recipes"} <= set(checked), checked
