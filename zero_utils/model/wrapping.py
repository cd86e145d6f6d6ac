"""FSDP2 layer wrapping for any Hugging Face decoder: `fully_shard` each decoder block, then the root.

The model is never edited for parallelism (torchtitan's rule): sharding is applied from outside, in a fixed order
like torchtitan's `apply_fsdp`:
    1. the input embedding (its own group, unless tied to the output head);
    2. each decoder block, one FSDP unit per block; the last block is not resharded after forward, because
       backward needs it at once;
    3. the final norm and the output head (plus a tied embedding) as one group, not resharded after forward;
    4. the root, which picks up whatever is left.
The three choices that differ between codebases are `shard_model` arguments (`reshard_last_block`,
`embedding_group`, `prefetch_blocks`). The defaults keep the last block gathered after forward (backward would
gather it again at once: one all-gather saved for one block's parameters held; torchtitan did the same until its
PR #1094, July 2025, which reshards every block), give an untied embedding its own unit and leave prefetching to
FSDP2's implicit one. Their memory effect is measured by
tests/scripts/unsharded_after_forward.py. A tied embedding/output weight is always kept in one group: FSDP2
cannot shard one parameter in two groups.
Accelerate's FSDP2 `prepare` leaves a model that is already an `FSDPModule` untouched, so calling
`shard_model` before `accelerator.prepare` makes these choices the ones that run. After it, what FSDP2 does with the
wrapped model: free what inference left gathered (`reshard_after_inference`), all-reduce across HSDP replicas once
per step (`all_reduce_replicas_on_last_micro_batch`), and the gradients it holds between micro-batches
(`fsdp2_held_gradients`). Engines: FSDP2 only.
"""

from __future__ import annotations

import torch
from torch import nn

from zero_utils.run.errors import UserError


def find_block_classes(model: nn.Module, override: str | None = None) -> set[type]:
    """Return the decoder-block class(es) of a transformers causal LM (also through a PEFT wrapper).

    Uses the model's `_no_split_modules` (what transformers itself never splits across devices), keeping the
    classes that occur inside a `nn.ModuleList` (the stack of blocks). `override` (comma-separated class names,
    from the YAML's `fsdp_transformer_layer_cls_to_wrap`) wins; a name that matches nothing is a `UserError`
    listing the candidates.
    """
    present = {type(m).__name__: type(m) for m in model.modules()}
    if override:
        names = [n.strip() for n in override.split(",") if n.strip()]
        missing = [n for n in names if n not in present]
        if missing:
            in_lists = sorted({type(m).__name__ for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml})
            raise UserError(f"fsdp_transformer_layer_cls_to_wrap names {missing}, which the model does not contain; "
                            f"candidates: {in_lists}.")
        return {present[n] for n in names}
    no_split = set()
    for module in model.modules():
        no_split |= set(getattr(module, "_no_split_modules", None) or [])
    in_module_lists = {type(m) for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml}
    blocks = {cls for cls in in_module_lists if cls.__name__ in no_split}
    if not blocks:  # no `_no_split_modules`: a class repeated inside a ModuleList is the block stack
        blocks = {cls for cls in in_module_lists if sum(1 for m in model.modules() if type(m) is cls) > 1}
    if not blocks:
        raise UserError(f"could not find the decoder blocks of {type(model).__name__}; set "
                        "fsdp_transformer_layer_cls_to_wrap in the accelerate YAML to the block class name.")
    return blocks


def shard_model(model: nn.Module, accelerator, block_override: str | None = None, *,
                reshard_last_block: bool = False, embedding_group: bool = True, prefetch_blocks: int = 1) -> nn.Module:
    """Apply FSDP2 `fully_shard` block by block, then to the root, with the accelerate YAML's settings.

    Reads from `accelerator.state.fsdp_plugin`: reshard_after_forward (True = ZeRO-3, False = ZeRO-2 behaviour),
    the mixed-precision param dtype (gradients are reduced in fp32, torchtitan's default), the CPU offload policy
    and activation checkpointing (each block recomputed in backward). Parameters become DTensors sharded on dim 0
    over all ranks (each rank holds ~1/world of each), or, with HSDP (parallelism_config dp_replicate_size > 1),
    over the ranks of one shard group and replicated across groups.

    Wrapping choices (defaults: see the module docstring), all only under reshard_after_forward=True:
        reshard_last_block  also reshard the last block after forward (it is gathered again at once for backward:
                            one block's parameters less held between forward and backward, one all-gather more)
        embedding_group     an untied input embedding is its own unit, resharded after forward; False leaves it
                            to the root group, gathered for the whole step
        prefetch_blocks     1: FSDP2's implicit prefetching; k > 1: each block's forward and backward explicitly
                            start the all-gathers of the next k blocks (overlap on a GPU, up to k more blocks
                            gathered at once)
    A model whose parameters are on the meta device on some ranks (`loading.load_causal_lm` under
    `fsdp_cpu_ram_efficient_loading`) is materialised here and filled from rank 0's weights, one tensor at a time.
    Returns the same module (now an `FSDPModule`). Engines: FSDP2.
    """
    if prefetch_blocks < 1:
        raise UserError(f"prefetch_blocks is {prefetch_blocks}; it must be at least 1 (1 = FSDP2's implicit "
                        "prefetching).")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    plugin = accelerator.state.fsdp_plugin
    override = block_override or _plugin_layer_override(plugin)
    block_classes = tuple(find_block_classes(model, override))
    # Resolve accelerate's wrap policy to our classes now: after `fully_shard` the classes are renamed
    # (FSDPLlamaDecoderLayer) and accelerate's own lookup in `prepare` would no longer find them.
    plugin.transformer_cls_names_to_wrap = [cls.__name__ for cls in block_classes]
    plugin.set_auto_wrap_policy(model)
    mesh = _fsdp_mesh(accelerator, init_device_mesh)
    policy = plugin.mixed_precision_policy
    param_dtype = getattr(policy, "param_dtype", None)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    common = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": plugin.cpu_offload}
    reshard = bool(plugin.reshard_after_forward)

    if plugin.activation_checkpointing:
        # The YAML's fsdp_activation_checkpointing, applied as the recipes' --gradient_checkpointing does
        # (transformers' per-block recompute, parameter names unchanged). Accelerate's `prepare` would wrap the
        # blocks again with checkpoint_wrapper (renaming every parameter) and fails to find them once sharded, so
        # it is told the job is done.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        plugin.activation_checkpointing = False

    # Rank 0 keeps references to its full weights, taken before sharding replaces them.
    from_rank0 = _loads_from_rank0(model, accelerator)
    full_state = model.state_dict() if from_rank0 and accelerator.is_main_process else None

    if param_dtype is not None:
        # FSDP2 groups need one dtype per group; keep fp32 master weights and let the policy cast for compute.
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()

    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = embed is not None and head is not None and embed.weight is head.weight
    if embed is not None and not tied and embedding_group:
        fully_shard(embed, reshard_after_forward=reshard, **common)
    blocks = [m for m in model.modules() if isinstance(m, block_classes)]
    for i, block in enumerate(blocks):
        fully_shard(block, reshard_after_forward=reshard and (reshard_last_block or i < len(blocks) - 1), **common)
    tail = [m for m in (_final_norm(model, blocks), head, embed if tied else None) if m is not None]
    if tail:
        fully_shard(tail, reshard_after_forward=False, **common)
    fully_shard(model, reshard_after_forward=False, **common)
    if prefetch_blocks > 1:
        # torch FSDP2 docs (`set_modules_to_forward_prefetch`): explicit prefetching replaces the implicit one.
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + prefetch_blocks])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch_blocks):i][::-1])
    if from_rank0:
        _fill_from_rank0(model, full_state, offloaded=isinstance(plugin.cpu_offload, CPUOffloadPolicy),
                         device=accelerator.device)
    return model


def shard_frozen_model(model: nn.Module, accelerator, dtype: torch.dtype) -> nn.Module:
    """FSDP2 for a frozen model that only runs forwards (a preference loss's reference): the same units as
    `shard_model` (the input embedding, each block, the final norm with the head, the root), every one resharded
    after its forward whatever the YAML says (no backward will free it), so at most the unit being computed and the
    one FSDP2 prefetches are gathered at once, never the model. Parameters are stored in `dtype` (the compute dtype:
    no fp32 master, no gradients), sharded over the same mesh and offloaded as the YAML offloads the policy; weights
    on the meta device off rank 0 are filled from rank 0's as in `shard_model`. Engines: FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    plugin = accelerator.state.fsdp_plugin
    block_classes = tuple(find_block_classes(model, _plugin_layer_override(plugin)))
    common = {"mesh": _fsdp_mesh(accelerator, init_device_mesh), "offload_policy": plugin.cpu_offload,
              "reshard_after_forward": True}
    from_rank0 = _loads_from_rank0(model, accelerator)
    model.requires_grad_(False)
    model.to(dtype)  # on the meta device off rank 0 too: the shards are allocated in `dtype`
    full_state = model.state_dict() if from_rank0 and accelerator.is_main_process else None
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and embed.weight is head.weight
    if not tied:
        fully_shard(embed, **common)
    blocks = [m for m in model.modules() if isinstance(m, block_classes)]
    for block in blocks:
        fully_shard(block, **common)
    tail = [m for m in (_final_norm(model, blocks), head, embed if tied else None) if m is not None]
    if tail:
        fully_shard(tail, **common)
    fully_shard(model, **common)
    if from_rank0:
        _fill_from_rank0(model, full_state, offloaded=isinstance(plugin.cpu_offload, CPUOffloadPolicy),
                         device=accelerator.device)
    return model


def _loads_from_rank0(model: nn.Module, accelerator) -> bool:
    """True when some rank holds its parameters on the meta device (rank-0 loading): every rank must agree, since
    the broadcast that follows is collective."""
    import torch.distributed as dist

    on_meta = any(p.is_meta for p in model.parameters())
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    flag = torch.tensor([int(on_meta)], device=accelerator.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if on_meta and accelerator.is_main_process:
        raise UserError("rank 0 has no weights to broadcast (its parameters are on the meta device); load the "
                        "model with zero_utils.model.loading.load_causal_lm, which reads it on rank 0.")
    return bool(flag.item())


def _fill_from_rank0(model: nn.Module, full_state: dict | None, offloaded: bool, device: torch.device) -> None:
    """Allocate this rank's shards (they are on meta off rank 0) and broadcast rank 0's weights into them, one
    tensor at a time (`set_model_state_dict(broadcast_from_rank0=True)`): no rank but 0 ever holds the model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # `to_empty` replaces buffers too; they are real on every rank (init_empty_weights keeps them) and the
    # non-persistent ones (rotary frequencies) are in no state dict, so keep them across it.
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    model.to_empty(device="cpu" if offloaded else device)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
    set_model_state_dict(model, full_state or {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _fsdp_mesh(accelerator, init_device_mesh):
    """The mesh FSDP2 shards over: accelerate's (1-D over all ranks, or 2-D (dp_replicate, dp_shard) for HSDP when
    the YAML's parallelism_config asks for replication: shard within a node, replicate across nodes)."""
    config = getattr(accelerator, "parallelism_config", None)
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if config is not None and mesh is not None and config.fsdp_dim_names:
        return mesh[tuple(config.fsdp_dim_names)]
    return init_device_mesh(accelerator.device.type, (accelerator.num_processes,))


def _plugin_layer_override(plugin) -> str | None:
    cls = getattr(plugin, "transformer_cls_names_to_wrap", None)
    if isinstance(cls, (list, tuple)):
        return ",".join(cls) or None
    return cls or None


def _final_norm(model: nn.Module, blocks: list[nn.Module]) -> nn.Module | None:
    """The norm applied after the last block: the last norm-like module that is not inside a block."""
    inside = {id(m) for b in blocks for m in b.modules()}
    norms = [m for m in model.modules() if id(m) not in inside and "norm" in type(m).__name__.lower()]
    return norms[-1] if norms else None


def _fsdp_root(model: nn.Module) -> nn.Module | None:
    """The outermost FSDP module of `model` (the root `fully_shard` was applied to last), or None."""
    from torch.distributed.fsdp import FSDPModule

    return next((module for module in model.modules() if isinstance(module, FSDPModule)), None)


def all_reduce_replicas_on_last_micro_batch(model: nn.Module, accelerator) -> None:
    """[FSDP2 HSDP] Before each forward of the prepared `model`, tell FSDP2 whether this micro-batch's backward
    all-reduces gradients across replicas: only on a step's last micro-batch (`accelerator.sync_gradients`, set by
    `accelerator.accumulate`). The others reduce-scatter within the shard group and FSDP2 sums the shards
    (`set_requires_all_reduce(False)`: its `_partial_reduce_output`, 1/shard-group of the gradients), so a step makes
    one all-reduce across nodes instead of one per micro-batch, for the same gradients. A no-op for models that are
    not FSDP2 modules. Every rank must call it, once, after `accelerator.prepare`."""
    root = _fsdp_root(model)
    if root is not None:
        root.register_forward_pre_hook(lambda module, _args: module.set_requires_all_reduce(accelerator.sync_gradients))


def fsdp2_held_gradients(module: nn.Module) -> list[torch.Tensor]:
    """[FSDP2] The gradients FSDP2 holds outside the sharded parameters' `.grad` between the micro-batches of a
    step: each parameter's whole, unsharded gradient, kept on every rank while gradient sync is off
    (`set_requires_gradient_sync(False)`: the unsharded parameter's `.grad` when it is already in the reduce dtype,
    as in fp32, else its `unsharded_accumulated_grad` upcast to it), and each group's `_partial_reduce_output` (HSDP:
    the reduce-scattered shard summed over micro-batches while the all-reduce across replicas waits,
    `set_requires_all_reduce(False)`). Private torch attributes (2.13's groups, or the one group per module of
    older torch), read only. Empty for other engines, and between steps."""
    from torch.distributed.fsdp import FSDPModule

    held, groups = [], {}
    for sub in module.modules():
        if isinstance(sub, FSDPModule):  # modules sharded together ([norm, head]) share one state and its groups
            state = sub._get_fsdp_state()
            if hasattr(state, "_fsdp_param_groups"):  # torch >= 2.13: a list
                groups.update((id(group), group) for group in state._fsdp_param_groups)
            elif state._fsdp_param_group is not None:  # older torch (the GPU image's 2.11): one group or None
                groups[id(state._fsdp_param_group)] = state._fsdp_param_group
    for group in groups.values():
        held.append(group._partial_reduce_output)
        for fsdp_param in group.fsdp_params:
            held.append(fsdp_param.unsharded_accumulated_grad)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)  # exists once first gathered
            held.append(unsharded.grad if unsharded is not None else None)
    return [t for t in held if t is not None]


def reshard_after_inference(model: nn.Module) -> None:
    """Free the full parameters FSDP2 still holds after a forward that had no backward (eval, generation), and forget
    that forward's order.

    Groups built with `reshard_after_forward=False` (the last block, the output head, the root) keep their
    gathered parameters until backward; after inference there is no backward, so they would stay unsharded and
    cost memory until the next training step. FSDP2 also records every forward's group order for backward
    prefetching and clears it only at the end of a backward: after an inference forward the next backward reads the
    stale order and all-gathers the output-head group a second time, after its own backward. The root's
    `reset_iter_state()` (torch >= 2.13) reshards every group and clears that order; on older torch (the GPU
    machine's image has 2.11) every FSDP module is resharded (`reshard_every_group`), and the stale order costs that
    one extra all-gather. A no-op for models that are not FSDP2 modules.
    """
    root = _fsdp_root(model)
    if root is None:
        return
    if hasattr(root, "reset_iter_state"):  # torch >= 2.13
        root.reset_iter_state()
    else:
        reshard_every_group(model)


def reshard_every_group(model: nn.Module) -> None:
    """[FSDP2, torch < 2.13] `reshard()` every FSDP module of `model`: what `reset_iter_state` does to the
    parameters, without clearing FSDP2's recorded forward order (a public-API fallback)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
