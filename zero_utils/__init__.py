"""zero-recipes' library: what the recipes (recipes/, shipped inside the package as zero_utils.recipes) call, in
folders by concern. Each folder imports only the folders listed before it (tests/test_configs.py checks it):

    run/         a job's start, collectives and stop: errors, versions, the engine, the Accelerator
    checkpoint/  the checkpoint policy, its storage and its export     (python -m zero_utils.checkpoint export ...)
    formulas/    what the ZeRO math predicts, pure arithmetic
    data/        from a data set to the rows a rank trains on
    launch/      a recipe's flags, accelerate launch lines, the shipped files and the copy command
    model/       loading a model, and parallelism applied to it from outside (FSDP2, DeepSpeed, offloading)
    train/       the optimizer, the loss, what a run measures and records
    memory/      the memory estimate and the fit check                   (python -m zero_utils.memory ...)
    preference/  DPO, IPO and SimPO: pairs, losses, the reference model
    compare/     engines compared side by side                           (python -m zero_utils.compare ...)

zero-recipes 0.1 kept the modules in one folder: a recipe copied from 0.1 imports `zero_utils.accelerator`,
`zero_utils.tracking` (0.1), ... Those names still import, as the same module objects as their new paths (`MOVED`), so
such a recipe keeps running; zero_utils.data, .model and .checkpoint, now folders, re-export what 0.1's recipes
imported, and `python -m zero_utils.memory`, `.checkpoint export` and `.compare` are the folders' __main__."""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.2.0"

MOVED = {  # 0.1's module (zero_utils.<key>) -> its path now (zero_utils.<value>)
    "errors": "run.errors", "versions": "run.versions", "engine": "run.engine", "transfer": "run.transfer",
    "distributed": "run.distributed", "stop_signals": "run.stop_signals", "compiling": "run.compiling",
    "accelerator": "run.accelerator", "checkpoint_storage": "checkpoint.storage",
    "checkpoint_export": "checkpoint.export", "memory_formulas": "formulas.memory",
    "peak_terms": "formulas.peak_terms", "hub": "data.hub", "data_sources": "data.sources",
    "data_mixture": "data.mixture", "sft_examples": "data.sft_examples", "packing": "data.packing",
    "attention": "data.attention", "prepared_rows": "data.prepared_rows", "prepared_mixture": "data.prepared_mixture",
    "cli": "launch.cli", "launcher": "launch.launcher", "shipped": "launch.shipped",
    "recipe_copy": "launch.recipe_copy", "qlora": "model.qlora", "deepspeed_setup": "model.deepspeed_setup",
    "wrapping": "model.wrapping", "parallelize": "model.parallelize",
    "activation_offload": "model.activation_offload", "optim": "train.optim", "token_loss": "train.token_loss",
    "measurement": "train.measurement", "evidence": "train.evidence", "tracking": "train.tracking",
    "memory_estimate": "memory.estimate", "fit_check": "memory.fit_check",
    "preference_examples": "preference.examples", "prepared_pairs": "preference.prepared_pairs",
    "preference_data": "preference.data", "preference_loss": "preference.loss",
    "reference_model": "preference.reference_model", "reference_logps": "preference.reference_logps",
    "compare_report": "compare.report",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a 0.1 module name (zero_utils.accelerator) as the module it is now (zero_utils.run.accelerator): one
    module object under both names, so a patch made through either is seen through both."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.partition(".")[2] if fullname.startswith(f"{__name__}.") else None
        return importlib.util.spec_from_loader(fullname, self) if old in MOVED else None

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{MOVED[spec.name.partition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system overwrites the module's __spec__ with the alias's
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # the module keeps its own spec (name, origin)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
