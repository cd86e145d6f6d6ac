"""torch.compile as accelerate configures it, applied by us: each decoder block compiled in place.

accelerate's launch settings decide whether a run compiles (`accelerate launch --dynamo_backend inductor
--dynamo_use_regional_compilation`, or in a YAML `dynamo_config: {dynamo_backend: INDUCTOR,
dynamo_use_regional_compilation: true}`; they reach the processes as ACCELERATE_DYNAMO_* variables). No recipe flag
repeats them. What we do with them differs from accelerate's own `prepare` in one way: every decoder block is
compiled in place (`nn.Module.compile`, as torchtitan and accelerate's FSDP2 and DeepSpeed paths do), under every
engine, before the engine wraps the model; accelerate is then told not to compile again
(`zero_utils.run.accelerator.build_accelerator`). Why in place: under DDP accelerate's `compile_regions` returns a copy
of the model whose blocks are `OptimizedModule`s, so parameter names gain `_orig_mod.` (checkpoints, exports and
adapters would not match an eager run's) and its leaves, the output head among them, are compiled too (our chunked
head replaces the head's forward: `zero_utils.train.token_loss`). In place, names stay as they are and a checkpoint
moves freely between compiled and eager runs.

The output head and its chunked loss run eagerly; the embedding and final norm too. Compiling whole models (no
regional compilation) is refused with one sentence at start: our sharding wraps blocks and our loss chunks the head.
accelerate 1.15's DeepSpeed launcher does not pass the dynamo flags to its processes: with DeepSpeed, export
ACCELERATE_DYNAMO_BACKEND=INDUCTOR ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=true before `accelerate launch`
(the processes inherit them); a DeepSpeed launch given the flags is refused with that sentence rather than run
uncompiled.

Engines: DDP, DeepSpeed ZeRO-1/2/3, FSDP2 (each YAML), one process.
"""

from __future__ import annotations

import os

from zero_utils.run.errors import UserError


def compile_settings() -> dict | None:
    """The launch's compile settings as `torch.compile` keyword arguments (accelerate's `TorchDynamoPlugin`, read
    from the ACCELERATE_DYNAMO_* variables `accelerate launch` sets: backend, and mode, fullgraph, dynamic where they
    differ from torch's defaults); None when the launch does not compile. Raises `UserError` when it asks for a
    whole-model compile (no regional compilation)."""
    from accelerate.utils import DynamoBackend, TorchDynamoPlugin

    plugin = TorchDynamoPlugin()
    if plugin.backend == DynamoBackend.NO:
        if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and "ACCELERATE_DYNAMO_BACKEND" not in os.environ \
                and launch_asked_for_compile(_launcher_command_line()):
            raise UserError("accelerate 1.15 does not pass --dynamo_backend to a DeepSpeed launch (its DeepSpeed "
                            "launcher sets no ACCELERATE_DYNAMO_* variable), so this run would not compile: export "
                            "ACCELERATE_DYNAMO_BACKEND=INDUCTOR ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=true "
                            "before accelerate launch instead of the flags.")
        return None
    settings = plugin.to_kwargs()
    if not plugin.use_regional_compilation:
        raise UserError(f"the launch compiles the whole model (dynamo backend {settings['backend']} without regional "
                        "compilation), which these recipes do not support (they shard block by block and chunk the "
                        "output head's loss): add --dynamo_use_regional_compilation to accelerate launch (or "
                        "dynamo_use_regional_compilation: true under dynamo_config in the YAML).")
    return settings


def launch_asked_for_compile(command_line: list[str]) -> bool:
    """Whether an `accelerate launch` command line asks for a compile: `--dynamo_backend X` (X not "no"), or a
    `--config_file` whose `dynamo_config` names a backend other than NO."""
    for flag, value in zip(command_line, command_line[1:], strict=False):
        if flag == "--dynamo_backend":
            return value.lower() != "no"
    if "--config_file" in command_line[:-1]:
        import yaml

        try:
            with open(command_line[command_line.index("--config_file") + 1]) as f:
                config = yaml.safe_load(f) or {}
        except OSError:
            return False
        return str((config.get("dynamo_config") or {}).get("dynamo_backend", "NO")).upper() != "NO"
    return False


def _launcher_command_line() -> list[str]:
    """The command line of the `accelerate launch` that started this process (its parent: on one node torchrun
    runs inside accelerate launch), or [] when the parent is something else or cannot be read."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parts = [p.decode(errors="replace") for p in f.read().split(b"\0") if p]
    except OSError:
        return []
    return parts if any(p.endswith(("accelerate", "accelerate.commands.launch")) for p in parts) else []


def compile_blocks(model, block_classes, settings: dict) -> str:
    """Compile every module of `model` whose class is in `block_classes` (the decoder blocks:
    `zero_utils.model.wrapping.find_block_classes`), in place, with `settings` (`compile_settings`). Nothing is compiled
    yet: each block compiles on its first call. Returns the start-up line saying what was compiled."""
    blocks = [m for m in model.modules() if isinstance(m, tuple(block_classes))]
    for block in blocks:
        block.compile(**settings)
    names = ", ".join(sorted(cls.__name__ for cls in block_classes))
    mode = f", mode {settings['mode']}" if settings.get("mode", "default") != "default" else ""
    return (f"compile: {len(blocks)} {names} blocks compiled in place with {settings['backend']}{mode} (accelerate's "
            "regional compilation; parameter names unchanged); the embedding, final norm, output head and chunked "
            "loss run eagerly. The first step includes the compile time (first_step_extra_s in summary.json).")
