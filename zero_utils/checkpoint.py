"""Sharded training checkpoints that are complete or absent, resume, and the final Hugging Face export.

Layout under `<output_dir>/checkpoints/`:
    step_<N>/                      accelerate `save_state`: model + optimizer shards (DCP for FSDP2, DeepSpeed's
                                   own files for ZeRO), RNG states of every rank
    step_<N>/zero_recipes.json     our metadata (step, engine, world size, ...); written last
A checkpoint is written under `.tmp_step_<N>` and renamed once every rank has finished, so a crash while saving
leaves the previous checkpoints untouched and never a half-written `step_<N>`. The data position needs no state:
the data order is a pure function of (seed, step), see `zero_utils.data.global_batch_indices`.

Checkpoints hold pickles whatever the engine (DeepSpeed `.pt`, DCP metadata, RNG `.pkl`): resume only from
checkpoints you made. Engines: all.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from zero_utils.errors import UserError

META_FILE = "zero_recipes.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def list_complete(output_dir: str) -> list[tuple[int, Path]]:
    """Complete checkpoints in `output_dir/checkpoints`, oldest first, as (step, path)."""
    root = Path(output_dir) / "checkpoints"
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / META_FILE).is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def resolve_resume(output_dir: str, resume: str, overwrite: bool) -> Path | None:
    """The checkpoint to resume from ('auto' = newest complete one, or None if there is none; a path must be one
    of ours), or None for a fresh run. A fresh run into an output_dir that holds checkpoints needs `--overwrite`,
    so one run never silently replaces another's work."""
    existing = list_complete(output_dir)
    if resume == "auto":
        return existing[-1][1] if existing else None
    if resume:
        path = Path(resume)
        if not (path / META_FILE).is_file():
            raise UserError(f"--resume {resume!r} is not a complete zero-recipes checkpoint (no {META_FILE}); "
                            "pass a checkpoints/step_<N> folder or --resume auto.")
        return path
    if existing and not overwrite:
        raise UserError(f"--output_dir {output_dir!r} already holds checkpoints (newest: {existing[-1][1].name}); "
                        "pass --resume auto to continue that run, or --overwrite to start a new one there.")
    return None


def save(accelerator, output_dir: str, step: int, meta: dict, keep_last: int) -> Path:
    """Save the full training state as `checkpoints/step_<step>` (all ranks must call). Returns its path."""
    root = Path(output_dir) / "checkpoints"
    tmp, final = root / f".tmp_step_{step}", root / f"step_{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / META_FILE).write_text(json.dumps({"step": step, **meta}, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for _, old in list_complete(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load(accelerator, path: Path) -> dict:
    """Restore model, optimizer and RNG states from a checkpoint (all ranks must call); returns its metadata."""
    meta = json.loads((Path(path) / META_FILE).read_text())
    accelerator.load_state(str(path))
    return meta


def export_final(accelerator, model, tokenizer, out_dir: str) -> None:
    """Write a Hugging Face model folder (config, safetensors, tokenizer) that `from_pretrained` loads.

    All ranks must call: the full state dict is gathered from the shards onto the main process (FSDP2 via
    DCP's full state dict, DeepSpeed ZeRO-3 via its 16-bit gather, `zero3_save_16bit_model: true`).
    """
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(out_dir, state_dict=state_dict, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(out_dir)
    accelerator.wait_for_everyone()
