"""recipes/llama_zero3.py, unchanged, with two benchmark-only switches (environment variables, so the recipe's own
flags pass through untouched). benchmarks/run.py launches it in place of the recipe:

    BENCH_COMMS_STEP=S BENCH_COMMS_FILE=f.json accelerate launch --config_file accelerate_configs/zero3.yaml \
        --num_processes 2 benchmarks/recipe_probe.py --max_steps 4 ...
    BENCH_ACCELERATE_FSDP2_PREP=1 accelerate launch --config_file accelerate_configs/fsdp2.yaml \
        --num_processes 2 benchmarks/recipe_probe.py ...

BENCH_COMMS_STEP=S  counts every c10d collective of optimizer step S with torch.profiler: with record_shapes=True
                    each ProcessGroup call (gloo or NCCL, DDP's C++ reducer included) leaves an event with its
                    collective name, message sizes in elements and dtype (`count_collectives`). Every rank writes
                    its own list to BENCH_COMMS_FILE.rank<R>. The step runs from the recipe's call to
                    `data.training.global_batch_indices(step=S)` to its call for step S+1, so it includes the recipe's
                    small scalar all-reduces (token count, loss, grad norm, metrics maxima).
BENCH_DEEPSPEED_DEFAULT_BUCKETS=1  leaves DeepSpeed's bucket sizes at its own defaults (what the Trainer gets from
                    the same YAML) instead of zero_utils.run.accelerator's (the hidden size's, at least 25 MiB).
BENCH_DEEPSPEED_ZERO='{"key": value, ...}'  overrides DeepSpeed `zero_optimization` settings once
                    zero_utils.run.accelerator has sized its buckets (one setting at a time, for ablations): e.g.
                    '{"reduce_bucket_size": 65536, "stage3_prefetch_bucket_size": 58982}' is accelerate's plain
                    "auto" at hidden 256.
BENCH_NO_CHECKPOINTS=1  saves no checkpoint and exports no final/ folder (benchmarks/gpu.py: its 0.85B model's
                    checkpoint with Adam's state is ~10 GB, minutes of disk writes that measure nothing it reports);
                    summary.json's "checkpoint" then names a folder never written, "checkpoint_bytes" 0.
BENCH_ACCELERATE_FSDP2_PREP=1  skips zero_utils.model.wrapping.shard_model: accelerate's `prepare` then applies
                    `fully_shard` itself (TRANSFORMER_BASED_WRAP on the decoder-block class, then the root, all
                    with the YAML's reshard_after_forward), which is what users get without our wrapping choices.
BENCH_ACCELERATE_ACCUMULATION=1  FSDP2 accumulates as accelerate does by default (`sync_each_batch=False`: gradient
                    sync off until a step's last micro-batch, unsharded gradients on every rank until then), instead
                    of zero_utils.run.accelerator's reduce-scatter every micro-batch: the before of docs/MEMORY.md's
                    accumulation table (benchmarks/accumulation.py).
"""

import json
import math
import os
import sys
from pathlib import Path

import zero_utils.data.training
import zero_utils.model.deepspeed_setup
import zero_utils.model.wrapping
import zero_utils.run.accelerator

REPO = Path(__file__).resolve().parent.parent


def count_comms_of_step(step_to_count: int, path: str) -> None:
    """Wrap data.training.global_batch_indices (called once at the start of every step) to profile one whole step."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    original = zero_utils.data.training.global_batch_indices
    state = {}

    def global_batch_indices(num_rows, global_batch_size, step, seed):
        if step == step_to_count and "prof" not in state:
            state["prof"] = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            state["prof"].__enter__()
        elif step == step_to_count + 1 and "prof" in state and "done" not in state:
            state["done"] = True
            state["prof"].__exit__(None, None, None)
            write(state["prof"])
        return original(num_rows, global_batch_size, step, seed)

    def write(prof):
        counted = count_collectives(prof.events(), dist.get_world_size())
        Path(f"{path}.rank{dist.get_rank()}").write_text(json.dumps(counted))

    zero_utils.data.training.global_batch_indices = global_batch_indices


# NCCL's profiling titles (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp); each event records its inputs only.
_NCCL_EVENTS = {"nccl:all_reduce": "all_reduce", "nccl:all_reduce_coalesced": "all_reduce",
                "nccl:broadcast": "broadcast", "nccl:reduce": "reduce",
                "nccl:all_gather": "all_gather", "nccl:_all_gather_base": "all_gather",
                "nccl:all_gather_into_tensor_coalesced": "all_gather",
                "nccl:reduce_scatter": "reduce_scatter", "nccl:_reduce_scatter_base": "reduce_scatter",
                "nccl:reduce_scatter_tensor_coalesced": "reduce_scatter"}


def count_collectives(events, world: int) -> dict:
    """Elements each collective kind moved in a profiled step, from torch.profiler events (`name`,
    `input_shapes`, `input_dtypes`), over gloo (CPU) or NCCL (GPU). Returns {"nelems": {kind: elements},
    "calls": {event name: count}, "dtypes", "world_size", "backend"}. All-gathers count the gathered tensor
    (world x the rank's input), reduce-scatters the full input.

    Gloo has no reduce-scatter of its own: c10d runs `_reduce_scatter_base_` as an all-reduce of the whole input,
    so the backend events (`gloo:all_reduce`) include it. There each collective is counted as the engine asked
    for it: reduce-scatters and all-gathers from the dispatcher ops (c10d::..., input shapes [out, in]),
    all-reduces and broadcasts, whose dispatcher ops take tensor lists without recorded shapes, from the backend
    events, less the reduce-scatter inputs. NCCL runs every collective natively: its backend events alone count.
    """
    nelems = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0, "reduce": 0, "broadcast": 0}
    events = [e for e in events if e.name.startswith(("c10d::", "gloo:", "nccl:"))]
    backend = "nccl" if any(e.name.startswith("nccl:") for e in events) else "gloo"
    calls, dtypes = {}, set()
    for event in events:
        calls[event.name] = calls.get(event.name, 0) + 1
        sizes = [math.prod(shape) for shape in event.input_shapes if shape]
        if event.name.startswith(("gloo:", "nccl:")):
            dtypes |= {d for d in (event.input_dtypes or []) if d}
        if backend == "nccl":
            kind = _NCCL_EVENTS.get(event.name)
            if kind is not None:
                nelems[kind] += sum(sizes) * (world if kind == "all_gather" else 1)
        elif event.name == "gloo:all_reduce":
            nelems["all_reduce"] += sum(sizes)
        elif event.name in ("gloo:broadcast", "gloo:reduce"):
            nelems[event.name.removeprefix("gloo:")] += sum(sizes)
        elif event.name == "gloo:all_gather":  # input = this rank's shard; the gathered tensor is world x it
            nelems["all_gather"] += sum(sizes) * world
        elif event.name == "c10d::_reduce_scatter_base_":  # shapes [output shard, full input]
            nelems["reduce_scatter"] += sizes[1]
            nelems["all_reduce"] -= sizes[1]
    return {"nelems": nelems, "calls": calls, "dtypes": sorted(dtypes), "world_size": world, "backend": backend}


def override_deepspeed_zero(settings: dict) -> None:
    size_deepspeed_buckets = zero_utils.model.deepspeed_setup.size_deepspeed_buckets

    def sized_then_overridden(accelerator, model):
        written = size_deepspeed_buckets(accelerator, model)
        accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"].update(settings)
        return written | settings

    zero_utils.model.deepspeed_setup.size_deepspeed_buckets = sized_then_overridden


def accelerate_fsdp2_prep() -> None:
    """Leave FSDP2 wrapping to accelerate's prepare, pointed at the same decoder-block class."""

    def shard_model(model, accelerator, *_args, **_kwargs):  # whatever our wrapping's options, none applies
        plugin = accelerator.state.fsdp_plugin
        blocks = zero_utils.model.wrapping.find_block_classes(model)
        plugin.transformer_cls_names_to_wrap = sorted(c.__name__ for c in blocks)
        return model

    zero_utils.model.wrapping.shard_model = shard_model


def accelerate_default_accumulation() -> None:
    """zero_utils.run.accelerator builds accelerate's GradientAccumulationPlugin for FSDP2 with sync_each_batch=True;
    this makes it False, accelerate's default."""
    import accelerate.utils

    plugin = accelerate.utils.GradientAccumulationPlugin

    def default_sync(**kwargs):
        return plugin(**{**kwargs, "sync_each_batch": False})

    accelerate.utils.GradientAccumulationPlugin = default_sync


def no_checkpoints() -> None:
    """The checkpointer's save does nothing (it still returns the stop flag the loop obeys) and its export writes
    nothing (it returns the folder it would have written)."""
    from zero_utils.checkpoint.policy import Checkpointer

    Checkpointer.save = lambda self, step, *, stop: stop
    Checkpointer.export = lambda self, out_dir: Path(out_dir)


if __name__ == "__main__":
    if os.environ.get("BENCH_COMMS_STEP"):
        count_comms_of_step(int(os.environ["BENCH_COMMS_STEP"]), os.environ["BENCH_COMMS_FILE"])
    if os.environ.get("BENCH_DEEPSPEED_DEFAULT_BUCKETS") == "1":
        zero_utils.run.accelerator._DEEPSPEED_AUTO_BUCKETS.clear()
    if os.environ.get("BENCH_DEEPSPEED_ZERO"):
        override_deepspeed_zero(json.loads(os.environ["BENCH_DEEPSPEED_ZERO"]))
    if os.environ.get("BENCH_ACCELERATE_FSDP2_PREP") == "1":
        accelerate_fsdp2_prep()
    if os.environ.get("BENCH_NO_CHECKPOINTS") == "1":
        no_checkpoints()
    if os.environ.get("BENCH_ACCELERATE_ACCUMULATION") == "1":
        accelerate_default_accumulation()
    # The recipe runs through the test harness, which adds the per-rank evidence (sharding_per_rank, ...) to
    # summary.json from outside (tests/scripts/harness.py): benchmarks/run.py compares FSDP2 units from it.
    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    import harness

    harness.main()
