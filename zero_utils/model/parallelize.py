"""Parallelism applied to a model from outside it, in one visible place (torchtitan's `parallelize` is the model):

    parallelize(model, accelerator, engine, activation_checkpointing=..., fsdp=FSDPWrapping(...))   # before prepare
    optimizer = ...
    model, optimizer = accelerator.prepare(model, optimizer)                                          # the engine wraps
    after_prepare(model, accelerator, engine, model_name)                                            # what must follow

Every engine-specific step of a recipe is here, so the recipe itself is the same under every engine:
- activation checkpointing (every engine: each block recomputed in backward), set before any engine wraps the blocks,
  and with it, on request, activation offloading (`zero_utils.model.activation_offload`: the blocks' inputs in host
  memory);
- compile, when the accelerate launch asks for it (`--dynamo_backend inductor --dynamo_use_regional_compilation`):
  each decoder block in place (`zero_utils.run.compiling`), after checkpointing and before sharding, as torchtitan does;
- [FSDP2] `fully_shard` block by block, then the root (`zero_utils.model.wrapping.shard_model`), before the optimizer
sees
  the parameters; a warning when a --fsdp_* wrapping choice was given to another engine, which ignores it;
- [DeepSpeed] communication bucket sizes from the model's hidden size (`zero_utils.model.deepspeed_setup`);
- after prepare, [DeepSpeed, 16-bit] the fp32 master weights set from the checkpoint's own fp32 weights; [HSDP] the
  all-reduce across replicas on a step's last micro-batch only.
Engines: all.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from zero_utils.model import activation_offload, deepspeed_setup, wrapping
from zero_utils.run import compiling
from zero_utils.run.engine import Engine


@dataclass(frozen=True)
class FSDPWrapping:
    """FSDP2's wrapping choices (`wrapping.shard_model`); the defaults are the recipes' flag defaults."""

    reshard_last_block: bool = False  # the last block stays gathered for backward: one all-gather saved
    embedding_group: bool = True  # the input embedding is its own unit, resharded after forward
    prefetch_blocks: int = 1  # FSDP2's implicit prefetching


def parallelize(model, accelerator, engine: Engine, *, activation_checkpointing: bool,
                activation_offloading: bool = False, fsdp: FSDPWrapping = FSDPWrapping()):
    """Prepare `model` (in place) for the engine, before the optimizer is built and before `accelerator.prepare`:
    activation checkpointing, compiled blocks (when the launch compiles), then [FSDP2] block-by-block sharding with
    the `fsdp` choices, or [DeepSpeed] the bucket sizes. Under an engine that is not FSDP2, `fsdp` choices other
    than the defaults are named in a warning (they have no effect there). Every rank must call it.
    Returns, with `activation_offloading` (which needs `activation_checkpointing`), the
    `activation_offload.ActivationOffload` a micro-batch's forward runs under (`RunMeasurements.micro_batch`);
    else None."""
    if activation_checkpointing:  # before sharding, so every engine wraps the checkpointed blocks
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    settings = compiling.compile_settings()  # accelerate launch --dynamo_backend ... --dynamo_use_regional_compilation
    if settings:  # each decoder block compiled in place, before any engine wraps it: parameter names unchanged
        accelerator.print(compiling.compile_blocks(model, wrapping.find_block_classes(model), settings))
    if engine.is_fsdp2:  # [FSDP2] shard block by block, then the root
        wrapping.shard_model(model, accelerator, reshard_last_block=fsdp.reshard_last_block,
                             embedding_group=fsdp.embedding_group, prefetch_blocks=fsdp.prefetch_blocks)
    elif fsdp != FSDPWrapping():
        changed = [f"--fsdp_{f.name}" for f in fields(fsdp) if getattr(fsdp, f.name) != f.default]
        accelerator.print(f"warning: {', '.join(changed)} only change FSDP2's wrapping: no effect under {engine}.")
    if engine.is_deepspeed:  # [DeepSpeed] communication buckets sized from the model's hidden size
        deepspeed_setup.size_deepspeed_buckets(accelerator, model)
    if not activation_offloading:
        return None
    offload = activation_offload.ActivationOffload(accelerator.device)  # the checkpointed inputs in host memory
    accelerator.print(offload.describe())
    return offload


def after_prepare(model, accelerator, engine: Engine, model_name: str | None, revision: str | None = None) -> None:
    """What must follow `accelerator.prepare`: [DeepSpeed, bf16/fp16] set the fp32 master weights from the
    checkpoint's own fp32 weights (`deepspeed_setup.restore_fp32_master_weights`; DeepSpeed builds them from the 16-bit
    cast; renamed and fused parameters through transformers' conversion), and name in one warning any trainable
    parameter still not found (`model_name` None: no restore, the trainable parameters are new, as LoRA's adapters);
    [FSDP2 HSDP] all-reduce gradients across replicas on a step's last micro-batch only
    (`wrapping.all_reduce_replicas_on_last_micro_batch`). Nothing to do under the other engines. Every rank must call
    it."""
    if engine.hsdp:  # [HSDP] reduce-scatter in the shard group every micro-batch, all-reduce across replicas once
        wrapping.all_reduce_replicas_on_last_micro_batch(model, accelerator)
    if model_name is not None and engine.is_deepspeed and accelerator.mixed_precision != "no":
        _, unmatched = deepspeed_setup.restore_fp32_master_weights(model, model_name, revision)
        if unmatched:  # said, never skipped silently
            shown = ", ".join(unmatched[:4]) + (", ..." if len(unmatched) > 4 else "")
            accelerator.print(f"warning: {len(unmatched)} trainable parameters of {model_name!r} were found neither "
                              f"by name nor through transformers' conversion ({shown}); their fp32 master starts "
                              "from the 16-bit weights.")

