"""Which engine a run uses, as a value: family, ZeRO stage, offload, checkpoint storage, parameter sharding.

The accelerate YAML decides the engine; `Engine.of(accelerator)` reads what actually runs from the Accelerator's
state (never from the YAML's file name), and `Engine.parse(name)` reads the names the memory estimator and our
checkpoints use. Code asks an `Engine` what it needs (`engine.is_deepspeed`, `engine.shards_params`,
`engine.zero_stage`) instead of matching name prefixes; it is the only engine vocabulary of zero_utils (the memory
estimator's engines and `accelerate_configs/<engine.name>.yaml` included).

    name            family     ZeRO stage  what each rank holds
    single          single     0           everything (one process)
    ddp             ddp        0           everything (a replica)
    zero1           deepspeed  1           whole params and grads, 1/N of the optimizer state
    zero2           deepspeed  2           whole params, 1/N of grads and optimizer state
    zero3           deepspeed  3           1/N of everything
    fsdp2           fsdp2      3           1/N of everything (each block regathered for backward)
    fsdp2_zero2     fsdp2      2           1/N at rest; each block stays gathered from its forward to its backward
    fsdp2_hsdp      fsdp2      3           1/N within a shard group, replicated across groups
    *_offload                              the same, with the sharded states in CPU memory (zero3, fsdp2*)

It imports nothing else from zero_utils.
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("single", "ddp", "deepspeed", "fsdp2")


@dataclass(frozen=True)
class Engine:
    """One training engine. `zero_stage` says what is sharded across ranks: 0 nothing, 1 optimizer state,
    2 + gradients, 3 + parameters (FSDP2 is stage 3, or 2 when blocks stay gathered between forward and backward).
    `offload`: sharded states live in CPU memory. `hsdp`: FSDP2 shards within groups and replicates across them."""

    family: str
    zero_stage: int = 0
    offload: bool = False
    hsdp: bool = False

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown engine family {self.family!r}; one of {FAMILIES}")

    @property
    def name(self) -> str:
        """'single', 'ddp', 'zero1'..'zero3', 'fsdp2', 'fsdp2_zero2', 'fsdp2_hsdp', each + '_offload' if offloaded."""
        if self.family in ("single", "ddp"):
            base = self.family
        elif self.family == "deepspeed":
            base = f"zero{self.zero_stage}"
        else:
            base = "fsdp2_hsdp" if self.hsdp else "fsdp2" if self.zero_stage == 3 else "fsdp2_zero2"
        return base + ("_offload" if self.offload else "")

    def __str__(self) -> str:
        return self.name

    @property
    def is_deepspeed(self) -> bool:
        return self.family == "deepspeed"

    @property
    def is_fsdp2(self) -> bool:
        return self.family == "fsdp2"

    @property
    def is_data_parallel_only(self) -> bool:
        """single or DDP: no ZeRO sharding at all."""
        return self.family in ("single", "ddp")

    @property
    def shards_params(self) -> bool:
        """Whether a rank holds only a shard of each parameter between steps (ZeRO-3, every FSDP2 variant)."""
        return self.is_fsdp2 or (self.is_deepspeed and self.zero_stage == 3)

    @classmethod
    def parse(cls, name: str) -> Engine:
        """The engine a name (as `Engine.name` writes it) stands for; `ValueError` for any other name."""
        base = name.removesuffix("_offload")
        offload = base != name
        table = {"single": cls("single"), "ddp": cls("ddp"), "zero1": cls("deepspeed", 1), "zero2": cls("deepspeed", 2),
                 "zero3": cls("deepspeed", 3), "fsdp2": cls("fsdp2", 3), "fsdp2_zero2": cls("fsdp2", 2),
                 "fsdp2_hsdp": cls("fsdp2", 3, hsdp=True)}
        if base not in table or (offload and table[base].is_data_parallel_only):
            raise ValueError(f"unknown engine {name!r}")
        engine = table[base]
        return cls(engine.family, engine.zero_stage, offload, engine.hsdp)

    @classmethod
    def of(cls, accelerator) -> Engine:
        """The engine this Accelerator runs, read from its state (DeepSpeed config, FSDP plugin, parallelism
        config). Engines: all."""
        from accelerate import DistributedType

        state = accelerator.state
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            zero = state.deepspeed_plugin.deepspeed_config["zero_optimization"]
            devices = [str(zero.get(k, {}).get("device", "none")) for k in ("offload_optimizer", "offload_param")]
            return cls("deepspeed", int(zero["stage"]), offload=any(d not in ("none", "None") for d in devices))
        if accelerator.distributed_type == DistributedType.FSDP:
            from torch.distributed.fsdp import CPUOffloadPolicy

            plugin = state.fsdp_plugin
            config = getattr(accelerator, "parallelism_config", None)
            hsdp = bool(config is not None and config.dp_replicate_enabled)
            return cls("fsdp2", 3 if plugin.reshard_after_forward else 2,
                       offload=isinstance(plugin.cpu_offload, CPUOffloadPolicy), hsdp=hsdp)
        if accelerator.distributed_type == DistributedType.NO:
            return cls("single")
        return cls("ddp")


def shard_group_size(accelerator) -> int:
    """Ranks that share one copy of the sharded states: the shard group under FSDP2 HSDP (dp_shard_size), else
    every rank."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and config.dp_replicate_enabled:
        return config.dp_shard_size
    return accelerator.num_processes


def sequence_parallel_size() -> int:
    """The launch's DeepSpeed Ulysses sequence-parallel size: the accelerate YAML's `parallelism_config_sp_size` (or
    `accelerate launch --parallelism_config_sp_size N`) when its `parallelism_config:` block is on and its backend
    is deepspeed, which `accelerate launch` hands to each process as PARALLELISM_CONFIG_SP_SIZE; 1 without SP. Read
    from the environment, so it is known before the Accelerator exists. Engines: DeepSpeed ZeRO (accelerate offers
    no Ulysses SP under FSDP2 or DDP)."""
    import os

    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() != "true":
        return 1
    if os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed") != "deepspeed":
        return 1
    return int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1"))


def sequence_parallel_gradient_factor(accelerator, sp: int) -> int:
    """What the recipes' loss scale is multiplied by under DeepSpeed Ulysses SP of size `sp` so that the gradient
    stays d(sum of token losses)/d(theta) / tokens: sp under ZeRO-3 with its default reduce-scatter, whose average
    is over every rank, 1 elsewhere. ZeRO-1/2 (and ZeRO-3's all-reduce path, `reduce_scatter: false`) divide by the
    data-parallel size and sum over the SP ranks, which is what each rank's share of a sequence needs
    (deepspeed/runtime/zero/stage3.py: `__avg_scatter_grads` against `__avg_scatter_contiguous_grads`). Measured:
    ZeRO-3 sp 2 without it trained with half the gradient norm of the run without SP
    (tests/test_sequence_parallel.py)."""
    if sp == 1 or getattr(accelerator.state, "deepspeed_plugin", None) is None:
        return 1
    zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
    return sp if zero.get("stage") == 3 and zero.get("reduce_scatter", True) is not False else 1
