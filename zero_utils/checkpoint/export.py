"""A checkpoint as a Hugging Face model folder, on CPU, without a process group, from any engine's checkpoint.

Export: `python -m zero_utils.checkpoint export <checkpoint> <out_dir> [--dtype bf16] [--max_shard_size 5GB]`
turns any complete checkpoint into a Hugging Face folder on CPU, without a process group, streaming tensors
shard by shard instead of materialising the model.
Tensors come from the storage that wrote the checkpoint (zero_utils.checkpoint.storage: DCP's no-dist reader, or
DeepSpeed's `zero_to_fp32`), one safetensors shard at a time. The command's entry point is the folder's
__main__ (zero_utils/checkpoint/__main__.py).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch

from zero_utils.checkpoint.storage import read_metadata, storage_of
from zero_utils.run.errors import UserError


def export(checkpoint: str | Path, out_dir: str | Path, dtype: str = "fp32", max_shard_bytes: int = 5 * 10**9) -> Path:
    """Turn a complete checkpoint of any engine into a Hugging Face folder, on CPU, with no process group.

    Tensors are read and written one safetensors shard at a time (at most `max_shard_bytes` of weights in memory,
    plus DeepSpeed's fp32 partitions for ZeRO checkpoints, which its reader loads per rank file); an index file is
    written when there is more than one shard. Tied weights are written once, as transformers expects.
    """
    from safetensors.torch import save_file

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    meta = read_metadata(checkpoint)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint / "hf")
    keys, read = storage_of(meta).weights(checkpoint)
    if getattr(config, "tie_word_embeddings", False):
        keys = [k for k in keys if k != "lm_head.weight"]
    out_dir.mkdir(parents=True, exist_ok=True)
    element_bytes = torch.tensor([], dtype=torch_dtype).element_size()
    sizes = {key: read.numel(key) * element_bytes for key in keys}
    shards, current, current_bytes = [], [], 0
    for key in keys:
        current.append(key)
        current_bytes += sizes[key]
        if current_bytes >= max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
    if current:
        shards.append(current)
    weight_map = {}
    for i, shard_keys in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: t.to(torch_dtype).contiguous() for k, t in read(shard_keys).items()}
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard_keys, name))
        del tensors
    if len(shards) > 1:
        total = sum(sizes.values())
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.dtype = dtype if dtype != "fp32" else "float32"
    config.save_pretrained(out_dir)
    for f in (checkpoint / "hf").iterdir():
        if f.name != "config.json":
            shutil.copy(f, out_dir / f.name)
    return out_dir


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([\d.]+)\s*(GB|MB|KB|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise UserError(f"--max_shard_size {text!r} is not a size; write e.g. 5GB or 500MB.")
    unit = {"gb": 10**9, "mb": 10**6, "kb": 10**3, "b": 1}[(match.group(2) or "b").lower()]
    return int(float(match.group(1)) * unit)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero_utils.checkpoint",
                                     description="Tools for zero-recipes training checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write a Hugging Face model folder from a checkpoint (CPU, no GPUs)")
    exp.add_argument("checkpoint", help="a checkpoints/step_<N> folder")
    exp.add_argument("out_dir", help="the Hugging Face folder to write")
    exp.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weights dtype (default fp32)")
    exp.add_argument("--max_shard_size", default="5GB", help="split safetensors above this size (default 5GB)")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out_dir, args.dtype, _parse_size(args.max_shard_size))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}")
    return 0
