"""Sharded training checkpoints that never lose work, and the policy that decides when they are written.

`Checkpointer` owns a run's checkpoint policy: the resume decision, the metadata written and checked, the cadence,
background saves and their completion, keep-last pruning, the save on a stop signal. Below it: save, resume (also
on another world size) and export.

Layout of one checkpoint, `<output_dir>/checkpoints/step_<N>/`:
    model_optim/            DDP, FSDP2, single process: torch.distributed.checkpoint (DCP), each rank writing its
                            own shards (FSDP2) or its share of the replicated tensors (DDP); DCP reshards on load,
                            so a checkpoint from N ranks resumes on M
    deepspeed/              DeepSpeed ZeRO-1/2/3: the engine's own checkpoint (its `zero_to_fp32` and
                            `ds_to_universal` read it), saved with `universal_checkpoint_info`
    universal/              made on demand from deepspeed/ when DeepSpeed resumes on another world size
    rng/rank_<r>.safetensors  every rank's torch RNG state (python/numpy states in the file's metadata)
    hf/                     config.json and tokenizer: what `export` needs besides the weights
    zero_recipes.json       our metadata, written last: step, engine, world size, global batch, examples seen,
                            model config hash, versions, W&B run id, the run's settings
A checkpoint is written under `.tmp_step_<N>` and renamed by the main process once every rank has finished, so
a crash while saving (even kill -9 of a rank) leaves the previous checkpoints untouched and never a half-written
`step_<N>`. The data position is the step: the data order is a pure function of (seed, step, global batch), see
`zero_utils.data.global_batch_indices`, and the learning rate a pure function of the step (`zero_utils.optim`).

What this module writes itself is JSON or safetensors. The engines' formats hold pickles (DCP's `.metadata`,
DeepSpeed's `.pt`): resume only from checkpoints you made. `--resume` refuses a folder without our metadata
before reading anything else in it.

Export: `python -m zero_utils.checkpoint export <checkpoint> <out_dir> [--dtype bf16] [--max_shard_size 5GB]`
turns any complete checkpoint into a Hugging Face folder on CPU, without a process group, streaming tensors
shard by shard instead of materialising the model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from zero_utils import distributed, stop_signals
from zero_utils.engine import Engine
from zero_utils.errors import UserError
from zero_utils.versions import software_versions

META_FILE = "zero_recipes.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
DCP_DIR, DEEPSPEED_DIR, UNIVERSAL_DIR, DEEPSPEED_TAG = "model_optim", "deepspeed", "universal", "state"


# ---------------------------------------------------------------------------------------------- finding
def list_complete(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `output_dir/checkpoints`, oldest first, as (step, path)."""
    root = Path(output_dir) / "checkpoints"
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / META_FILE).is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def newest_complete(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in `output_dir/checkpoints`, or None."""
    found = list_complete(output_dir)
    return found[-1][1] if found else None


def read_metadata(path: str | Path) -> dict:
    """Our metadata of a checkpoint folder; `UserError` if the folder is not a complete zero-recipes checkpoint."""
    meta_file = Path(path) / META_FILE
    if not meta_file.is_file():
        raise UserError(f"{str(path)!r} is not a complete zero-recipes checkpoint (no {META_FILE}); pass a "
                        "checkpoints/step_<N> folder written by these recipes, or --resume auto.")
    return json.loads(meta_file.read_text())


def resolve_resume(output_dir: str, resume: str, overwrite: bool) -> Path | None:
    """The checkpoint to resume from: 'auto' = the newest complete one in output_dir (None if there is none), or
    an explicit path (which must be one of ours). A fresh run into an output_dir that holds checkpoints needs
    `overwrite`, so one run never silently replaces another's work. Call it on every rank (reads only)."""
    existing = list_complete(output_dir)
    if resume == "auto":
        return existing[-1][1] if existing else None
    if resume:
        read_metadata(resume)
        return Path(resume)
    if existing and not overwrite:
        raise UserError(f"--output_dir {output_dir!r} already holds checkpoints (newest: {existing[-1][1].name}); "
                        "pass --resume auto to continue that run, or --overwrite to start a new one there.")
    return None


def model_config_hash(config) -> str:
    """A short hash of a transformers config's architecture (not of bookkeeping fields such as dtype)."""
    data = {k: v for k, v in config.to_dict().items()
            if k not in ("transformers_version", "dtype", "torch_dtype", "use_cache", "_name_or_path", "architectures")}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_compatible(meta: dict, *, storage: str, config_hash: str, global_batch_rows: int) -> list[str]:
    """Refuse a resume that cannot work with one sentence (`UserError`); return warnings for one that works but
    changes the run (another global batch changes the data stream)."""
    if meta.get("format") != FORMAT_VERSION:
        raise UserError(f"the checkpoint has format {meta.get('format')!r}, this code reads {FORMAT_VERSION}; "
                        "resume it with the version of zero-recipes that wrote it.")
    if meta["model_config_hash"] != config_hash:
        raise UserError("the checkpoint was trained on a model with another architecture (config hash "
                        f"{meta['model_config_hash']} vs {config_hash}); pass the same --model it was trained from.")
    if meta["storage"] != storage:
        kinds = {"dcp": "DDP/FSDP2", "deepspeed": "DeepSpeed"}
        raise UserError(f"the checkpoint was written by {meta['engine']} ({kinds[meta['storage']]}) and this launch "
                        f"runs {kinds[storage]}; resume with a {kinds[meta['storage']]} config, or export it "
                        "(python -m zero_utils.checkpoint export) and fine-tune from the export.")
    warnings = []
    if meta["global_batch_rows"] != global_batch_rows:
        warnings.append(f"the global batch changes from {meta['global_batch_rows']} to {global_batch_rows} rows: "
                        "training continues, but not on the data stream of the original run.")
    return warnings


def needs_universal(meta: dict, world_size: int) -> bool:
    """A DeepSpeed checkpoint resumed on another world size goes through DeepSpeed's universal checkpoint."""
    return meta["storage"] == "deepspeed" and meta["world_size"] != world_size


# ---------------------------------------------------------------------------------------------- policy
# Settings a resume may change without changing what is trained (where output goes, how often to save or log,
# how long to train): any other setting that differs from the checkpoint's is reported when the run resumes.
RUN_CONTROL_SETTINGS = ("resume", "overwrite", "max_steps", "output_dir", "report_to", "project", "group",
                        "save_every", "keep_last", "eval_every", "collective_timeout_s", "async_save", "prompt",
                        "max_new_tokens", "config")


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run continues: after `step`, in the tracker run `tracker_run_id` (None if it had none), from
    the checkpoint at `path`."""

    step: int
    tracker_run_id: str | None
    path: Path


class Checkpointer:
    """The checkpoint policy of one run, in one place (torchtitan's CheckpointManager is the model): where a run
    resumes from, the metadata written with every checkpoint and checked on resume, the cadence (every
    `save_every` steps and the last step), background saves and their completion, keep-last pruning, and the save
    after a stop signal (SIGTERM/SIGINT/SIGUSR1). Three verbs, and the export of what was trained:

        checkpointer = Checkpointer(accelerator, engine, output_dir, resume=..., save_every=..., settings=...)
        checkpointer.check(model_config, global_batch_rows)       # before the model is loaded: refuses a mismatch
        start_step = checkpointer.load(model, optimizer, hf_files=(config, tokenizer), tracker_run_id=...)
        for step in range(start_step + 1, max_steps + 1):
            ...
            if checkpointer.save(step, stop=result.stop):      # saves when due; True: a stop signal, saved, stop now
                break
        checkpointer.export(f"{output_dir}/final")              # the newest checkpoint as a Hugging Face folder

    `resumed` says where a resumed run continues (for the tracker), None for a fresh run. Construct it on every
    rank (reads only); every other method must be called by every rank at the same point. Background saves
    (`async_save`) need DCP storage (DDP, FSDP2); under DeepSpeed saves are synchronous.
    """

    def __init__(self, accelerator, engine: Engine, output_dir: str, *, resume: str, overwrite: bool,
                 save_every: int, keep_last: int, max_steps: int, async_save: bool, seed: int, settings: dict):
        self.accelerator, self.engine, self.output_dir = accelerator, engine, output_dir
        self.save_every, self.keep_last, self.max_steps, self.seed = save_every, keep_last, max_steps, seed
        self.use_async = async_save and engine.supports_async_save
        self.settings = settings
        self.resume_from = resolve_resume(output_dir, resume, overwrite)
        self.resume_meta = read_metadata(self.resume_from) if self.resume_from else None
        self.resumed = (Resumed(self.resume_meta["step"], self.resume_meta.get("tracker_run_id"), self.resume_from)
                        if self.resume_meta else None)
        self._tracker_run_id: str | None = None  # stored with every checkpoint: a resumed run continues it
        self._model = self._optimizer = None
        self._hf_files, self._global_batch_rows, self._config_hash = (), None, None
        self._pending: PendingSave | None = None
        self._start_step, self._saved = 0, False
        stop_signals.catch_stop_signals()  # a stop signal now means: finish the step, save, stop

    def check(self, model_config, global_batch_rows: int) -> None:
        """Refuse an incompatible checkpoint before any expensive work (`UserError`), print what a compatible one
        changes (global batch, settings), and [DeepSpeed] convert a checkpoint from another world size to a
        universal one. Call it before the model is loaded, also on a fresh run (it records the model's config hash
        and the global batch for the metadata)."""
        self._config_hash, self._global_batch_rows = model_config_hash(model_config), global_batch_rows
        if not self.resume_meta:
            return
        warnings = check_compatible(self.resume_meta, storage=self.engine.checkpoint_storage,
                                    config_hash=self._config_hash, global_batch_rows=global_batch_rows)
        warnings += changed_settings(self.resume_meta.get("settings", {}), self.settings)
        for warning in warnings:
            self.accelerator.print(f"warning: {warning}")
        if self.engine.is_deepspeed:
            prepare_deepspeed_resume(self.accelerator, self.resume_from, self.resume_meta)

    def load(self, model, optimizer, *, hf_files=(), tracker_run_id: str | None = None) -> int:
        """Remember what to save (`hf_files`: objects with `save_pretrained`, written to hf/; the tracker's run id,
        written to the metadata), restore the checkpoint being resumed if there is one, and return the step
        training continues after (0 if fresh). Call it after `accelerator.prepare`."""
        self._model, self._optimizer, self._hf_files = model, optimizer, hf_files
        self._tracker_run_id = tracker_run_id
        if self.resume_from:
            self._start_step = load(self.accelerator, model, optimizer, self.resume_from)["step"]
        return self._start_step

    def save(self, step: int, *, stop: bool) -> bool:
        """After optimizer step `step`: save if it is due (every `save_every` steps, and the last step). With `stop`
        (a stop signal reached any rank; every rank must pass the same value) save now, wait for the save to be
        complete, print how to continue, and return True: the loop should end, and the run with it."""
        if stop or step == self.max_steps or (self.save_every and step % self.save_every == 0):
            self._complete_pending(step)
            self._saved = True
            self._pending = save(self.accelerator, self._model, self._optimizer, self.output_dir, step,
                                 meta=self._metadata(step), keep_last=self.keep_last, hf_files=self._hf_files,
                                 use_async=self.use_async and not stop and step != self.max_steps)
        if stop or step == self.max_steps:
            self._complete_pending(step)
        if stop:
            name = stop_signals.received() or "a stop signal (on another rank)"
            self.accelerator.print(f"\n{name} received: stopped after step {step} with a complete checkpoint in "
                                   f"{self.output_dir}/checkpoints/step_{step}; continue with --resume auto.")
        return stop

    def latest(self) -> Path | None:
        """The checkpoint that holds the trained model: the newest this run saved, or the one it resumed from
        (a run resumed at its last step saves nothing)."""
        return self.newest() if self._saved else self.resume_from

    def newest(self) -> Path | None:
        """The newest complete checkpoint of this run's output folder (None before the first)."""
        return newest_complete(self.output_dir)

    def export(self, out_dir: str | Path) -> Path:
        """Write the newest complete checkpoint (the trained model) to `out_dir` as a Hugging Face folder: rank 0
        streams its shards into safetensors (no full gather anywhere) while the others wait outside any collective,
        so a long export is not cut off by the collective timeout. Returns that checkpoint. Every rank must call
        it."""
        self._complete_pending(self.max_steps)
        final = self.latest()
        distributed.run_on_main_process(self.accelerator, lambda: export(final, out_dir))
        return final

    def _metadata(self, step: int) -> dict:
        return {"engine": self.engine.name, "storage": self.engine.checkpoint_storage,
                "world_size": self.accelerator.num_processes, "global_batch_rows": self._global_batch_rows,
                "examples_seen": step * self._global_batch_rows, "seed": self.seed,
                "model_config_hash": self._config_hash, "tracker_run_id": self._tracker_run_id,
                "versions": software_versions(), "settings": self.settings}

    def _complete_pending(self, current_step: int) -> None:
        if self._pending:  # `save` returns None when the checkpoint is already complete (synchronous)
            self._pending.finish(current_step)
            self._pending = None


def changed_settings(saved: dict, current: dict) -> list[str]:
    """One warning naming the settings (other than RUN_CONTROL_SETTINGS) whose resolved value differs from the
    checkpoint's, e.g. "lr 0.003 -> 0.001"; [] when none does."""
    changed = [f"{key} {saved[key]!r} -> {current[key]!r}" for key in sorted(set(saved) & set(current))
               if key not in RUN_CONTROL_SETTINGS and saved[key] != current[key]]
    if not changed:
        return []
    return [f"the run resumes with settings that differ from the checkpoint's: {', '.join(changed)}."]


# ---------------------------------------------------------------------------------------------- saving
def save(accelerator, model, optimizer, output_dir: str, step: int, *, meta: dict, keep_last: int,
         hf_files=(), use_async: bool = False):
    """Save the full training state as `checkpoints/step_<step>` (every rank must call).

    `meta` is stored in our metadata (engine, world_size, global batch, settings, ...). `hf_files`: objects with
    `save_pretrained` (config, tokenizer) written to `hf/`. With `use_async` (FSDP2/DDP only) the shards are
    written by DCP's `async_save` in the background and the returned `PendingSave` finishes the checkpoint
    (rename, pruning) when `finish()` is called; otherwise the checkpoint is complete on return (None).
    """
    root = Path(output_dir) / "checkpoints"
    tmp, final = root / f".tmp_step_{step}", root / f"step_{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
        (tmp / "hf").mkdir()
        for obj in hf_files:
            obj.save_pretrained(tmp / "hf")
    accelerator.wait_for_everyone()
    _save_rng(tmp / "rng" / f"rank_{accelerator.process_index}.safetensors")
    future = None
    if meta["storage"] == "deepspeed":
        # DeepSpeed's converter to a universal checkpoint expects this client-state key.
        model.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag=DEEPSPEED_TAG,
                              client_state={"universal_checkpoint_info": {}})
    else:
        import torch.distributed.checkpoint as dcp

        state = _dcp_state(model, optimizer)
        if use_async:
            future = dcp.async_save(state, checkpoint_id=str(tmp / DCP_DIR), process_group=_async_save_group())
        else:
            dcp.save(state, checkpoint_id=str(tmp / DCP_DIR))
    pending = PendingSave(accelerator, output_dir, step, meta, keep_last, tmp, final, future)
    if future is None:
        pending.finish()
        return None
    return pending


class PendingSave:
    """A checkpoint whose shards may still be in flight (async save). `finish()` waits for them on every rank,
    then the main process writes the metadata and renames the folder: only then does the checkpoint count."""

    def __init__(self, accelerator, output_dir, step, meta, keep_last, tmp, final, future):
        self.accelerator, self.output_dir, self.step, self.meta = accelerator, output_dir, step, meta
        self.keep_last, self.tmp, self.final, self.future = keep_last, tmp, final, future

    def done(self) -> bool:
        """Whether this rank's shards are written (always True for a synchronous save)."""
        return self.future is None or self.future.done()

    def finish(self, current_step: int | None = None) -> Path:
        """Wait for the shards, then make the checkpoint complete. `current_step`: the training step reached
        meanwhile (recorded as `finalized_after_step`: later than `step` when training went on during the save)."""
        if self.future is not None:
            self.future.result()
        accelerator = self.accelerator
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            meta = {"format": FORMAT_VERSION, "step": self.step, **self.meta, "async": self.future is not None,
                    "finalized_after_step": self.step if current_step is None else current_step}
            (self.tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
            if self.final.exists():
                shutil.rmtree(self.final)
            self.tmp.rename(self.final)
            for _, old in list_complete(self.output_dir)[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return self.final


_async_group = []


def _async_save_group():
    """A process group of its own for background saves (created once, by every rank at its first async save):
    the save's collectives run on a thread while training runs collectives on the default group, and two
    threads on one gloo group corrupt each other's messages (torchtitan does the same)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    if not _async_group:
        _async_group.append(dist.new_group(backend="gloo"))
    return _async_group[0]


def _dcp_state(model, optimizer) -> dict:
    """{'model': ..., 'optim': ...} as DCP state dicts (FSDP2: DTensor shards; DDP: full tensors)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    model_sd, optim_sd = get_state_dict(module, _torch_optimizer(optimizer))
    return {"model": model_sd, "optim": optim_sd}


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one


def _save_rng(path: Path) -> None:
    import numpy as np
    from safetensors.torch import save_file

    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    np_state = np.random.get_state()
    metadata = {"python": json.dumps(random.getstate()),
                "numpy": json.dumps([np_state[0], np_state[1].tolist(), *np_state[2:]])}
    save_file(tensors, str(path), metadata=metadata)


def _load_rng(path: Path) -> None:
    import numpy as np
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        torch.set_rng_state(f.get_tensor("torch_cpu"))
        if torch.cuda.is_available() and "torch_cuda" in f.keys():
            torch.cuda.set_rng_state(f.get_tensor("torch_cuda"))
    python_state = json.loads(metadata["python"])
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    name, keys, *rest = json.loads(metadata["numpy"])
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))


# ---------------------------------------------------------------------------------------------- resuming
def prepare_deepspeed_resume(accelerator, path: Path, meta: dict) -> None:
    """Before `accelerator.prepare`: a DeepSpeed checkpoint from another world size is converted once to a
    universal checkpoint (DeepSpeed's `ds_to_universal`, main process) and the engine told to load it."""
    if not needs_universal(meta, accelerator.num_processes):
        return
    target = Path(path) / UNIVERSAL_DIR

    def convert():
        if (target / DEEPSPEED_TAG).is_dir():
            return
        tmp = Path(path) / f".tmp_{UNIVERSAL_DIR}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--no_strict",
               "--input_folder", str(Path(path) / DEEPSPEED_DIR / DEEPSPEED_TAG),
               "--output_folder", str(tmp / DEEPSPEED_TAG)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"ds_to_universal failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
        tmp.rename(target)

    # The main process converts (minutes for a big model); the others wait outside the collective timeout.
    distributed.run_on_main_process(accelerator, convert)
    accelerator.state.deepspeed_plugin.deepspeed_config["checkpoint"] = {"load_universal": True}


def load(accelerator, model, optimizer, path: Path) -> dict:
    """Restore model, optimizer and RNG states from a checkpoint (every rank must call, after `prepare`);
    returns its metadata. DCP reshards to the current world size; DeepSpeed loads its own or a universal one."""
    path = Path(path)
    meta = read_metadata(path)
    if meta["storage"] == "deepspeed":
        universal = needs_universal(meta, accelerator.num_processes)
        load_dir = path / (UNIVERSAL_DIR if universal else DEEPSPEED_DIR)
        groups = model.optimizer.param_groups
        hyperparameters = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        load_path, _ = model.load_checkpoint(str(load_dir), tag=DEEPSPEED_TAG, load_optimizer_states=True,
                                             load_lr_scheduler_states=False)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load {load_dir}")
        if universal:
            # DeepSpeed 0.19.8's universal loader copies param group 0's hyperparameters into every group, which
            # would put weight decay on the norms and biases: restore each group's own (the lr is set per step).
            for group, saved in zip(groups, hyperparameters, strict=True):
                group.update(saved)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = _dcp_state(model, optimizer)
        dcp.load(state, checkpoint_id=str(path / DCP_DIR))
        module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        set_state_dict(module, _torch_optimizer(optimizer), model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    rng_file = path / "rng" / f"rank_{accelerator.process_index}.safetensors"
    if rng_file.is_file() and meta["world_size"] == accelerator.num_processes:
        _load_rng(rng_file)
    return meta


def checkpoint_bytes(path: Path) -> dict:
    """Disk use of a checkpoint: total bytes and the largest per-rank share of its model/optimizer files."""
    total = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    per_rank: dict[int, int] = {}
    for f in Path(path).rglob("*"):
        match = re.search(r"(?:__(\d+)_\d+\.distcp|zero_pp_rank_(\d+)_)", f.name)
        if f.is_file() and match:
            rank = int(match.group(1) or match.group(2))
            per_rank[rank] = per_rank.get(rank, 0) + f.stat().st_size
    return {"total": total, "max_per_rank": max(per_rank.values()) if per_rank else total}


# ---------------------------------------------------------------------------------------------- export
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
    keys, read = (_deepspeed_reader(checkpoint) if meta["storage"] == "deepspeed" else _dcp_reader(checkpoint))
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


class _Reader:
    def __init__(self, load, numels):
        self._load, self._numels = load, numels

    def __call__(self, keys):
        return self._load(keys)

    def numel(self, key) -> int:
        return self._numels[key]


def _dcp_reader(checkpoint: Path):
    """Model tensors of a DCP checkpoint, loaded by key without a process group (DCP's no-dist mode)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(checkpoint / DCP_DIR)).read_metadata()
    shapes = {fqn[len("model."):]: item for fqn, item in metadata.state_dict_metadata.items()
              if fqn.startswith("model.") and isinstance(item, TensorStorageMetadata)}
    numels = {key: item.size.numel() for key, item in shapes.items()}

    def load(keys):
        state = {"model": {k: torch.empty(shapes[k].size, dtype=shapes[k].properties.dtype) for k in keys}}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(checkpoint / DCP_DIR)), no_dist=True)
        return state["model"]

    return list(numels), _Reader(load, numels)


def _deepspeed_reader(checkpoint: Path):
    """fp32 weights of a DeepSpeed ZeRO checkpoint, through DeepSpeed's own `zero_to_fp32` reader (lazy)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    lazy = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint / DEEPSPEED_DIR), tag=DEEPSPEED_TAG,
                                                    lazy_mode=True)
    numels = {k: int(torch.Size(v.shape).numel()) for k, v in lazy.items()}

    def load(keys):
        return {k: lazy[k].contiguous() for k in keys}

    return list(lazy), _Reader(load, numels)


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


if __name__ == "__main__":
    sys.exit(main())
