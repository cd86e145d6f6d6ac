"""Where a checkpoint's bytes go and how they come back: the folder layout, the two storages (`DCPStorage`:
torch.distributed.checkpoint for DDP, FSDP2 and single process; `DeepSpeedStorage`: the engine's own format, with
DeepSpeed's universal conversion for another world size), every rank's RNG state, and the finishing of a
checkpoint (rename once every rank has written, keep-last pruning). When to save and what a resume must match is
the policy in zero_utils.checkpoint.policy; the Hugging Face export is zero_utils.checkpoint.export.

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
`zero_utils.data.training.global_batch_indices`, and the learning rate a pure function of the step
(`zero_utils.train.optim`).

What this module writes itself is JSON or safetensors. The engines' formats hold pickles (DCP's `.metadata`,
DeepSpeed's `.pt`): resume only from checkpoints you made. `--resume` refuses a folder without our metadata
before reading anything else in it.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from zero_utils.run import distributed
from zero_utils.run.engine import Engine
from zero_utils.run.errors import UserError

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


# ---------------------------------------------------------------------------------------------- storages
class DCPStorage:
    """torch.distributed.checkpoint under `model_optim/`: DDP, FSDP2 and single process. Each rank writes its own
    shards (FSDP2) or its share of the replicated tensors (DDP); DCP reshards on load, so N ranks resume on M;
    saves may run in the background (`async_save`)."""

    name = "dcp"  # as written in our metadata
    engines = "DDP/FSDP2"
    supports_async_save = True

    def write(self, folder: Path, model, optimizer, *, use_async: bool):
        """Write the model and optimizer state into `folder` (every rank); the future of a background save, or
        None once written."""
        import torch.distributed.checkpoint as dcp

        state = _dcp_state(model, optimizer)
        if use_async:
            return dcp.async_save(state, checkpoint_id=str(folder / DCP_DIR), process_group=_async_save_group())
        dcp.save(state, checkpoint_id=str(folder / DCP_DIR))
        return None

    def prepare_resume(self, accelerator, folder: Path, meta: dict) -> None:
        """Before `accelerator.prepare`: nothing to do (DCP reshards as it loads)."""

    def read(self, accelerator, folder: Path, model, optimizer, meta: dict) -> None:
        """Load the model and optimizer state of `folder` into the prepared model and optimizer (every rank)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = _dcp_state(model, optimizer)
        dcp.load(state, checkpoint_id=str(folder / DCP_DIR))
        module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        set_state_dict(module, _torch_optimizer(optimizer), model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def weights(self, folder: Path):
        """Model tensors of a DCP checkpoint, loaded by key without a process group (DCP's no-dist mode)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = dcp.FileSystemReader(str(folder / DCP_DIR)).read_metadata()
        shapes = {fqn[len("model."):]: item for fqn, item in metadata.state_dict_metadata.items()
                  if fqn.startswith("model.") and isinstance(item, TensorStorageMetadata)}
        numels = {key: item.size.numel() for key, item in shapes.items()}

        def load(keys):
            state = {"model": {k: torch.empty(shapes[k].size, dtype=shapes[k].properties.dtype) for k in keys}}
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder / DCP_DIR)), no_dist=True)
            return state["model"]

        return list(numels), _Reader(load, numels)


class DeepSpeedStorage:
    """DeepSpeed's own checkpoint under `deepspeed/` (its `zero_to_fp32` and `ds_to_universal` read it), saved with
    `universal_checkpoint_info`; resumed on another world size through a universal checkpoint made once under
    `universal/`. Saves are synchronous."""

    name = "deepspeed"
    engines = "DeepSpeed"
    supports_async_save = False

    def write(self, folder: Path, model, optimizer, *, use_async: bool):
        """Write the engine's state into `folder` (every rank); None: written on return."""
        # DeepSpeed's converter to a universal checkpoint expects this client-state key.
        model.save_checkpoint(str(folder / DEEPSPEED_DIR), tag=DEEPSPEED_TAG,
                              client_state={"universal_checkpoint_info": {}})
        return None

    def prepare_resume(self, accelerator, folder: Path, meta: dict) -> None:
        """Before `accelerator.prepare`: a checkpoint from another world size is converted once to a universal
        checkpoint (DeepSpeed's `ds_to_universal`, main process) and the engine told to load it."""
        if meta["world_size"] == accelerator.num_processes:  # its own checkpoint loads as it is
            return
        target = Path(folder) / UNIVERSAL_DIR

        def convert():
            if (target / DEEPSPEED_TAG).is_dir():
                return
            tmp = Path(folder) / f".tmp_{UNIVERSAL_DIR}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--no_strict",
                   "--input_folder", str(Path(folder) / DEEPSPEED_DIR / DEEPSPEED_TAG),
                   "--output_folder", str(tmp / DEEPSPEED_TAG)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"ds_to_universal failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
            tmp.rename(target)

        # The main process converts (minutes for a big model); the others wait outside the collective timeout.
        distributed.run_on_main_process(accelerator, convert)
        accelerator.state.deepspeed_plugin.deepspeed_config["checkpoint"] = {"load_universal": True}

    def read(self, accelerator, folder: Path, model, optimizer, meta: dict) -> None:
        """Load the engine's own (or the universal) checkpoint of `folder` into the prepared engine (every rank)."""
        universal = meta["world_size"] != accelerator.num_processes  # then prepare_resume made one
        load_dir = folder / (UNIVERSAL_DIR if universal else DEEPSPEED_DIR)
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

    def weights(self, folder: Path):
        """fp32 weights of a DeepSpeed ZeRO checkpoint, through DeepSpeed's own `zero_to_fp32` reader (lazy)."""
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        lazy = get_fp32_state_dict_from_zero_checkpoint(str(folder / DEEPSPEED_DIR), tag=DEEPSPEED_TAG,
                                                        lazy_mode=True)
        numels = {k: int(torch.Size(v.shape).numel()) for k, v in lazy.items()}

        def load(keys):
            return {k: lazy[k].contiguous() for k in keys}

        return list(lazy), _Reader(load, numels)


Storage = DCPStorage | DeepSpeedStorage
DCP, DEEPSPEED = DCPStorage(), DeepSpeedStorage()


def storage_for(engine: Engine) -> Storage:
    """Where `engine`'s checkpoints are stored: DeepSpeed's own format under DeepSpeed, DCP under every other engine."""
    return DEEPSPEED if engine.is_deepspeed else DCP


def storage_of(meta: dict) -> Storage:
    """The storage that wrote a checkpoint, from the name its metadata records."""
    return {DCP.name: DCP, DEEPSPEED.name: DEEPSPEED}[meta["storage"]]


class _Reader:
    def __init__(self, load, numels):
        self._load, self._numels = load, numels

    def __call__(self, keys):
        return self._load(keys)

    def numel(self, key) -> int:
        return self._numels[key]


# ---------------------------------------------------------------------------------------------- saving
def save(accelerator, model, optimizer, output_dir: str, step: int, *, storage: Storage, meta: dict,
         keep_last: int, hf_files=(), use_async: bool = False):
    """Save the full training state as `checkpoints/step_<step>` (every rank must call).

    `storage` (`storage_for(engine)`) writes the model and optimizer state; `meta` is stored in our metadata
    (engine, world_size, global batch, settings, ...), with the storage's name. `hf_files`: objects with
    `save_pretrained` (config, tokenizer) written to `hf/`. With `use_async` (DCP storage only) the shards are
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
    future = storage.write(tmp, model, optimizer, use_async=use_async)
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
def load(accelerator, model, optimizer, path: Path) -> dict:
    """Restore model, optimizer and RNG states from a checkpoint (every rank must call, after `prepare`);
    returns its metadata. DCP reshards to the current world size; DeepSpeed loads its own or a universal one
    (`DeepSpeedStorage.prepare_resume` made it before `prepare`)."""
    path = Path(path)
    meta = read_metadata(path)
    storage_of(meta).read(accelerator, path, model, optimizer, meta)
    rng_file = path / "rng" / f"rank_{accelerator.process_index}.safetensors"
    if rng_file.is_file() and meta["world_size"] == accelerator.num_processes:
        _load_rng(rng_file)
    return meta
