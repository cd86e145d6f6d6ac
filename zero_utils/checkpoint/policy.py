"""The checkpoint policy of a run (`Checkpointer`): where a run resumes from, what a resume must match (format,
model architecture, storage; a changed global batch or setting is named), the metadata written with every
checkpoint, the cadence, background saves and their completion, and the save after a stop signal. What a checkpoint
holds and how it is written and read is zero_utils.checkpoint.storage; the Hugging Face export is
zero_utils.checkpoint.export.

The data position is the step: the data order is a pure function of (seed, step, global batch), see
`zero_utils.data.training.global_batch_indices`, and the learning rate a pure function of the step
(`zero_utils.train.optim`). `--resume` refuses a folder without our metadata before reading anything else in it.

Export: `python -m zero_utils.checkpoint export <checkpoint> <out_dir>` (zero_utils.checkpoint.export).
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from zero_utils.checkpoint import export as checkpoint_export
from zero_utils.checkpoint import storage as checkpoint_storage
from zero_utils.checkpoint.storage import FORMAT_VERSION, list_complete, newest_complete, read_metadata, storage_of
from zero_utils.run import distributed, stop_signals
from zero_utils.run.engine import Engine
from zero_utils.run.errors import UserError
from zero_utils.run.versions import software_versions

JOB_TOKEN_FILE = ".zero_recipes_job"  # in --output_dir: this job's token, written by the main process
SHARED_DIR_WAIT_S = 60.0  # NFS may hide a new file from another client this long (attribute caching, acdirmax 60 s)


def check_output_dir_shared(accelerator, output_dir: str) -> None:
    """Stop the job on every rank, before anything is built, when a node does not see the main process's
    `output_dir` (a node-local disk): every rank writes its checkpoint shards there, and only the main process
    creates a checkpoint's folders, so such a node would fail at its first save, after the training.

    The main process writes a token unique to this job (a fresh UUID, sent to every rank through the process
    group's store) into `output_dir/JOB_TOKEN_FILE`; each other node's local main process reads it back, retrying
    for SHARED_DIR_WAIT_S. A file left there by an earlier job (on a node-local disk that reuses the path) holds
    another token and does not pass. A `UserError` on every rank names the path and the fix. Waits are outside
    collectives (`distributed.run_on_main_process`). Every rank must call it; a job on one node passes at once."""
    if distributed.num_nodes(accelerator) == 1:
        return

    def write_token() -> str:
        token = uuid.uuid4().hex
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / JOB_TOKEN_FILE).write_text(token + "\n")
        return token

    token = distributed.run_on_main_process(accelerator, write_token, share_result=True,
                                            what="the main process writing --output_dir's job token")

    def this_node_sees_it() -> None:
        if accelerator.is_main_process or sees_job_token(Path(output_dir), token, SHARED_DIR_WAIT_S):
            return
        raise UserError(f"--output_dir {output_dir} is not shared: node {distributed.node_index(accelerator)} "
                        f"({socket.gethostname()}) does not see the file the main process wrote there "
                        f"({JOB_TOKEN_FILE}); checkpoints need a folder every node shares (NFS, Lustre, a shared "
                        "mount): pass an --output_dir on a file system every node mounts.")

    distributed.run_on_main_process(accelerator, this_node_sees_it, per_node=True,
                                    what="every node checking that it sees --output_dir")


def sees_job_token(folder: Path, token: str, wait_s: float, poll_s: float = 1.0) -> bool:
    """Whether `folder/JOB_TOKEN_FILE` holds `token`, read again every `poll_s` until `wait_s` seconds have passed
    (a network file system may show a new file late). Reads only."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if (folder / JOB_TOKEN_FILE).read_text().strip() == token:
                return True
        except OSError:  # not there (yet)
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


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


def check_compatible(meta: dict, *, storage: checkpoint_storage.Storage, config_hash: str,
                     global_batch_rows: int) -> list[str]:
    """Refuse a resume that cannot work with one sentence (`UserError`); return warnings for one that works but
    changes the run (another global batch changes the data stream)."""
    if meta.get("format") != FORMAT_VERSION:
        raise UserError(f"the checkpoint has format {meta.get('format')!r}, this code reads {FORMAT_VERSION}; "
                        "resume it with the version of zero-recipes that wrote it.")
    if meta["model_config_hash"] != config_hash:
        raise UserError("the checkpoint was trained on a model with another architecture (config hash "
                        f"{meta['model_config_hash']} vs {config_hash}); pass the same --model it was trained from.")
    written_by = storage_of(meta)
    if written_by is not storage:
        raise UserError(f"the checkpoint was written by {meta['engine']} ({written_by.engines}) and this launch "
                        f"runs {storage.engines}; resume with a {written_by.engines} config, or export it "
                        "(python -m zero_utils.checkpoint export) and fine-tune from the export.")
    warnings = []
    if meta["global_batch_rows"] != global_batch_rows:
        warnings.append(f"the global batch changes from {meta['global_batch_rows']} to {global_batch_rows} rows: "
                        "training continues, but not on the data stream of the original run.")
    return warnings


# ---------------------------------------------------------------------------------------------- policy
# Settings a resume may change without changing what is trained (where output goes, how often to save or log,
# how long to train): any other setting that differs from the checkpoint's is reported when the run resumes.
RUN_CONTROL_SETTINGS = ("resume", "overwrite", "max_steps", "output_dir", "report_to", "project", "group",
                        "save_every", "keep_last", "eval_every", "collective_timeout_s", "wait_limit_s", "async_save",
                        "prompt", "max_new_tokens", "config", "device_memory", "fit_check", "num_proc")


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

        checkpointer = Checkpointer(accelerator, engine, cfg)        # the recipe's settings (flags below)
        checkpointer.check(model_config, global_batch_rows)       # before the model is loaded: refuses a mismatch
        start_step = checkpointer.load(model, optimizer, hf_files=(config, tokenizer), tracker_run_id=...)
        for step in range(start_step + 1, max_steps + 1):
            ...
            if checkpointer.save(step, stop=result.stop):      # saves when due; True: a stop signal, saved, stop now
                break
        checkpointer.export(f"{output_dir}/final")              # the newest checkpoint as a Hugging Face folder

    `settings`: the recipe's settings dataclass, kept whole in every checkpoint's metadata; the policy reads its
    output_dir, resume ('auto' or a path), overwrite, save_every, keep_last, max_steps, async_save and seed.
    `resumed` says where a resumed run continues (for the tracker), None for a fresh run. Construct it on every
    rank, before the model is built: on several nodes it checks that every node sees `output_dir`
    (`check_output_dir_shared`); every other method must be called by every rank at the same point. Background
    saves (`async_save`) need DCP storage (DDP, FSDP2); under DeepSpeed saves are synchronous.
    """

    def __init__(self, accelerator, engine: Engine, settings):
        output_dir, resume, seed = settings.output_dir, settings.resume, settings.seed
        self.accelerator, self.engine, self.output_dir = accelerator, engine, output_dir
        self.save_every, self.keep_last, self.max_steps = settings.save_every, settings.keep_last, settings.max_steps
        self.seed = seed
        self.storage = checkpoint_storage.storage_for(engine)
        self.use_async = settings.async_save and self.storage.supports_async_save
        self.settings = asdict(settings)
        check_output_dir_shared(accelerator, output_dir)  # on several nodes: every node sees the same folder
        self.resume_from = resolve_resume(output_dir, resume, settings.overwrite)
        self.resume_meta = read_metadata(self.resume_from) if self.resume_from else None
        self.resumed = (Resumed(self.resume_meta["step"], self.resume_meta.get("tracker_run_id"), self.resume_from)
                        if self.resume_meta else None)
        self.init_seed = init_seed(self.resume_meta, seed)  # a config-only model's weights: drawn from this seed
        self._tracker_run_id: str | None = None  # stored with every checkpoint: a resumed run continues it
        self._model = self._optimizer = None
        self._hf_files, self._global_batch_rows, self._config_hash = (), None, None
        self._pending: checkpoint_storage.PendingSave | None = None
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
        warnings = check_compatible(self.resume_meta, storage=self.storage,  # another architecture: refused here
                                    config_hash=self._config_hash, global_batch_rows=global_batch_rows)
        refuse_another_model(self.resume_meta.get("settings", {}), self.settings)  # the same one from elsewhere
        warnings += changed_settings(self.resume_meta.get("settings", {}), self.settings)
        for warning in warnings:
            self.accelerator.print(f"warning: {warning}")
        self.storage.prepare_resume(self.accelerator, self.resume_from, self.resume_meta)  # [DeepSpeed] universal

    def load(self, model, optimizer, *, hf_files=(), tracker_run_id: str | None = None) -> int:
        """Remember what to save (`hf_files`: objects with `save_pretrained`, written to hf/; the tracker's run id,
        written to the metadata), restore the checkpoint being resumed if there is one, and return the step
        training continues after (0 if fresh). Call it after `accelerator.prepare`."""
        self._model, self._optimizer, self._hf_files = model, optimizer, hf_files
        self._tracker_run_id = tracker_run_id
        if self.resume_from:
            self._start_step = checkpoint_storage.load(self.accelerator, model, optimizer, self.resume_from)["step"]
        return self._start_step

    def save(self, step: int, *, stop: bool) -> bool:
        """After optimizer step `step`: save if it is due (every `save_every` steps, and the last step). With `stop`
        (a stop signal reached any rank; every rank must pass the same value) save now, wait for the save to be
        complete, print how to continue, and return True: the loop should end, and the run with it."""
        if stop or step == self.max_steps or (self.save_every and step % self.save_every == 0):
            self._complete_pending(step)
            self._saved = True
            self._pending = checkpoint_storage.save(
                self.accelerator, self._model, self._optimizer, self.output_dir, step, storage=self.storage,
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
        distributed.run_on_main_process(self.accelerator, lambda: checkpoint_export.export(final, out_dir))
        return final

    def _metadata(self, step: int) -> dict:
        return {"engine": self.engine.name, "storage": self.storage.name,
                "world_size": self.accelerator.num_processes, "global_batch_rows": self._global_batch_rows,
                "examples_seen": step * self._global_batch_rows, "seed": self.seed, "init_seed": self.init_seed,
                "model_config_hash": self._config_hash, "tracker_run_id": self._tracker_run_id,
                "versions": software_versions(), "settings": self.settings}

    def _complete_pending(self, current_step: int) -> None:
        if self._pending:  # `save` returns None when the checkpoint is already complete (synchronous)
            self._pending.finish(current_step)
            self._pending = None


def init_seed(resume_meta: dict | None, seed: int) -> int:
    """The seed a --model with only a config draws its starting weights from: `seed` (this run's --seed) on a fresh
    start; on a resume the first run's (the checkpoint metadata's `init_seed`, else its `seed`), whatever --seed the
    resume gives, so that a reference model or a LoRA merge drawn again from it is the model training started from."""
    if not resume_meta:
        return seed
    return resume_meta.get("init_seed", resume_meta["seed"])


def refuse_another_model(saved: dict, current: dict) -> None:
    """`UserError` when a resume names another --model (or --revision) than the checkpoint's settings: a resume
    continues the weights it saved, and a preference run's reference is built from --model, so another model would
    silently change what is trained against. The same local folder written another way is the same model."""
    import os

    def same(a: str, b: str) -> bool:
        a_path, b_path = os.path.realpath(a), os.path.realpath(b)
        return a == b or (a_path == b_path and os.path.exists(a_path))

    for key in ("model", "revision"):
        if key in saved and key in current and not same(str(saved[key]), str(current[key])):
            raise UserError(f"--{key} {current[key]!r} is not the checkpoint's --{key} {saved[key]!r}: a resume "
                            f"continues the model it saved; pass --{key} {saved[key]!r}, or start a new run (another "
                            "--output_dir, no --resume) to train from the other one.")


def changed_settings(saved: dict, current: dict) -> list[str]:
    """One warning naming the settings (other than RUN_CONTROL_SETTINGS) whose resolved value differs from the
    checkpoint's, e.g. "lr 0.003 -> 0.001"; [] when none does."""
    changed = [f"{key} {saved[key]!r} -> {current[key]!r}" for key in sorted(set(saved) & set(current))
               if key not in RUN_CONTROL_SETTINGS and saved[key] != current[key]]
    if not changed:
        return []
    return [f"the run resumes with settings that differ from the checkpoint's: {', '.join(changed)}."]

