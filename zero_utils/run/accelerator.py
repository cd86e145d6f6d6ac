"""Build the `Accelerator` for this launch, so the engine the accelerate YAML names is the engine that runs.

Owns: the launch environment `accelerate launch` exports, the CPU (gloo) adaptations, the torchrun restart
workaround, the DeepSpeed config values the recipe flags decide (micro-batch, accumulation, clipping, bucket
sizes) and the check that the engine built is the engine asked for.

On a machine without CUDA, accelerate 1.15 silently degrades two launches (docs/CPU.md):
- an FSDP launch becomes N independent single-process trainings that all believe they are rank 0;
- a DDP (MULTI_GPU) launch shards the data but never synchronises gradients.
`build_accelerator` prepares accelerate's shared state so that FSDP2, DDP and DeepSpeed all run for real over
gloo on CPU, and `check_launch` fails loudly if the result still differs from what the launch asked for. On a GPU
machine none of this applies and accelerate's own path (NCCL) is used unchanged: the CPU branch below is the only
place the training logic depends on the device.

The recipe's flags are the single source of truth for accumulation, clipping and micro-batch size: they are
written into the DeepSpeed config here, and a YAML that sets them too is an error rather than a silent override.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch

from zero_utils.run import compiling, distributed
from zero_utils.run.engine import Engine, sequence_parallel_size
from zero_utils.run.errors import UserError

logger = logging.getLogger(__name__)

# DeepSpeed keys whose built-in defaults are sized for big models (a 5e8-element ZeRO-3 reduce bucket is 2 GB per
# rank whatever the model): "auto" here, then `deepspeed_setup.size_deepspeed_buckets` (or else accelerate's
# `prepare`) sizes them from the model. Values are the ZeRO stages each key applies to.
_DEEPSPEED_AUTO_BUCKETS = {
    "reduce_bucket_size": (1, 2, 3),
    "stage3_prefetch_bucket_size": (3,),
    "stage3_param_persistence_threshold": (3,),
}



def _launch_env() -> dict:
    env = os.environ
    return {
        "world_size": int(env.get("WORLD_SIZE", "1")),
        "under_launcher": "LOCAL_RANK" in env or "WORLD_SIZE" in env,
        "fsdp": env.get("ACCELERATE_USE_FSDP", "false").lower() == "true",
        "deepspeed": env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true",
        "fsdp_version": int(env.get("FSDP_VERSION", "2") or 2),
    }


def requested_engine_family() -> str:
    """The engine family (`Engine.family`: one of `engine.FAMILIES`) the launch asked for, read from the environment
    `accelerate launch` exports: 'deepspeed', 'fsdp2', 'ddp' (several processes, no engine named) or 'single'."""
    launch = _launch_env()
    if launch["deepspeed"]:
        return "deepspeed"
    if launch["fsdp"]:
        return "fsdp2"
    return "ddp" if launch["world_size"] > 1 else "single"


def _check_no_duplicate_setting(env_key: str, flag: str, value) -> None:
    """A YAML that also sets a recipe flag would silently win inside accelerate/DeepSpeed: refuse it."""
    yaml_value = os.environ.get(env_key)
    if yaml_value is None or yaml_value.lower() in ("auto", "none"):
        return
    if float(yaml_value) != float(value):
        raise UserError(f"the accelerate config sets {env_key.split('ACCELERATE_')[-1].lower()}={yaml_value} but "
                        f"{flag} is {value}; remove it from the YAML: the recipe flag decides.")


def build_accelerator(*, per_device_batch_size: int, gradient_accumulation_steps: int, max_grad_norm: float,
                      log_with: str | list | None = None, project_dir: str | None = None, timeout_s: int = 1800,
                      wait_limit_s: float = 0):
    """Create the Accelerator for the engine the launch asked for (DDP, DeepSpeed ZeRO-1/2/3, FSDP2), on GPU or CPU.

    Args:
        per_device_batch_size: micro-batch rows per process (DeepSpeed's `train_micro_batch_size_per_gpu`).
        gradient_accumulation_steps: micro-batches per optimizer step (also written into DeepSpeed's config).
            [FSDP2] every micro-batch's gradients are reduce-scattered into the shards (accelerate's
            `sync_each_batch`): between micro-batches a rank holds 1/N of the gradients, as at the update.
        max_grad_norm: clipping threshold (DeepSpeed clips inside its engine: written as `gradient_clipping`).
        log_with, project_dir: passed to `Accelerator` for trackers.
        timeout_s: collective timeout: a rank waiting this long for a dead peer raises instead of hanging.
        wait_limit_s: the longest a rank waits, outside collectives, for work one process per job or per node does
            alone (data preparation, a download, rank 0 reading the weights, the export:
            `distributed.run_on_main_process`); 0 = as long as it takes.

    Returns the `Accelerator` and the `Engine` it runs (`Engine.of`: what the YAML decided). Raises `RuntimeError`
    if the result is not the engine the launch named. A launch that names no ZeRO engine (plain DDP, or one
    process) says in one line which `--config_file` gives ZeRO-3.
    """
    from accelerate import Accelerator, DistributedType
    from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin, InitProcessGroupKwargs

    distributed.set_wait_limit(wait_limit_s)
    launch = _launch_env()
    family = requested_engine_family()
    sp = sequence_parallel_size()
    if sp > 1 and family != "deepspeed":
        raise UserError(f"sequence parallelism (parallelism_config_sp_size {sp}) runs under DeepSpeed ZeRO only "
                        "(accelerate's Ulysses backend): launch with accelerate_configs/zero3_sp.yaml or "
                        "zero2_sp.yaml.")
    if family == "fsdp2" and launch["fsdp_version"] != 2:
        raise UserError("the accelerate config asks for FSDP version 1; these recipes use FSDP2: set fsdp_version: 2.")
    if family == "deepspeed":
        _check_no_duplicate_setting("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "--gradient_accumulation_steps",
                                    gradient_accumulation_steps)
        _check_no_duplicate_setting("ACCELERATE_GRADIENT_CLIPPING", "--max_grad_norm", max_grad_norm)
        # [SP] each group of sp ranks trains the micro-batches of its sp members one after another, each rank holding
        # 1/sp of every sequence: sp x the micro-steps per optimizer step (zero_utils.data.training.TrainingData)
        gradient_accumulation_steps *= sp
        os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(gradient_accumulation_steps)
        os.environ["ACCELERATE_GRADIENT_CLIPPING"] = str(max_grad_norm)

    if family == "deepspeed":  # Accelerator() below JIT-loads DeepSpeed's ops (on CPU, the shm comm op)
        check_extension_locks()
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs_handlers = [InitProcessGroupKwargs(timeout=timeout)]
    on_cpu = not torch.cuda.is_available()
    _init_process_group_after_restart(timeout, backend="gloo" if on_cpu else None)
    if on_cpu and launch["under_launcher"]:
        kwargs_handlers = adapt_cpu_launch(family, timeout) or kwargs_handlers
    if family == "ddp":
        # Gradients become views into DDP's reducer buckets instead of a second copy (-4 bytes/param).
        kwargs_handlers.append(DistributedDataParallelKwargs(gradient_as_bucket_view=True))

    if family == "fsdp2":
        # [FSDP2] Reduce-scatter the gradients of every micro-batch, so that between micro-batches a rank holds only
        # its gradient shard. accelerate's default turns FSDP2's gradient sync off for every micro-batch but the last,
        # and FSDP2 then keeps the whole model's *unsharded* gradients on every rank until it (torch
        # `FSDPParam.unsharded_accumulated_grad`): 4 bytes/param on every rank, not 4/N. Cost: one reduce-scatter per
        # micro-batch instead of one per step (docs/MEMORY.md). For FSDP2 only: accelerate applies `sync_each_batch`
        # to every engine, and DDP would then all-reduce every micro-batch for no memory saved.
        accumulation = {"gradient_accumulation_plugin": GradientAccumulationPlugin(
            num_steps=gradient_accumulation_steps, sync_each_batch=True)}
    else:
        accumulation = {"gradient_accumulation_steps": gradient_accumulation_steps}
    if on_cpu:
        _run_fp32_without_native_bf16()
    compiling.compile_settings()  # a whole-model compile is refused here, on every rank, before any work
    # accelerate never compiles itself: zero_utils.model.parallelize compiles each block in place (under DDP
    # accelerate's compile_regions would copy the model, renaming its parameters, and compile the chunked head)
    accelerator = Accelerator(**accumulation, log_with=log_with, project_dir=project_dir,
                              kwargs_handlers=kwargs_handlers, dynamo_backend="no")

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        _configure_deepspeed(accelerator, per_device_batch_size, gradient_accumulation_steps, max_grad_norm)
    if accelerator.distributed_type == DistributedType.FSDP:
        check_fsdp_settings(accelerator.state.fsdp_plugin)
        if on_cpu:
            _adapt_fsdp_offload_for_cpu(accelerator)
    check_launch(accelerator)
    engine = Engine.of(accelerator)
    threads = use_cores_for_host_steps(engine)
    if threads:
        accelerator.print(f"{engine}: the optimizer steps on the host, so each process runs {threads} threads (this "
                          f"node's cores / its processes), not the launcher's OMP_NUM_THREADS=1; export "
                          "OMP_NUM_THREADS to choose another number.")
    if engine.is_data_parallel_only:
        accelerator.print(f"no ZeRO engine named by the launch: running {engine}. For ZeRO-3 add --config_file "
                          "accelerate_configs/fsdp2.yaml (or zero3.yaml for DeepSpeed) to accelerate launch.")
    return accelerator, engine


# oneDNN's ISA names (`ONEDNN_MAX_CPU_ISA`, its older `DNNL_MAX_CPU_ISA`) that stop below bf16 instructions
_ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
FORCE_CPU_BF16 = "ZERO_RECIPES_CPU_BF16"  # "1": run bf16 on a CPU without native bf16 all the same


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls in hardware: AVX512-BF16 or AMX (`torch.cpu`'s checks), unless oneDNN
    is capped below them (`ONEDNN_MAX_CPU_ISA=AVX2`, say). Without it a bf16 matmul is emulated, about 80x slower
    than fp32 (512x512x512: 317 ms against 3.8 ms on an AVX2 AMD EPYC, one thread)."""
    capped = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if capped in _ONEDNN_ISAS_WITHOUT_BF16:
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_mixed_precision(requested: str, *, native_bf16: bool, forced: bool) -> tuple[str, str | None]:
    """[CPU] The mixed precision a CPU run uses for the `requested` one (accelerate's 'no', 'bf16', 'fp16'), and the
    line that says why when it is not the requested one: bf16 without native bf16 runs fp32 ('no') unless
    `forced`. GPUs never come here."""
    if requested != "bf16" or native_bf16 or forced:
        return requested, None
    return "no", (f"mixed precision: fp32, not the launch's bf16: this CPU has no native bf16 (no AVX512-BF16 or AMX), "
                  f"where a bf16 matmul is about 80x slower than fp32; export {FORCE_CPU_BF16}=1 to run bf16 anyway.")


def _run_fp32_without_native_bf16() -> None:
    """[CPU] Before the Accelerator reads it: a bf16 launch on a CPU without native bf16 runs fp32, said once."""
    requested = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    precision, line = cpu_mixed_precision(requested, native_bf16=cpu_has_native_bf16(),
                                          forced=os.environ.get(FORCE_CPU_BF16) == "1")
    if line:
        os.environ["ACCELERATE_MIXED_PRECISION"] = precision
        if int(os.environ.get("RANK", "0")) == 0:
            print(line, flush=True)


def use_cores_for_host_steps(engine: Engine, *, cores: int | None = None,
                             local_processes: int | None = None) -> int | None:
    """[offload] Under zero3_offload and fsdp2_offload the optimizer steps on the host (DeepSpeed's CPU Adam, torch's
    AdamW on CPU shards), one process per GPU; `accelerate launch` sets OMP_NUM_THREADS=1 in each unless you export
    it, so those steps would run on one core each while the node's others idle. Give each process its share:
    `torch.set_num_threads(cores // local processes)`, `cores` the CPUs this process may run on
    (`os.sched_getaffinity`: a SLURM allocation or cgroup cpuset counts), `local_processes` the node's
    (LOCAL_WORLD_SIZE).
    Returns the threads set, or None where nothing changes: no offload, OMP_NUM_THREADS exported above 1, or no
    more than one core per process. Engines: the offload configs."""
    if not engine.offload or int(os.environ.get("OMP_NUM_THREADS") or 1) > 1:
        return None
    cores = cores or len(os.sched_getaffinity(0))
    local_processes = local_processes or int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    threads = cores // local_processes
    if threads <= 1:
        return None
    torch.set_num_threads(threads)
    return threads


def close_and_exit(accelerator) -> None:
    """End the run on every rank: close the trackers (W&B flushes) and the process group, then exit the process
    at once with status 0 (`os._exit`: nothing after this call runs).

    Exiting without Python's interpreter finalization is deliberate: with gloo, a rank whose peers have already
    torn down their connections can abort during finalization ("terminate called without an active exception";
    pytorch/pytorch#179291), turning a finished run into a failed job. Everything is written and closed here.
    """
    import sys

    accelerator.wait_for_everyone()
    accelerator.end_training()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


STALE_LOCK_AGE_S = 300  # DeepSpeed's CPU ops build here in 30-45 s each (.ci/run); a lock this old is abandoned


def check_extension_locks(max_age_s: float = STALE_LOCK_AGE_S) -> None:
    """Raise `UserError` naming a torch-extensions `lock` file older than `max_age_s` seconds.

    DeepSpeed loads its ops through torch's extension loader, which takes `<extensions dir>/<op>/lock` on every
    load and waits on an existing one forever, without a message (torch `FileBaton`). A build ended by SIGKILL,
    a plain SIGTERM or the OOM killer leaves it behind, and every later DeepSpeed launch then hangs at 0% CPU. The
    lock names no owner and the folder may be shared between nodes, so it is reported, never removed. The folder
    is torch's: `TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions/<python>_<device>`. Engines: DeepSpeed.
    """
    import glob
    import time

    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    patterns = [os.path.join(root, "*", "lock")] if root else [os.path.join(get_default_build_root(), "*", "*", "lock")]
    now = time.time()
    for lock in sorted(path for pattern in patterns for path in glob.glob(pattern)):
        try:
            age_s = now - os.path.getmtime(lock)
        except FileNotFoundError:  # a build that just finished removed it
            continue
        if age_s > max_age_s:
            raise UserError(f"{lock} is {age_s / 60:.0f} minutes old: a DeepSpeed op build was killed and every "
                            "DeepSpeed launch would wait on it forever; if no build is running (on any node sharing "
                            f"this folder), remove it: rm {lock}")


def adapt_cpu_launch(family: str, timeout: datetime.timedelta) -> list:
    """[CPU] accelerate selects FSDP and DDP only for accelerator devices: a CPU launch of fsdp2.yaml would silently
    run DDP. For `family` ('fsdp2', 'ddp', 'deepspeed'), initialise gloo and tell accelerate's shared state which
    branch to take (verified against accelerate 1.15; a test fails if this changes), before any `Accelerator`
    exists: ours (`build_accelerator`) or another library's (a transformers Trainer: benchmarks/trl_dpo.py). Returns
    the kwargs handlers an `Accelerator` of ours takes for DeepSpeed (gloo), else []."""
    from accelerate import DistributedType, PartialState
    from accelerate.utils import InitProcessGroupKwargs

    if family in ("fsdp2", "ddp"):
        PartialState(backend="gloo", timeout=timeout)
        PartialState._shared_state["distributed_type"] = (DistributedType.MULTI_GPU if family == "fsdp2"
                                                          else DistributedType.MULTI_CPU)
        return []
    if family == "deepspeed":
        return [InitProcessGroupKwargs(backend="gloo", timeout=timeout)]
    return []


def _init_process_group_after_restart(timeout: datetime.timedelta, backend: str | None) -> None:
    """After an in-place restart by torchrun (`--max_restarts`), join a process group whose rendezvous keys are
    this attempt's own.

    The restarted workers reuse the launcher agent's TCPStore (static and c10d rendezvous alike), and the default
    `env://` rendezvous reads it without a per-attempt prefix (torch 2.13 `_create_c10d_store` assumes a new store
    per retry). A restarted rank can then read a dead peer's address left by the failed attempt: gloo's
    connectFullMesh fails with "Connection refused" whenever the restarted peer has not yet overwritten it
    (3 of 4 restarts here). Prefixing the store with the attempt number, as a fresh store would be, makes every
    restart join cleanly (5 of 5). Accelerate and DeepSpeed then use this group instead of creating one. On CUDA
    the backend is torch's default pair (nccl for CUDA tensors, gloo for CPU tensors), a superset of what
    accelerate picks; the first attempt is left entirely to accelerate.
    """
    import torch.distributed as dist

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"/zero_recipes/attempt_{attempt}", agent_store),
                            rank=rank, world_size=world_size, timeout=timeout)
    logger.info("joined the process group of restart attempt %d", attempt)


def _configure_deepspeed(accelerator, per_device_batch_size, gradient_accumulation_steps, max_grad_norm) -> None:
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    stage = config["zero_optimization"]["stage"]
    config["train_micro_batch_size_per_gpu"] = per_device_batch_size
    config["train_batch_size"] = per_device_batch_size * gradient_accumulation_steps * accelerator.num_processes
    config["gradient_accumulation_steps"] = gradient_accumulation_steps
    config["gradient_clipping"] = max_grad_norm
    for key, stages in _DEEPSPEED_AUTO_BUCKETS.items():
        if stage in stages:
            config["zero_optimization"].setdefault(key, "auto")
    if stage == 3 and accelerator.mixed_precision in ("bf16", "fp16"):
        # Reduce and keep gradient partitions in fp32, as FSDP2 does (reduce_dtype fp32): DeepSpeed's default reduces
        # in the 16-bit dtype and accumulates micro-batches in a 16-bit partition, rounding every gradient
        # (docs/PRECISION.md; +2 bytes/param/N). A DeepSpeed config file of your own that sets them wins.
        config.setdefault("communication_data_type", "fp32")
        config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")


def _adapt_fsdp_offload_for_cpu(accelerator) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = accelerator.state.fsdp_plugin
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) and plugin.cpu_offload.pin_memory:
        # Pinned host memory needs an accelerator device; without one FSDP2 fails with "Cannot access accelerator
        # device". Offload itself (optimizer step on CPU-resident shards) still runs.
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
        if accelerator.is_main_process:
            print("[zero_utils] no GPU: FSDP2 CPU offload runs with pin_memory=False (pinned memory needs a GPU).")


def check_fsdp_settings(plugin) -> None:
    """Refuse, with one sentence, an accelerate YAML FSDP setting the recipes would otherwise skip:
    `fsdp_activation_checkpointing_offload` (accelerate's `offload_wrapper`, applied only with accelerate's own
    checkpointing, which `zero_utils.model.wrapping` replaces by the recipes'). Engines: FSDP2."""
    if getattr(plugin, "activation_checkpointing_offload", False):
        raise UserError("fsdp_activation_checkpointing_offload in the accelerate YAML is accelerate's own offloading, "
                        "which these recipes' checkpointing replaces (it would be skipped): remove it and pass "
                        "--gradient_checkpointing --activation_offloading to the recipe.")


def check_launch(accelerator) -> None:
    """Raise `RuntimeError` unless the Accelerator runs the engine and world size the launch asked for.

    Catches accelerate's silent CPU fallbacks (every rank training alone as 'rank 0', or DDP without gradient
    sync): with the launcher's WORLD_SIZE=N, the accelerator must see N processes and the requested engine.
    """
    from accelerate import DistributedType

    launch = _launch_env()
    family = requested_engine_family()
    expected_type = {"fsdp2": DistributedType.FSDP, "deepspeed": DistributedType.DEEPSPEED}.get(family)
    problems = []
    if accelerator.num_processes != launch["world_size"]:
        problems.append(f"{accelerator.num_processes} process(es) instead of the launched {launch['world_size']}")
    if expected_type is not None and accelerator.distributed_type != expected_type:
        problems.append(f"engine {accelerator.distributed_type} instead of {expected_type}")
    if family == "ddp" and accelerator.distributed_type == DistributedType.NO:
        problems.append("no data parallelism (gradients would never be synchronised)")
    if problems:
        raise RuntimeError("accelerate did not build the requested engine: " + "; ".join(problems) + ". This is "
                           "accelerate's silent CPU fallback (docs/CPU.md); check the accelerate version.")
