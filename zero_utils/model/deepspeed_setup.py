"""DeepSpeed's own steps around accelerate, one per moment of a run (the recipe reaches them through
zero_utils.model.parallelize and zero_utils.model.loading):

- building the model: `zero3_init_disabled` builds it whole even under a ZeRO-3 launch (random init);
- before `accelerator.prepare`: `size_deepspeed_buckets` writes the communication bucket sizes
  (`formulas.model_states.deepspeed_bucket_elements`) into DeepSpeed's config;
- after `accelerator.prepare`: `restore_fp32_master_weights` sets the fp32 master from the checkpoint's fp32 weights.
Engines: DeepSpeed ZeRO-1/2/3 (each is a no-op under the others).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from zero_utils.formulas.model_states import deepspeed_bucket_elements


@contextlib.contextmanager
def zero3_init_disabled(accelerator):
    """Context: build a model whole even under a ZeRO-3 launch: transformers wraps construction in `deepspeed.zero.Init`
    whenever accelerate's DeepSpeed config is registered with it (accelerate 1.15's own
    `zero3_init_context_manager(enable=False)` re-registers the same config, so it does not switch it off)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    registered = getattr(plugin, "dschf", None)
    if registered is None:
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(registered)


def size_deepspeed_buckets(accelerator, model, config: dict | None = None) -> dict[str, int]:
    """DeepSpeed ZeRO-1/2/3: write `deepspeed_bucket_elements` for `model` into the DeepSpeed config (or into
    `config`, a copy of it for an engine of its own), in place of the "auto" values `build_accelerator` left there;
    call it before `accelerator.prepare`. A size the user's own DeepSpeed config file sets is kept. Returns what it
    wrote (empty under other engines, or when the model config has no hidden size: accelerate then resolves "auto"
    or names the missing size itself)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    model_config = getattr(model, "config", None)
    hidden_sizes = getattr(model_config, "hidden_sizes", None)  # same lookup as accelerate's "auto"
    hidden_size = max(hidden_sizes) if hidden_sizes else getattr(model_config, "hidden_size", None)
    if plugin is None or not hidden_size:
        return {}
    zero_config = (config or plugin.deepspeed_config)["zero_optimization"]
    written = {key: value for key, value in deepspeed_bucket_elements(hidden_size).items()
               if zero_config.get(key) == "auto"}
    zero_config.update(written)
    return written


def restore_fp32_master_weights(model, name_or_path: str, revision: str | None = None) -> tuple[int, list[str]]:
    """[DeepSpeed, bf16/fp16] Set the fp32 master copy of every trainable parameter from the checkpoint's own fp32
    weights; call it right after `accelerator.prepare`.

    DeepSpeed builds its fp32 master from the 16-bit weights it casts the model to (ZeRO-3 with `zero.Init`
    already at load time), so an fp32 checkpoint would start training from bf16-rounded weights while FSDP2 and
    DDP start from the exact ones. The safetensors files are read one tensor at a time; a ZeRO-3 rank copies its
    own partition (`deepspeed.utils.safe_set_local_fp32_param`, padded like DeepSpeed's partition), a ZeRO-1/2 rank
    its fragment (`safe_set_full_fp32_param`). Tensors stored in 16 bits are skipped: their master is exact.
    Parameters transformers renames or builds on load (Mixtral's router and fused experts) are rebuilt through its
    own conversion (`converted_tensors`). Returns (how many parameters were set, the trainable parameters still not
    found: named by the caller in one warning); (0, []) for a config-only folder. Engines: DeepSpeed ZeRO-1/2/3.
    """
    import torch.distributed as dist
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_local_fp32_param
    from safetensors import safe_open

    files = _safetensors_files(name_or_path, revision)
    module = getattr(model, "module", model)
    params = dict(module.named_parameters())

    def set_master(param, value):
        if hasattr(param, "ds_id"):  # [ZeRO-3] this rank's partition of the flattened tensor, zero-padded
            size = param.ds_tensor.numel()
            start = size * dist.get_rank(group=param.ds_process_group)
            local = torch.zeros(size, dtype=torch.float32)
            piece = value.flatten()[start:start + size]
            local[:piece.numel()] = piece
            safe_set_local_fp32_param(param, local)
        else:  # [ZeRO-1/2] the fragment of the flat fp32 partition this rank holds, if any
            safe_set_full_fp32_param(param, value)

    restored = 0
    for path, keys in files.items():
        with safe_open(str(path), framework="pt") as f:
            for name, param in params.items():
                if name not in keys or not param.requires_grad or f.get_slice(name).get_dtype() != "F32":
                    continue
                set_master(param, f.get_tensor(name))
                restored += 1
    unmatched = unmatched_trainable(module, set().union(*files.values()))
    for name, value in converted_tensors(module, files, set(unmatched)):  # renamed or fused on load
        set_master(params[name], value)
        unmatched.remove(name)
        restored += 1
    return restored, unmatched


def converted_tensors(module, files: dict, wanted: set[str]):
    """Yield (parameter name, fp32 tensor) for the parameters in `wanted` that transformers builds on load from
    checkpoint tensors of other names: its own conversion mapping for the model's family
    (`transformers.conversion_mapping.get_model_conversion_mapping`: renamings, and converters such as Mixtral's
    stacking of per-expert w1/w3 into `experts.gate_up_proj`), applied to the tensors read one target at a time from
    `files` ({safetensors path: its keys}, as `_safetensors_files` returns them). Engines: any (CPU only)."""
    from copy import deepcopy

    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    mapping = get_model_conversion_mapping(module)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    names = {name: True for name, _ in module.named_parameters()}
    sources: dict[str, list] = {}  # target parameter -> [(converter source pattern or None, key, file)]
    for path, keys in files.items():
        for key in keys:
            target, pattern = rename_source_key(key, renamings, converters, module.base_model_prefix, names)
            if target in wanted:
                sources.setdefault(target, []).append((pattern, key, path))

    def read(path, key):
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key).to(torch.float32)

    for target, found in sources.items():
        found.sort(key=lambda item: dot_natural_key(item[1]))  # expert 0, 1, ... as transformers stacks them
        if found[0][0] is None:  # renamed only
            yield target, read(found[0][2], found[0][1])
            continue
        converter = deepcopy(by_pattern[found[0][0]])
        for pattern, key, path in found:
            converter.add_tensor(target, key, pattern, lambda path=path, key=key: read(path, key))
        yield target, converter.convert(target, model=module, config=module.config)[target]


def unmatched_trainable(module, checkpoint_keys: set[str]) -> list[str]:
    """Trainable parameters of `module` whose names are not keys of the checkpoint (none for a config-only folder):
    transformers 5 renames and converts some families' weights on load (Mixtral's `block_sparse_moe.gate` becomes
    `mlp.gate`, its per-expert `w1/w2/w3` the fused `experts.gate_up_proj` / `down_proj`), so their fp32 master
    cannot be read by name and stays the 16-bit cast."""
    if not checkpoint_keys:
        return []
    return [name for name, param in module.named_parameters() if param.requires_grad and name not in checkpoint_keys]


def _safetensors_files(name_or_path: str, revision: str | None = None) -> dict:
    """{path of a safetensors file: set of tensor names in it} of a local folder or a cached Hub model (at
    `revision`); {} when there are no weights (a config-only folder)."""
    import json

    from transformers.utils import cached_file

    def find(filename):
        local = Path(name_or_path).expanduser() / filename
        if local.exists():
            return local
        if Path(name_or_path).expanduser().exists():
            return None
        found = cached_file(name_or_path, filename, revision=revision or None,
                            _raise_exceptions_for_missing_entries=False)
        return Path(found) if found else None

    index = find("model.safetensors.index.json")
    if index is not None:
        files: dict = {}
        for key, filename in json.loads(index.read_text())["weight_map"].items():
            files.setdefault(index.parent / filename, set()).add(key)
        return files
    single = find("model.safetensors")
    if single is None:
        return {}
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {single: set(f.keys())}
