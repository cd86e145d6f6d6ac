"""Run a recipe unchanged, with probes attached from outside (no line in a recipe exists for a test):

    ZERO_RECIPES_HARNESS_RECIPE=recipes/llama_zero3.py accelerate launch ... tests/scripts/harness.py flags...

tests/conftest.py's `launch` runs every recipe through it. What it always adds, at the recipe's
`tracker.write_summary` (a point every rank reaches with the trained model still live):
    summary.json  + "sharding_per_rank" (zero_utils.train.evidence.sharding_evidence of each rank),
                  + "first_step_rows_per_rank" (the data rows each rank trained on in its first step),
                  + "data_cache_files_written_per_rank" (row or pair files each rank wrote: the main one only, 0 on
                    reuse)
                  + "tokenizer_calls_in_data_prep_per_rank" (the tokenizer's calls until the data was ready)
                  + "causal_lms_built_per_rank" (zero_utils.model.loading.load_causal_lm's calls before the first step
                    ended: the policy, and a preference loss's frozen reference where the recipe builds one)
    probe_logits.safetensors  fp32 logits at the last position of --prompt (exports are checked against them)
    tracker_config_keys.json  the keys of the run's config as the trackers (W&B) get it
Switched on by the environment:
    ZERO_RECIPES_HARNESS_RECIPE          the recipe to run (default recipes/llama_zero3.py)
    ZERO_RECIPES_HARNESS_VERIFY_REPLICAS=1  + "weights_digest_per_rank": SHA-256 of the gathered weights per rank
    ZERO_RECIPES_HARNESS_KILL_RANK_DURING_SAVE=R:S  rank R dies (SIGKILL) once its shards of step S are written,
                                         before the checkpoint is completed
    ZERO_RECIPES_HARNESS_SLOW_PREP_S     the first example tokenized in this process waits this long first
                                         (a data preparation of hours, in seconds)
    ZERO_RECIPES_HARNESS_SLOW_EXPORT_S   the final export waits this long first
    ZERO_RECIPES_HARNESS_SLOW_RANK0_LOAD_S  rank 0's first `AutoModelForCausalLM.from_pretrained` waits this long
                                         first (a 140 GB checkpoint read, in seconds)
    ZERO_RECIPES_HARNESS_SHARED_DIR_WAIT_S  how long a node retries reading --output_dir's job token
                                         (zero_utils.checkpoint.policy.SHARED_DIR_WAIT_S, 60 s) before it gives up
    ZERO_RECIPES_HARNESS_VARLEN_PROBE=1  register the flash-attention stand-in `varlen_probe` (varlen_probe.py)
    ZERO_RECIPES_HARNESS_UNHASHABLE_TOKENIZER=1  the tokenizer holds a generator: `datasets` cannot hash it
    ZERO_RECIPES_HARNESS_RSS_PROBE=1     + "data_prep_rss_anon_bytes_per_rank": [before, peak during] the data
                                         preparation (TrainingData's or PreferenceData's), RssAnon of the process
                                         + its children's private memory (--num_proc's workers: anonymous,
                                         unshared), sampled every 2 ms from /proc
    ZERO_RECIPES_HARNESS_LOSS_PROBE=1    + "loss_probe_per_rank": the largest logits-shaped tensor step 1 created,
                                         in tokens, and the output head group's FSDP2 all-gathers (loss_probe.py)
    ZERO_RECIPES_HARNESS_ACCUMULATION_PROBE=1  + "accumulation_probe_per_rank": what each rank holds after every
                                         micro-batch of the first two steps (accumulation_probe.py)
    ZERO_RECIPES_HARNESS_SP_PROBE=1      + "block_positions_per_rank": the positions the first decoder block's input
                                         held, {"train": [...], "eval": [...]} (sequence parallelism)
    ZERO_RECIPES_HARNESS_SP_UNSCALED=1   the loss scale without zero_utils.run.engine's sequence-parallel factor
    ZERO_RECIPES_HARNESS_FROZEN_PROBE=DIR  + "frozen_probe_per_rank": the model folder DIR (another model than the
                                         policy, its vocabulary) held by zero_utils.train.frozen_model.FrozenModel
                                         once the policy is prepared, then released: its parameters, the bytes this
                                         rank held and the ones the formula gives (the RNG states kept as they were)
    ZERO_RECIPES_HARNESS_REFERENCE_PROBE=1  + "reference_probe_per_rank" (recipes/llama_dpo.py): the most reference
                                         parameters held gathered (not DTensor shards) at any module's forward,
                                         the reference's parameter count, and "alive_after_step_1" / "tensors":
                                         how many of its parameter tensors (FSDP2: and their local shards;
                                         ZeRO-3: and their `ds_tensor` partitions), weakly referenced when it was
                                         built, are still alive at the end of step 1
    ZERO_RECIPES_HARNESS_SYNC_PROBE=N    + "host_syncs_in_step_per_rank": the calls of optimizer step N (from its
                                         `start_step` to the next one's) that would make the host wait for a GPU
                                         (sync_probe.py), and its host-to-device copies, blocking or not
    ZERO_RECIPES_HARNESS_CUDA_SYNC_PROBE=N  + "cuda_syncs_in_step_per_rank": on a GPU, what CUDA's own sync debug
                                         mode reports during step N (sync_probe.cuda_start_step); None elsewhere
    ZERO_RECIPES_HARNESS_OFFLOAD_PROBE=1  + "offload_moves_per_rank": {step: {"out"/"back": {shape: tensors}}}, what
                                         --activation_offloading moved to the host and back (every saved tensor
                                         moves: the minimum size is set to 0 for the tests' tiny blocks)
    ZERO_RECIPES_HARNESS_COMPILE_PROBE=1  + "unique_graphs_per_step_per_rank": dynamo's count of distinct graphs
                                         compiled so far, at the end of each step (a recompile per step grows it)
    ZERO_RECIPES_HARNESS_LIVE_TENSORS=1  + "live_tensor_bytes_per_rank": the bytes of every distinct tensor storage
                                         alive at the end of step 1 (before the update), found by a gc walk
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import runpy
import sys
import time
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import accumulation_probe  # noqa: E402  (tests/scripts: switched on by ZERO_RECIPES_HARNESS_ACCUMULATION_PROBE)
import loss_probe  # noqa: E402  (tests/scripts: switched on by ZERO_RECIPES_HARNESS_LOSS_PROBE)
import sync_probe  # noqa: E402  (tests/scripts: switched on by ZERO_RECIPES_HARNESS_SYNC_PROBE)

_seen: dict = {}  # what the recipe built, captured on its way through zero_utils and accelerate


def _slow_first_call(fn, seconds: float):
    waited = []

    def wrapper(*args, **kwargs):
        if not waited:
            waited.append(True)
            time.sleep(seconds)
        return fn(*args, **kwargs)

    return wrapper


def _counted(tokenizer):
    """The tokenizer, its calls counted in `_seen["tokenizer_calls"]` (and, on request, made unhashable)."""
    _seen["tokenizer_calls"] = [0]
    base = type(tokenizer)

    def __call__(self, *args, **kwargs):
        _seen["tokenizer_calls"][0] += 1
        return base.__call__(self, *args, **kwargs)

    tokenizer.__class__ = type(f"Counted{base.__name__}", (base,), {"__call__": __call__})
    if os.environ.get("ZERO_RECIPES_HARNESS_UNHASHABLE_TOKENIZER") == "1":
        tokenizer.unhashable = (n for n in range(1))  # neither pickle nor dill can serialise a generator
    return tokenizer


def rss_anon_bytes(pid: int | str = "self") -> int:
    """A process's anonymous resident memory (not file-backed pages such as memory-mapped Arrow files)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def private_anonymous_bytes(pid: int) -> int:
    """The anonymous memory a process holds that no other process maps: per mapping of /proc/PID/smaps, the
    smaller of Private_Dirty and Anonymous. For a forked worker: what it allocated or copied, not the parent's pages
    it still shares copy-on-write (which its RssAnon counts again), and not page-cache pages of a file written
    moments ago and not yet flushed (which smaps counts as Private_Dirty of the one process mapping them)."""
    total, fields = 0, {}
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Private_Dirty", "Anonymous"):
                fields[key] = int(value.split()[0]) * 1024
                if len(fields) == 2:
                    total += min(fields.values())
                    fields = {}
    return total


def rss_anon_with_children_bytes() -> int:
    """RssAnon of this process plus the private memory of every process it started that is still alive (the
    data-preparation workers of --num_proc)."""
    import psutil

    total = rss_anon_bytes()
    for child in psutil.Process().children(recursive=True):
        try:
            total += private_anonymous_bytes(child.pid)
        except OSError:  # ended between the listing and the read
            continue
    return total


class _RssAnonPeak:
    """Context: RssAnon before, and its peak sampled every 2 ms on a thread while the block runs, with the private
    memory of its children (the tokenizing workers of --num_proc count)."""

    def __enter__(self):
        import threading

        self.before = self.peak = rss_anon_with_children_bytes()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.002):
            self.peak = max(self.peak, rss_anon_with_children_bytes())

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon_with_children_bytes())


def _attach_probes() -> None:
    """Attach through the components' declared seams: the objects the recipe builds keep what they were given
    (TrainingData: its rows and `info`; RunMeasurements: the accelerator, the prepared model and optimizer), and
    `TrainingData.rows_of_step` is the one place a step's rows are chosen. Subclasses record them; no function's
    positional arguments are unpacked here."""
    from zero_utils.checkpoint import storage as checkpoint_storage
    from zero_utils.data import training as data
    from zero_utils.model import loading as model
    from zero_utils.preference import data as preference_data
    from zero_utils.train import measurement, tracking

    load_tokenizer = model.load_tokenizer
    load_causal_lm = model.load_causal_lm
    _seen["causal_lms_built"] = 0

    def counted_load_causal_lm(*args, **kwargs):
        _seen["causal_lms_built"] += 1
        return load_causal_lm(*args, **kwargs)

    def recorded_tokenizer(*args, **kwargs):
        _seen["tokenizer"] = _counted(load_tokenizer(*args, **kwargs))
        return _seen["tokenizer"]

    def _rss_probed(prepare, *args, **kwargs):  # the data preparation, its RssAnon sampled when asked
        if os.environ.get("ZERO_RECIPES_HARNESS_RSS_PROBE") != "1":
            return prepare(*args, **kwargs)
        with _RssAnonPeak() as probe:
            prepared = prepare(*args, **kwargs)
        _seen["data_prep_rss_anon"] = [probe.before, probe.peak]
        return prepared

    class RecordedData(data.TrainingData):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _seen["data"] = self
            _seen["tokenizer_calls_in_data_prep"] = _seen["tokenizer_calls"][0]

        @classmethod
        def prepare(cls, *args, **kwargs):
            return _rss_probed(super().prepare, *args, **kwargs)

        def rows_of_step(self, indices):  # the rows of the first step this rank trains
            rows = super().rows_of_step(indices)
            _seen.setdefault("first_step_rows", sum(rows, []))
            return rows

    class RecordedPreferenceData(preference_data.PreferenceData):  # recipes/llama_dpo.py's pairs
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _seen["data"] = self
            _seen["tokenizer_calls_in_data_prep"] = _seen["tokenizer_calls"][0]

        @classmethod
        def prepare(cls, *args, **kwargs):
            return _rss_probed(super().prepare, *args, **kwargs)

    class RecordedMeasurements(measurement.RunMeasurements):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _seen["meter"] = self
            if os.environ.get("ZERO_RECIPES_HARNESS_FROZEN_PROBE"):
                _seen["frozen_probe"] = _frozen_probe(os.environ["ZERO_RECIPES_HARNESS_FROZEN_PROBE"], *args[:3])
            if os.environ.get("ZERO_RECIPES_HARNESS_SP_PROBE") == "1":
                _positions_probe(self.accelerator.unwrap_model(self.model))

        def start_step(self):
            _seen["offload_step"] = _seen.get("offload_step", 0) + 1
            if os.environ.get("ZERO_RECIPES_HARNESS_SYNC_PROBE"):  # the window opens before the step's first call
                sync_probe.start_step(int(os.environ["ZERO_RECIPES_HARNESS_SYNC_PROBE"]), _seen["data"])
            if os.environ.get("ZERO_RECIPES_HARNESS_CUDA_SYNC_PROBE"):
                sync_probe.cuda_start_step(int(os.environ["ZERO_RECIPES_HARNESS_CUDA_SYNC_PROBE"]))
            super().start_step()
            if os.environ.get("ZERO_RECIPES_HARNESS_LOSS_PROBE") == "1":
                loss_probe.start(self.model, self.accelerator)
            if os.environ.get("ZERO_RECIPES_HARNESS_ACCUMULATION_PROBE") == "1":
                accumulation_probe.start_step()

        @contextlib.contextmanager
        def micro_batch(self, offload=None):
            with super().micro_batch(offload):
                yield
            if os.environ.get("ZERO_RECIPES_HARNESS_ACCUMULATION_PROBE") == "1":
                accumulation_probe.after_micro_batch(self.model, self.optimizer)

        def end_step(self, *args, **kwargs):
            if os.environ.get("ZERO_RECIPES_HARNESS_COMPILE_PROBE") == "1":
                from torch._dynamo.utils import counters

                _seen.setdefault("unique_graphs", []).append(counters["stats"]["unique_graphs"])
            if "causal_lms_built_by_step_1" not in _seen:  # the end of step 1
                _seen["causal_lms_built_by_step_1"] = _seen["causal_lms_built"]
                if "reference_weakrefs" in _seen:
                    gc.collect()
                    _seen["reference_probe"]["alive_after_step_1"] = sum(
                        ref() is not None for ref in _seen["reference_weakrefs"])
                if os.environ.get("ZERO_RECIPES_HARNESS_LIVE_TENSORS") == "1":
                    _seen["live_tensor_bytes"] = live_tensor_bytes()
            if os.environ.get("ZERO_RECIPES_HARNESS_LOSS_PROBE") == "1":
                loss_probe.stop()
            return super().end_step(*args, **kwargs)

    if os.environ.get("ZERO_RECIPES_HARNESS_OFFLOAD_PROBE") == "1":
        from zero_utils.model import activation_offload

        activation_offload.MIN_OFFLOAD_BYTES = 0  # the tests' tiny blocks: every saved tensor moves

        class RecordedOffload(activation_offload.ActivationOffload):  # per step: shapes moved out and back
            def pack(self, tensor):
                packed = super().pack(tensor)
                if packed is not tensor:
                    _offload_moves("out", tuple(tensor.shape))
                return packed

            def unpack(self, packed):
                before = self.restored
                tensor = super().unpack(packed)
                if self.restored > before:
                    _offload_moves("back", tuple(tensor.shape))
                return tensor

        activation_offload.ActivationOffload = RecordedOffload
    if os.environ.get("ZERO_RECIPES_HARNESS_REFERENCE_PROBE") == "1":
        from zero_utils.train import frozen_model

        hold = frozen_model.FrozenModel.hold.__func__

        def probed_hold(cls, *args, **kwargs):  # the reference as the recipe holds it, hooked before any forward
            reference = hold(cls, *args, **kwargs)
            _seen["reference_probe"] = _gathered_params_probe(reference.module)
            tensors = [t for p in reference.parameters() for t in (p, getattr(p, "_local_tensor", None),
                                                                   getattr(p, "ds_tensor", None)) if t is not None]
            _seen["reference_weakrefs"] = [weakref.ref(t) for t in tensors]
            _seen["reference_probe"]["tensors"] = len(tensors)
            return reference

        frozen_model.FrozenModel.hold = classmethod(probed_hold)
    model.load_tokenizer = recorded_tokenizer
    model.load_causal_lm = counted_load_causal_lm
    data.TrainingData = RecordedData
    preference_data.PreferenceData = RecordedPreferenceData
    measurement.RunMeasurements = RecordedMeasurements
    write = tracking.RunTracker.write

    def write_with_evidence(tracker, summary):
        write(tracker, {**summary, **_evidence()})
        if tracker.is_main:  # the keys of the config the trackers got (W&B's offline log is binary)
            (tracker.output_dir / "tracker_config_keys.json").write_text(json.dumps(sorted(tracker.config)))

    tracking.RunTracker.write = write_with_evidence
    kill = os.environ.get("ZERO_RECIPES_HARNESS_KILL_RANK_DURING_SAVE")
    if kill:
        class DyingSave(checkpoint_storage.PendingSave):  # a save whose shards are written, not yet completed
            def finish(self, *args, **kwargs):
                if kill == f"{self.accelerator.process_index}:{self.step}":
                    os.kill(os.getpid(), 9)
                return super().finish(*args, **kwargs)

        checkpoint_storage.PendingSave = DyingSave


def _offload_moves(direction: str, shape: tuple) -> None:
    """Count one tensor moved to the host ("out") or back ("back") in the current step, by shape."""
    step = _seen.get("offload_step", 0)
    moves = _seen.setdefault("offload_moves", {}).setdefault(step, {"out": {}, "back": {}})[direction]
    key = "x".join(map(str, shape))
    moves[key] = moves.get(key, 0) + 1


def live_tensor_bytes() -> int:
    """Bytes of every distinct storage of the tensors the garbage collector can reach (an FSDP2 DTensor counts its
    local shard; meta tensors nothing), after a collection."""
    import torch
    from torch.distributed.tensor import DTensor

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            tensor = obj._local_tensor if isinstance(obj, DTensor) else obj
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
        except (RuntimeError, ReferenceError, TypeError):  # a tensor without storage (a functional wrapper)
            continue
        storages[(tensor.device.type, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def _frozen_probe(folder: str, accelerator, engine, policy) -> dict:
    """Hold the model in `folder` as a FrozenModel next to the prepared policy, measure it, release it. The recipe's
    RNG streams and the reference probe's records are left as they were."""
    import gc
    import random

    import numpy as np
    import torch

    from zero_utils.formulas.model_states import reference_model_bytes
    from zero_utils.train.frozen_model import FrozenModel

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    kept = {k: _seen[k] for k in ("reference_probe", "reference_weakrefs") if k in _seen}
    frozen = FrozenModel.load(folder, accelerator, engine, loss_chunk_tokens=40, seed=1234,
                              policy_config=accelerator.unwrap_model(policy).config, policy_name="the policy",
                              flag="--teacher")
    found = {"num_params": frozen.num_params(), "state_bytes": frozen.state_bytes(),
             "measured_state_bytes": frozen.measured_state_bytes(accelerator),
             "expected_state_bytes": frozen.expected_state_bytes(),
             "formula_bytes": reference_model_bytes(engine, frozen.num_params(), accelerator.num_processes,
                                                    accelerator.mixed_precision)[0]}
    frozen.release()
    del frozen
    gc.collect()
    for key in ("reference_probe", "reference_weakrefs"):
        _seen.pop(key, None)
    _seen.update(kept)
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    return found


def _gathered_params_probe(module) -> dict:
    """{"max_gathered_params": the most parameters of `module` registered whole (not as DTensor shards) at the
    start or end of any submodule's forward (FSDP2's own hooks run first at the start: its unit is gathered then),
    "total_params"}; updated in place by forward hooks."""
    from torch.distributed.tensor import DTensor

    params = list(getattr(module, "module", module).parameters())
    found = {"max_gathered_params": 0, "total_params": sum(p.numel() for p in params)}

    def count(*_):
        gathered = sum(p.numel() for p in getattr(module, "module", module).parameters()
                       if not isinstance(p, DTensor))
        found["max_gathered_params"] = max(found["max_gathered_params"], gathered)

    for sub in getattr(module, "module", module).modules():
        sub.register_forward_pre_hook(count)
        sub.register_forward_hook(count)
    return found


def _positions_probe(model) -> None:
    """Record the positions each decoder block's input holds, in training and in eval mode (a forward hook on the
    first block): under sequence parallelism a rank trains on seq_len / sp of them and evaluates whole rows."""
    seen = _seen.setdefault("block_positions", {"train": [], "eval": []})

    def record(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        shapes = seen["train" if module.training else "eval"]
        if hidden.shape[1] not in shapes:
            shapes.append(hidden.shape[1])

    model.get_decoder().layers[0].register_forward_pre_hook(record, with_kwargs=True)


def _evidence() -> dict:
    """Every rank's view of the run (gathered: every rank must be here), and the probe logits on the main one."""
    from accelerate.utils import gather_object
    from safetensors.torch import save_file

    from zero_utils.model.loading import last_position_logits
    from zero_utils.train import evidence

    sync_probe.stop()  # a window still open (the run ended in the probed step) is closed, recorded incomplete
    sync_probe.cuda_stop()
    meter = _seen["meter"]
    accelerator, model, optimizer = meter.accelerator, meter.model, meter.optimizer
    cfg = _seen["settings"]
    found = {
        "first_step_rows_per_rank": gather_object([_seen.get("first_step_rows", [])]),
        "sharding_per_rank": gather_object([evidence.sharding_evidence(model, optimizer)]),
        "data_cache_files_written_per_rank": gather_object([_seen["data"].info["cache_files_written"]
                                                            if "data" in _seen else None]),  # SFT rows, DPO pairs
        "tokenizer_calls_in_data_prep_per_rank": gather_object([_seen.get("tokenizer_calls_in_data_prep")]),
        "causal_lms_built_per_rank": gather_object([_seen.get("causal_lms_built_by_step_1")]),
        "live_tensor_bytes_per_rank": gather_object([_seen.get("live_tensor_bytes")]),
        "reference_probe_per_rank": gather_object([_seen["reference_probe"]]) if "reference_probe" in _seen else None,
        "frozen_probe_per_rank": gather_object([_seen["frozen_probe"]]) if "frozen_probe" in _seen else None,
        "data_prep_rss_anon_bytes_per_rank": gather_object([_seen.get("data_prep_rss_anon")]),
        "loss_probe_per_rank": gather_object([loss_probe.result()])
        if os.environ.get("ZERO_RECIPES_HARNESS_LOSS_PROBE") == "1" else None,
        "accumulation_probe_per_rank": gather_object([accumulation_probe.result()])
        if os.environ.get("ZERO_RECIPES_HARNESS_ACCUMULATION_PROBE") == "1" else None,
        "host_syncs_in_step_per_rank": gather_object([sync_probe.result()])
        if os.environ.get("ZERO_RECIPES_HARNESS_SYNC_PROBE") else None,
        "cuda_syncs_in_step_per_rank": gather_object([sync_probe.cuda_result()])
        if os.environ.get("ZERO_RECIPES_HARNESS_CUDA_SYNC_PROBE") else None,
        "offload_moves_per_rank": gather_object([_seen.get("offload_moves")])
        if os.environ.get("ZERO_RECIPES_HARNESS_OFFLOAD_PROBE") == "1" else None,
        "unique_graphs_per_step_per_rank": gather_object([_seen.get("unique_graphs")])
        if os.environ.get("ZERO_RECIPES_HARNESS_COMPILE_PROBE") == "1" else None,
        "block_positions_per_rank": gather_object([_seen.get("block_positions")])
        if os.environ.get("ZERO_RECIPES_HARNESS_SP_PROBE") == "1" else None,
        "weights_digest_per_rank": gather_object([evidence.weights_digest(model)])
        if os.environ.get("ZERO_RECIPES_HARNESS_VERIFY_REPLICAS") == "1" else None,
    }
    logits = last_position_logits(model, _seen["tokenizer"], cfg.prompt, accelerator.device)
    if accelerator.is_main_process:
        save_file({"logits": logits}, f"{cfg.output_dir}/probe_logits.safetensors")
    return found


def main() -> None:
    from zero_utils.checkpoint import export as checkpoint_export
    from zero_utils.data import sft_rows
    from zero_utils.launch import cli

    if os.environ.get("ZERO_RECIPES_HARNESS_SP_UNSCALED") == "1":  # [SP] the loss scale without ZeRO-3's factor
        from zero_utils.data import training as sp_training

        sp_training.sequence_parallel_gradient_factor = lambda accelerator, sp: 1
    if os.environ.get("ZERO_RECIPES_HARNESS_SLOW_PREP_S"):
        sft_rows.tokenize_example = _slow_first_call(sft_rows.tokenize_example,
                                                     float(os.environ["ZERO_RECIPES_HARNESS_SLOW_PREP_S"]))
    if os.environ.get("ZERO_RECIPES_HARNESS_SLOW_EXPORT_S"):
        checkpoint_export.export = _slow_first_call(checkpoint_export.export,
                                                    float(os.environ["ZERO_RECIPES_HARNESS_SLOW_EXPORT_S"]))
    if os.environ.get("ZERO_RECIPES_HARNESS_SLOW_RANK0_LOAD_S") and os.environ.get("RANK", "0") == "0":
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained = _slow_first_call(
            AutoModelForCausalLM.from_pretrained, float(os.environ["ZERO_RECIPES_HARNESS_SLOW_RANK0_LOAD_S"]))
    if os.environ.get("ZERO_RECIPES_HARNESS_SHARED_DIR_WAIT_S"):
        from zero_utils.checkpoint import policy as checkpoint

        checkpoint.SHARED_DIR_WAIT_S = float(os.environ["ZERO_RECIPES_HARNESS_SHARED_DIR_WAIT_S"])
    if os.environ.get("ZERO_RECIPES_HARNESS_VARLEN_PROBE") == "1":
        import varlen_probe

        varlen_probe.install()
    if os.environ.get("ZERO_RECIPES_HARNESS_LOSS_PROBE") == "1":
        loss_probe.install()
    _attach_probes()
    recipe = REPO / os.environ.get("ZERO_RECIPES_HARNESS_RECIPE", "recipes/llama_zero3.py")
    sys.argv = [str(recipe), *sys.argv[1:]]
    module = runpy.run_path(str(recipe), run_name="recipe_under_harness")  # defines main and Settings, runs nothing

    def recipe_main(settings):
        _seen["settings"] = settings
        module["main"](settings)

    cli.run_recipe(recipe_main, module["Settings"], module["__doc__"])


if __name__ == "__main__":
    main()
