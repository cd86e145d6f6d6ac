"""Run a recipe unchanged, with probes attached from outside (no line in a recipe exists for a test):

    accelerate launch ... tests/scripts/harness.py --output_dir DIR recipe-flags...

The recipe and the probes come from the environment:
    ZERO_RECIPES_HARNESS_RECIPE          the recipe to run (default recipes/llama_zero3.py)
    ZERO_RECIPES_HARNESS_SLOW_PREP_S     the first example tokenized in this process waits this long first
                                         (a data preparation of hours, in seconds)
    ZERO_RECIPES_HARNESS_SLOW_EXPORT_S   the final export waits this long first
    ZERO_RECIPES_HARNESS_VARLEN_PROBE=1  register the flash-attention stand-in `varlen_probe` (varlen_probe.py)
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _slow_first_call(fn, seconds: float):
    waited = []

    def wrapper(*args, **kwargs):
        if not waited:
            waited.append(True)
            time.sleep(seconds)
        return fn(*args, **kwargs)

    return wrapper


def main() -> None:
    from zero_utils import checkpoint, data

    if os.environ.get("ZERO_RECIPES_HARNESS_SLOW_PREP_S"):
        data.tokenize_example = _slow_first_call(data.tokenize_example,
                                                 float(os.environ["ZERO_RECIPES_HARNESS_SLOW_PREP_S"]))
    if os.environ.get("ZERO_RECIPES_HARNESS_SLOW_EXPORT_S"):
        checkpoint.export = _slow_first_call(checkpoint.export, float(os.environ["ZERO_RECIPES_HARNESS_SLOW_EXPORT_S"]))
    if os.environ.get("ZERO_RECIPES_HARNESS_VARLEN_PROBE") == "1":
        import varlen_probe

        varlen_probe.install()
    recipe = REPO / os.environ.get("ZERO_RECIPES_HARNESS_RECIPE", "recipes/llama_zero3.py")
    sys.argv = [str(recipe), *sys.argv[1:]]
    runpy.run_path(str(recipe), run_name="__main__")


if __name__ == "__main__":
    main()
