"""The files that ship with the package besides its code: the recipes, the accelerate YAMLs and the presets.

They live in the repository's top-level folders (recipes/, accelerate_configs/, presets/) and are packaged from there
as zero_utils.recipes, zero_utils.accelerate_configs and zero_utils.presets (pyproject.toml's package-dir: one
source, no copy; folders without __init__.py, so packages by location only). `shipped(folder)` finds them through
the import system wherever zero_utils was installed from (a wheel, `pip install git+...`); a source checkout (an
editable install, or its folder on PYTHONPATH) imports zero_utils from its own folder, beside which the top-level
folder is the same files.

No zero_utils imports.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

FOLDERS = ("recipes", "accelerate_configs", "presets")


def shipped(folder: str) -> Path:
    """The folder of shipped `folder` files (one of FOLDERS), as a path on disk."""
    if folder not in FOLDERS:
        raise ValueError(f"{folder!r} is not one of {FOLDERS}")
    try:  # a package without __init__.py (a namespace package): its one search location is the folder
        spec = importlib.util.find_spec(f"zero_utils.{folder}")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / folder  # a source checkout, not installed


def recipe_names() -> list[str]:
    """The shipped recipes' names (llama_zero3, ...), sorted."""
    return sorted(p.stem for p in shipped("recipes").glob("*.py") if not p.name.startswith("_"))
