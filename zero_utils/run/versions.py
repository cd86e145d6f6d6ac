"""The software versions that decide how a run behaves, recorded with every run and checkpoint.

No zero_utils imports but the package's version."""

from __future__ import annotations

import platform


def software_versions() -> dict:
    """Versions that decide how a run behaves: python, torch, accelerate, transformers, deepspeed, zero-recipes, and
    the folder zero_utils was imported from (`zero_utils_from`: an installed package, or a clone)."""
    from pathlib import Path

    import accelerate
    import torch
    import transformers

    import zero_utils

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "accelerate": accelerate.__version__, "transformers": transformers.__version__,
                "zero_recipes": zero_utils.__version__, "zero_utils_from": str(Path(zero_utils.__file__).parent)}
    try:
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    except ImportError:
        versions["deepspeed"] = None
    return versions
