"""The software versions that decide how a run behaves, recorded with every run and checkpoint.

Bottom layer: no zero_utils imports."""

from __future__ import annotations

import platform


def software_versions() -> dict:
    """Versions that decide how a run behaves: python, torch, accelerate, transformers, deepspeed."""
    import accelerate
    import torch
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "accelerate": accelerate.__version__, "transformers": transformers.__version__}
    try:
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    except ImportError:
        versions["deepspeed"] = None
    return versions
