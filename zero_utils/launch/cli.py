"""Command-line flags generated from a recipe's settings dataclass: one source of truth for names and defaults.

Each dataclass field becomes `--<name>` with the field's type and default; `flag(default, help, min=, choices=)`
declares one with its help, lower bound and allowed values. Booleans become `--flag` / `--no-flag`. An unknown
flag is an error that names it (argparse's own message).

`--config run.yaml` reads recipe flags from a YAML mapping (`lr: 2.0e-5`, `gradient_checkpointing: true`; presets/
holds presets for real models): each value is checked as the flag would be, flags on the command line override
the file, an unknown key is an error that names it, and engine settings (mixed precision, DeepSpeed, FSDP,
process counts) are refused there: the accelerate YAML (`accelerate launch --config_file`) owns them. The settings
the recipe receives are the resolved ones (file plus flags), and they are what checkpoints store.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from pathlib import Path

from zero_utils.data.mixture import check_mixture, parse_mixture
from zero_utils.run.errors import UserError

# Keys of an accelerate config file, owned by the accelerate YAML and never by a recipe's --config file: the fields
# of accelerate's ClusterConfig (accelerate/commands/config/config_args.py, accelerate 1.15), the keys `accelerate
# config` writes in its deepspeed_config / fsdp_config sections (accelerate/commands/config/cluster.py), and the
# top-level keys of a DeepSpeed JSON config a user may mean instead. A recipe field of the same name (e.g.
# gradient_accumulation_steps, which DeepSpeed's section also holds) is a recipe flag: fields are looked up first.
ENGINE_KEYS = frozenset({
    # ClusterConfig
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "num_machines", "machine_rank", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "main_training_function", "enable_cpu_affinity", "downcast_bf16", "deepspeed_config",
    "fsdp_config", "parallelism_config", "megatron_lm_config", "fp8_config", "dynamo_config", "mpirun_config",
    "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_env", "commands", "command_file",
    # deepspeed_config section
    "deepspeed_config_file", "deepspeed_hostfile", "deepspeed_multinode_launcher", "deepspeed_inclusion_filter",
    "deepspeed_exclusion_filter", "deepspeed_moe_layer_cls_names", "zero_stage", "zero3_init_flag",
    "zero3_save_16bit_model", "offload_optimizer_device", "offload_optimizer_nvme_path", "offload_param_device",
    "offload_param_nvme_path", "gradient_clipping",
    # fsdp_config section
    "fsdp_version", "fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_offload_params",
    "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params", "fsdp_backward_prefetch",
    "fsdp_forward_prefetch", "fsdp_state_dict_type", "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states",
    "fsdp_use_orig_params", "fsdp_activation_checkpointing",
    # DeepSpeed JSON
    "zero_optimization", "bf16", "fp16", "train_batch_size", "train_micro_batch_size_per_gpu"})


def flag(default, help: str, *, min=None, below=None, choices=None):
    """A settings field: its default, its help text, an optional lower bound, an optional bound the value must stay
    below (`below`: exclusive) and allowed values."""
    return dataclasses.field(default=default, metadata={"help": help, "min": min, "below": below, "choices": choices})


def parse_settings(settings_cls, argv=None, description: str | None = None):
    """Parse `argv` (default: sys.argv[1:]) into an instance of the dataclass `settings_cls`, after the values of the
    `--config` file if one is given (so that the command line wins).

    Values below a field's `min` metadata are rejected with a sentence naming the flag and the bound; a bad
    `--config` file raises `UserError` (one sentence naming the file and the key).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    hints = typing.get_type_hints(settings_cls)
    for f in dataclasses.fields(settings_cls):
        kind = hints[f.name]
        meta = f.metadata
        help_text = meta.get("help", "")
        if kind is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=f.default,
                                help=help_text + f" (default: {f.default})")
            continue
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind) if typing.get_args(kind) else kind
        parser.add_argument(f"--{f.name}", type=base, default=f.default, choices=meta.get("choices"),
                            help=help_text + f" (default: {f.default})")
    parser.add_argument("--config", default=None, metavar="RUN.yaml",
                        help="recipe flags from a YAML file (e.g. presets/...); flags given here override it")
    config_path = _config_path(argv)
    if config_path:
        from_file = _flags_from_yaml(config_path, settings_cls)
        _check_file_values(parser, settings_cls, from_file, config_path)  # a bad value there names the file
        if f"--dataset={config_path}" in from_file and "--dataset" in _given(argv):
            raise UserError(f"--dataset and the dataset_mixture of {config_path} both name the data; give one.")
        argv = from_file + argv
    args = parser.parse_args(argv)
    del args.config
    problem = _below_min(settings_cls, args)
    if problem:
        parser.error(problem)
    if hasattr(args, "dataset"):  # a mixture, checked here on every rank before any collective
        given = _given(argv)
        check_mixture(args.dataset, {name.removeprefix("--") for name in given}, "--eval_fraction" in given,
                      from_config=bool(config_path) and args.dataset == config_path)
    return settings_cls(**vars(args))


def _given(tokens: list[str]) -> set[str]:
    """The flags named in `tokens` (`--name` or `--name=value`)."""
    return {t.split("=", 1)[0] for t in tokens if t.startswith("--")}


def _config_path(argv: list[str]) -> str | None:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    return pre.parse_known_args(argv)[0].config


def _below_min(settings_cls, args: argparse.Namespace) -> str | None:
    """The sentence for the first value below its field's `min` (or not below its `below`), or None."""
    for f in dataclasses.fields(settings_cls):
        bound, ceiling, value = f.metadata.get("min"), f.metadata.get("below"), getattr(args, f.name)
        if bound is not None and value is not None and value < bound:
            return f"--{f.name} {value} is below its minimum {bound}; pass a value >= {bound}."
        if ceiling is not None and value is not None and value >= ceiling:
            return f"--{f.name} {value} must stay below {ceiling}; pass a value < {ceiling}."
    return None


def _flags_from_yaml(path: str, settings_cls) -> list[str]:
    """The YAML mapping at `path` as command-line tokens (`--key=value`, `--flag` / `--no-flag`), placed before
    the real command line so that its flags win. `UserError` for a missing file, invalid YAML, an engine key or
    an unknown key (with the closest flag)."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UserError(f"--config {path!r} is not a file; pass a YAML file of recipe flags, e.g. one in presets/.")
    try:
        values = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as error:
        raise UserError(f"--config {path} is not valid YAML ({str(error).splitlines()[0]}); fix the file.") from None
    if not isinstance(values, dict):
        raise UserError(f"--config {path} must be a mapping of flag names to values (lr: 2.0e-5), not a "
                        f"{type(values).__name__}.")
    fields = {f.name for f in dataclasses.fields(settings_cls)}
    hints = typing.get_type_hints(settings_cls)
    tokens = []
    tokens_first = []
    if "dataset_mixture" in values and "dataset" in fields:  # alignment-handbook's key: the file is the data
        if "dataset" in values:
            raise UserError(f"{path} sets both dataset and dataset_mixture; keep one.")
        parse_mixture(values.pop("dataset_mixture"), path)  # its problems named now, as the file's
        tokens_first = [f"--dataset={path}"]
    for key, value in values.items():
        if key not in fields:
            if key in ENGINE_KEYS:
                raise UserError(f"{path} sets {key!r}, an engine setting: the accelerate YAML owns it "
                                "(accelerate launch --config_file ...); remove it from the recipe's --config file.")
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"{path} sets {key!r}, which is not a flag of this recipe{hint}; see --help for the "
                            "flags a --config file may set.")
        if value is None or isinstance(value, (list, dict)):
            raise UserError(f"{path} sets {key!r} to {'nothing' if value is None else 'a ' + type(value).__name__}; "
                            "give one value, as on the command line (comma-separated where the flag takes several).")
        if hints[key] is bool:
            if not isinstance(value, bool):
                raise UserError(f"{path} sets {key!r} to {value!r}; it is a switch: write true or false.")
            tokens.append(f"--{key}" if value else f"--no-{key}")
        else:
            tokens.append(f"--{key}={value}")  # one token, so that a value starting with "-" stays a value
    return tokens_first + tokens


def _check_file_values(parser: argparse.ArgumentParser, settings_cls, tokens: list[str], path: str) -> None:
    """Parse the file's tokens alone and check their bounds, so that a bad value is reported as the file's, in the
    words the flag's error uses."""
    parser.exit_on_error = False  # a bad value raises argparse.ArgumentError (the flag's message) instead of exiting
    try:
        problem = _below_min(settings_cls, parser.parse_args(tokens))
    except argparse.ArgumentError as error:
        problem = str(error)
    finally:
        parser.exit_on_error = True
    if problem:
        raise UserError(f"{path}: {problem.rstrip('.')}; fix the value in the file.")


def _exit_now(code: int) -> None:
    """Leave with `code` at once: without the interpreter's finalization, which under a launcher can outlast the
    moment torchrun stops the other ranks (its SIGTERM then ends this one as -15, not 2) and can abort in gloo's
    teardown (see zero_utils.run.accelerator.close_and_exit)."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_recipe(main, settings_cls, description: str | None = None) -> None:
    """Parse the flags into `settings_cls`, run `main(settings)`, and turn the errors a user can act on into one
    line on stderr: `UserError` -> "error: ..." and exit 2, `TrainingStopped` -> "stopped: ..." and exit 1."""
    from zero_utils.run.errors import TrainingStopped

    try:
        main(parse_settings(settings_cls, description=description))
    except UserError as error:  # a --config file's problem or the run's: one line, as for any flag
        print(f"error: {error}", file=sys.stderr)
        _exit_now(2)
    except TrainingStopped as stopped:
        print(f"stopped: {stopped}", file=sys.stderr)
        sys.exit(1)
