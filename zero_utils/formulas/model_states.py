"""Memory per GPU, predicted by formula: bytes of each engine's model states, activations and transient buffers,
and DeepSpeed's bucket sizes. Pure arithmetic on counts and sizes (no torch.distributed, no accelerate): the
estimator (zero_utils.memory.estimate) and the run's own report (zero_utils.train.measurement) both read it.
What a rank really holds is measured by zero_utils.train.measurement.

Model states are parameters + gradients + optimizer state (AdamW: an fp32 master copy where the engine keeps one,
plus two fp32 moments). Formulas (Psi = trainable parameters, N = ranks sharing the shards; the ZeRO paper's
mixed-precision Adam has K = 12):

    engine       mixed precision (bf16)          fp32 training, as each engine stores it right after the step
    ddp          16 Psi                          16 Psi (params 4 + grads 4 + Adam 8)
    zero1/zero2  2 Psi + 18 Psi / N (grads: an   4 Psi + 16 Psi / N (fp32 params; fp32 master 4, Adam 8 and an
                 fp32 partition + the 16-bit     fp32 gradient partition 4, all partitioned)
                 grads of ~1/N whole params)
    zero1, before its reduction (the last micro-batch's backward): whole gradients, 4 Psi + 12 Psi / N in mixed
                 precision (the paper's), 8 Psi + 12 Psi / N in fp32; counted where it is more (N > 3, N > 2)
    zero3        22 Psi / N (params 2, grads     24 Psi / N (params 4, master 4, Adam 8, grads 4 + 4, partitioned)
                 4 + 4, master 4, Adam 8)
    fsdp2        16 Psi / N                      16 Psi / N (no master copy: the fp32 shard is the master)
    The ZeRO paper (formula="paper"): DDP 16 Psi, ZeRO-1 4 Psi + 12 Psi / N, ZeRO-2 2 Psi + 14 Psi / N,
    ZeRO-3 16 Psi / N.

The fp32 column is what DeepSpeed 0.19.8 and torch 2.13 were measured to hold (docs/MEMORY.md). Engines:
ddp, single, zero1, zero2, zero3 (+_offload), fsdp2, fsdp2_zero2 (+_offload). Units: bytes.

Activations per micro-batch (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1, no tensor/sequence parallelism; s = seq_len, b = micro-batch, h = hidden, a = heads,
I = intermediate size, L = layers, V = vocab), in bytes for 16-bit activations:
    per layer  s*b*h*(34 + 5*a*s/h) = attention 11 sbh + 5 a s^2 b, MLP 19 sbh, two norms 4 sbh.
    Their MLP is GPT's (I = 4h): 19 sbh = sb*(3h + 4I). A gated (SwiGLU, Llama) MLP keeps two more I-wide
    tensors: sb*(3h + 8I). Flash/sdpa attention keeps no s x s matrices: the 5 a s^2 b term disappears.
    With activation checkpointing only each layer's input (2 sbh) is kept, plus one layer's full activations
    while it is recomputed. Logits add s*b*V*(2 + 4) (16-bit logits and their fp32 upcast for the loss); with
    the recipes' --loss_chunk_tokens C (zero_utils.train.token_loss) only min(C, s*b) tokens' logits exist at once.
    fp32 training doubles the layer terms (4-byte activations).

Transient peaks (engine buffers and gathered parameters, in the compute dtype, on top of model states):
    single       none.
    ddp          one 25 MiB gradient bucket (gradients are views into the buckets: gradient_as_bucket_view=True).
    zero1/zero2  reduce bucket + allgather bucket (DeepSpeed default 5e8 elements).
    zero3        live parameters (stage3_max_live_parameters, 1e9 elements, an upper bound) + reduce bucket
                 (in fp32: the recipe reduces gradients in fp32) + prefetch bucket + persistent small params
                 (<= 10 h elements each). Bucket sizes are `deepspeed_bucket_elements` below (what the recipe
                 writes into DeepSpeed's config): accelerate's "auto" (h^2, 0.9 h^2 elements), at least 25 MiB of
                 fp32 elements each.
    fsdp2        the output-head group, kept gathered (zero_utils.model.wrapping), + the unit being computed and the
                 prefetched next one (2 x the largest unit) + that unit's gradient during backward.
    fsdp2_zero2  every unit stays gathered from its forward to its backward: the whole model + one unit's gradient.
Buckets never exceed the model. Engines are `Engine` values (zero_utils.run.engine); units: bytes, and elements for
buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero_utils.run.engine import Engine
from zero_utils.run.errors import UserError

OPTIMIZERS = ("adamw", "sgd")
_KINDS = ("params", "grads", "optimizer")


# Bytes per trainable parameter one rank holds right after the optimizer step, by kind, each as
# (replicated on every rank, divided over the shard group). master = fp32 copy the optimizer updates (none where the
# fp32 params are the master); moments = AdamW's two fp32 moments. This table is the one source of truth: the CLI
# and the recipe's `model_state_bytes_expected` both read it through `model_state_bytes`.
# "fp32" and "mixed" are MEASURED from live tensors (DeepSpeed 0.19.8, torch 2.13, accelerate 1.15; 2 and 4 ranks;
# docs/MEMORY.md): re-measure before editing. DeepSpeed keeps more than the paper: an fp32 gradient partition
# next to its reduced one (ZeRO-3: grads 4 + 4; in mixed precision the recipe keeps the reduced partition in fp32,
# as FSDP2 reduces, where DeepSpeed's default is 16-bit: docs/PRECISION.md), and under ZeRO-1/2 the gradients of
# the whole parameters that overlap the rank's partition (~1/N of them, counted here as (0, 2|4); the parameters
# cut by a partition border are added exactly by `expected_model_state_bytes(..., param_groups=...)`).
_BYTES_PER_PARAM = {
    "fp32": {
        "ddp": {"params": (4, 0), "grads": (4, 0), "master": (0, 0), "moments": (8, 0)},
        "zero1": {"params": (4, 0), "grads": (0, 8), "master": (0, 4), "moments": (0, 8)},
        "zero2": {"params": (4, 0), "grads": (0, 8), "master": (0, 4), "moments": (0, 8)},
        "zero3": {"params": (0, 4), "grads": (0, 8), "master": (0, 4), "moments": (0, 8)},
        "fsdp2": {"params": (0, 4), "grads": (0, 4), "master": (0, 0), "moments": (0, 8)},
    },
    # bf16 mixed precision. DDP and FSDP2 under accelerate keep fp32 params that are themselves the master
    # (autocast / MixedPrecisionPolicy with fp32 reduction).
    "mixed": {
        "ddp": {"params": (4, 0), "grads": (4, 0), "master": (0, 0), "moments": (8, 0)},
        "zero1": {"params": (2, 0), "grads": (0, 6), "master": (0, 4), "moments": (0, 8)},
        "zero2": {"params": (2, 0), "grads": (0, 6), "master": (0, 4), "moments": (0, 8)},
        "zero3": {"params": (0, 2), "grads": (0, 8), "master": (0, 4), "moments": (0, 8)},
        "fsdp2": {"params": (0, 4), "grads": (0, 4), "master": (0, 0), "moments": (0, 8)},
    },
    # The ZeRO paper's mixed-precision Adam (Rajbhandari et al. 2020, section 3.1: 2 + 2 + K=12 bytes): the
    # textbook formula, `formula="paper"`. FSDP2 is the paper's ZeRO-3 (P_os+g+p).
    "paper": {
        "ddp": {"params": (2, 0), "grads": (2, 0), "master": (4, 0), "moments": (8, 0)},
        "zero1": {"params": (2, 0), "grads": (2, 0), "master": (0, 4), "moments": (0, 8)},
        "zero2": {"params": (2, 0), "grads": (0, 2), "master": (0, 4), "moments": (0, 8)},
        "zero3": {"params": (0, 2), "grads": (0, 2), "master": (0, 4), "moments": (0, 8)},
        "fsdp2": {"params": (0, 2), "grads": (0, 2), "master": (0, 4), "moments": (0, 8)},
    },
}


# ZeRO-1 reduces gradients only at a step's last micro-batch (DeepSpeed stage 1 does not partition them during
# backward): until that reduction every rank holds the whole gradients of every parameter next to its partitioned
# master and moments, more than the row above for N > 2 (fp32) or N > 3 (mixed precision). MEASURED between
# micro-batches (accumulation 2, 4 ranks: 11.00 bytes/param in fp32 = 4 + 4 + 12 / 4). The same whole gradients
# exist at accumulation 1 too, for the moment between the backward pass and the reduction inside DeepSpeed's step.
# Under the other engines nothing held between micro-batches exceeds the row above (FSDP2: the recipe reduce-
# scatters every micro-batch, zero_utils.run.accelerator); the paper's ZeRO-1 row already counts whole gradients.
_ZERO1_BEFORE_REDUCTION = {
    "fp32": {"params": (4, 0), "grads": (4, 0), "master": (0, 4), "moments": (0, 8)},
    "mixed": {"params": (2, 0), "grads": (2, 0), "master": (0, 4), "moments": (0, 8)},
}


def _table_row(engine: Engine) -> str:
    """The formula row an engine uses: FSDP2's variants store what fsdp2 stores; single process is DDP's row."""
    if engine.is_data_parallel_only:
        return "ddp"
    return "fsdp2" if engine.is_fsdp2 else f"zero{engine.zero_stage}"


def _precision(mixed_precision: str | None) -> str:
    if mixed_precision in (None, "no", "fp32"):
        return "fp32"
    if mixed_precision in ("bf16", "fp16", "fp8"):
        return "mixed"
    raise UserError(f"unknown precision {mixed_precision!r}; use fp32 (accelerate's 'no') or bf16.")



def _offloaded_kinds(engine: Engine, offload_optimizer: bool | None, offload_params: bool | None) -> set[str]:
    whole_params = engine.is_deepspeed and engine.zero_stage < 3  # ZeRO-1/2 keep whole parameters on every GPU
    optimizer = engine.offload if offload_optimizer is None else offload_optimizer
    params = (engine.offload and not whole_params) if offload_params is None else offload_params
    base = Engine(engine.family, engine.zero_stage, hsdp=engine.hsdp).name
    if engine.is_data_parallel_only and (optimizer or params):
        raise UserError(f"{base} cannot offload to the CPU; use zero3_offload or fsdp2_offload.")
    if whole_params and params:
        raise UserError(f"{base} keeps whole parameters on every GPU and cannot offload them; use zero3_offload.")
    if engine.is_fsdp2 and optimizer != params:
        raise UserError("FSDP2 offloads parameters, gradients and optimizer state together (CPUOffloadPolicy); "
                        "offload both or neither.")
    if engine.is_fsdp2:
        return set(_KINDS) if params else set()
    # DeepSpeed's CPU Adam updates the fp32 master on the host from gradient partitions copied there.
    return ({"grads", "optimizer"} if optimizer else set()) | ({"params"} if params else set())


@dataclass(frozen=True)
class ModelStateBytes:
    """Model-state bytes one rank holds, by kind ('params', 'grads', 'optimizer'), in GPU and in CPU memory."""

    gpu: dict
    cpu: dict

    @property
    def gpu_bytes(self) -> int:
        return sum(self.gpu.values())

    @property
    def cpu_bytes(self) -> int:
        return sum(self.cpu.values())

    @property
    def total_bytes(self) -> int:
        return self.gpu_bytes + self.cpu_bytes


def model_state_bytes(engine: Engine, num_params: int, world_size: int, mixed_precision: str | None = "no", *,
                      optimizer: str = "adamw", frozen_params: int = 0, shard_group_size: int | None = None,
                      offload_optimizer: bool | None = None, offload_params: bool | None = None,
                      formula: str = "engine", gradient_accumulation_steps: int | None = None) -> ModelStateBytes:
    """Bytes one rank holds in params, grads and optimizer state for `engine` (any engine, offloaded or
    not), `num_params` trainable parameters and `world_size` ranks.

    `mixed_precision`: accelerate's value ('no'/'fp32' or 'bf16'/'fp16'). `optimizer`: 'adamw' or 'sgd' (no
    momentum: no state but a master copy where the engine keeps one). `frozen_params` (LoRA's base weights): stored
    as the engine stores its parameters (fp32 under DDP autocast and FSDP2, 16-bit under DeepSpeed in mixed
    precision), no grads, no optimizer state, sharded where the engine shards params. `shard_group_size`
    (HSDP: GPUs per node) divides the sharded parts instead of `world_size`. Offload defaults to what the engine
    name says (`zero3_offload`: optimizer and params; `zeroK_offload`: optimizer; `fsdp2*_offload`: all); the
    offloaded sharded parts are counted in `cpu`, not `gpu`. `formula`: 'engine' (what DeepSpeed 0.19.8 / torch
    2.13 really hold, measured) or 'paper' (the ZeRO paper's 2 + 2 + 12 bytes, for mixed precision).

    The result is the most the rank holds during a step: right after the optimizer step, or [ZeRO-1] before its
    gradient reduction, with whole gradients on every rank, where that is more. `gradient_accumulation_steps`: None
    (the estimate: that peak) or what a run measures from outside the engine (`measurement.RunMeasurements`): at 1,
    ZeRO-1's reduction follows the backward inside DeepSpeed's step, unseen, so only the after-step bytes count.
    """
    if optimizer not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {optimizer!r}; use one of: {', '.join(OPTIMIZERS)}.")
    group = shard_group_size or world_size
    if group < 1 or world_size < 1:
        raise UserError(f"world size {world_size} (shard group {group}) must be at least 1.")
    if formula not in ("engine", "paper"):
        raise UserError(f"unknown formula {formula!r}; use 'engine' or 'paper'.")
    precision = _precision(mixed_precision)
    row = _BYTES_PER_PARAM["paper" if formula == "paper" else precision][_table_row(engine)]
    if formula == "engine" and _holds_whole_gradients(engine, group, precision, gradient_accumulation_steps):
        row = _ZERO1_BEFORE_REDUCTION[precision]
    on_cpu = _offloaded_kinds(engine, offload_optimizer, offload_params)
    moments = row["moments"] if optimizer == "adamw" else (0, 0)
    gpu, cpu = dict.fromkeys(_KINDS, 0), dict.fromkeys(_KINDS, 0)

    def add(kind: str, count: int, per_param: tuple[int, int]) -> None:
        replicated, sharded = per_param
        gpu[kind] += count * replicated
        (cpu if kind in on_cpu else gpu)[kind] += -(-count * sharded // group)  # a shard rounds up

    add("params", num_params, row["params"])
    add("grads", num_params, row["grads"])
    add("optimizer", num_params, (row["master"][0] + moments[0], row["master"][1] + moments[1]))
    add("params", frozen_params, row["params"])
    return ModelStateBytes(gpu, cpu)


def _holds_whole_gradients(engine: Engine, world_size: int, precision: str,
                           gradient_accumulation_steps: int | None) -> bool:
    """Whether ZeRO-1's moment before its reduction is the engine's peak and is counted (`model_state_bytes`)."""
    if _table_row(engine) != "zero1" or gradient_accumulation_steps == 1:
        return False
    bytes_of = {name: sum(r + s / world_size for r, s in table.values())
                for name, table in (("after", _BYTES_PER_PARAM[precision]["zero1"]),
                                    ("before", _ZERO1_BEFORE_REDUCTION[precision]))}
    return bytes_of["before"] > bytes_of["after"]


# What a preference loss compares the policy with (reference_model_bytes's `held_as`, or none)
REFERENCES = ("none", "model", "adapters", "precomputed")


def reference_model_bytes(engine: Engine, num_params: int, world_size: int, mixed_precision: str | None = "no", *,
                          shard_group_size: int | None = None, held_as: str = "model") -> tuple[int, int]:
    """(GPU, CPU) bytes one rank holds of a preference loss's frozen reference model
    (zero_utils.train.frozen_model). `held_as="model"` (recipes/llama_dpo.py): a frozen copy, its `num_params`
    parameters in the compute dtype (2 bytes under bf16/fp16 mixed precision, else 4), no grads, no optimizer state;
    divided over the shard group where the engine shards parameters (ZeRO-3, FSDP2), whole otherwise; in CPU memory
    where the engine offloads parameters (zero3_offload, fsdp2*_offload). `held_as="adapters"`
    (recipes/llama_dpo_lora.py): the LoRA policy's own forward with its adapters off, so no second model exists: (0, 0).
    `held_as="precomputed"` (recipes/llama_dpo.py
    --reference precomputed): the copy scores every pair before the policy is built and is freed, so training holds
    none of it (its log-probs, 8 bytes a pair, are left out): (0, 0). Engines: all."""
    if held_as in ("adapters", "precomputed"):
        return 0, 0
    element = 4 if _precision(mixed_precision) == "fp32" else 2
    group = shard_group_size or world_size
    held = -(-element * num_params // group) if engine.shards_params else element * num_params
    return (0, held) if engine.offload and engine.shards_params else (held, 0)


def expected_model_state_bytes(engine: Engine, num_params: int, world_size: int, mixed_precision: str = "no", *,
                               param_groups: list[list[tuple[int, ...]]] | None = None, **kwargs) -> int:
    """Model-state bytes one rank holds, GPU and CPU together (what `measure_model_state_bytes` walks), for
    `engine` (see the module table), `num_params` trainable parameters, `world_size` ranks and accelerate's
    `mixed_precision` ('no' = fp32, 'bf16'/'fp16' = mixed). Keyword arguments: those of `model_state_bytes`.

    `param_groups`: the shapes of the trainable parameters in optimizer order, one list per param group. With
    them the result is exact for the most loaded rank (the one `model_state_bytes` in metrics.jsonl reports):
    what cannot shard evenly is added, not hidden in a tolerance (`sharding_remainder_bytes`).
    """
    peak = model_state_bytes(engine, num_params, world_size, mixed_precision, **kwargs).total_bytes
    group = kwargs.get("shard_group_size") or world_size
    if param_groups is None or group == 1:
        return peak
    after_step = model_state_bytes(engine, num_params, world_size, mixed_precision,
                                   **{**kwargs, "gradient_accumulation_steps": 1}).total_bytes
    # [ZeRO-1] before its reduction the gradients are whole (no partition border to add), after it the border's are
    return max(peak, after_step + sharding_remainder_bytes(engine, param_groups, group, mixed_precision))


def sharding_remainder_bytes(engine: Engine, param_groups: list[list[tuple[int, ...]]], world_size: int,
                             mixed_precision: str = "no") -> int:
    """Bytes the most loaded rank holds beyond the even 1/N split of the module table, from the real layout:

    - FSDP2 shards every parameter on dim 0, padded: rank 0 holds ceil(dim0 / N) rows of each.
    - DeepSpeed ZeRO-3 partitions every parameter separately into ceil(numel / N) elements.
    - DeepSpeed ZeRO-1/2 flatten each param group (aligned to 2 N elements) into N equal partitions and keep the
      16-bit gradients of every whole parameter that overlaps the rank's partition (DeepSpeed's
      `params_in_partition`), so the parameters cut by a partition border count in full.
    Engines: fsdp2*, zero1, zero2, zero3 (+_offload); 0 for ddp/single.
    """
    n = world_size
    numels = [[numel(shape) for shape in group] for group in param_groups]
    total = sum(map(sum, numels))
    even = total / n
    precision = _precision(mixed_precision)
    row = _BYTES_PER_PARAM[precision][_table_row(engine)]
    sharded_bytes = sum(row[k][1] for k in ("params", "grads", "master", "moments"))
    if engine.is_fsdp2:
        held = sum(-(-shape[0] // n) * numel(shape[1:]) for group in param_groups for shape in group if shape)
        return round((held - even) * sharded_bytes)
    if engine.is_deepspeed and engine.zero_stage == 3:
        held = sum(-(-count // n) for group in numels for count in group)
        return round((held - even) * sharded_bytes)
    if engine.is_deepspeed:  # ZeRO-1/2
        grad_bytes = 4 if precision == "fp32" else 2  # the 16-bit (here: param-dtype) gradients of whole params
        in_partition = [0] * n
        for group in numels:
            padded = -(-sum(group) // (2 * n)) * 2 * n
            size = padded // n
            start = 0
            for count in group:
                first, last = start // size, (start + count - 1) // size
                for rank in range(first, min(last, n - 1) + 1):
                    in_partition[rank] += count
                start += count
        return round((max(in_partition) - even) * grad_bytes)
    return 0



def numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


@dataclass(frozen=True)
class Architecture:
    """The sizes activation and transient estimates need from a decoder, in elements (parameter counts)."""

    num_params: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int
    num_heads: int | None  # only eager attention needs it
    gated_mlp: bool
    block_params: int  # the largest decoder block (an FSDP2 unit)
    embed_params: int  # the input embedding's own FSDP2 unit (0 when tied to the head)
    head_params: int  # final norm + output head (+ a tied embedding): one FSDP2 unit kept gathered
    persistent_params: int  # params of <= 10 h elements, which ZeRO-3 keeps gathered ("auto" persistence threshold)
    num_kv_heads: int | None = None  # grouped-query attention's K/V heads (None: as many as num_heads)


def architecture_from_sizes(num_params: int, hidden_size: int, num_layers: int, vocab_size: int,
                            intermediate_size: int | None = None, num_heads: int | None = None,
                            num_kv_heads: int | None = None) -> Architecture:
    """An `Architecture` from sizes alone, for `--params` without `--model`. Approximations, stated: untied input
    and output embeddings (V x h each), the rest split evenly over the blocks, two norms per block; without
    `intermediate_size` Korthikanti's GPT MLP (4 h, not gated), with it a Llama-style gated MLP."""
    for flag, value in (("--hidden_size", hidden_size), ("--num_layers", num_layers), ("--vocab_size", vocab_size)):
        if value < 1:
            raise UserError(f"{flag} {value} must be at least 1.")
    block_params = (num_params - 2 * vocab_size * hidden_size) // num_layers
    if block_params < 1:
        raise UserError(f"{num_params:,} parameters cannot hold two {vocab_size} x {hidden_size} embeddings and "
                        f"{num_layers} layers; check --params, --vocab_size and --hidden_size.")
    return Architecture(num_params, hidden_size, num_layers, vocab_size, intermediate_size or 4 * hidden_size,
                        num_heads, intermediate_size is not None, block_params, vocab_size * hidden_size,
                        vocab_size * hidden_size + hidden_size, (2 * num_layers + 1) * hidden_size, num_kv_heads)



def element_bytes(dtype: str) -> int:
    """Bytes of one element in the compute dtype: 4 for 'fp32', 2 for 'bf16' (activations, gathered parameters)."""
    return 4 if dtype == "fp32" else 2


OFFLOAD_INPUTS_ON_DEVICE = 2  # with activation offloading: the block input being copied out while the next computes


def activation_bytes(arch: Architecture, *, seq_len: int, micro_batch_size: int, activation_checkpointing: bool,
                     attention: str = "sdpa", dtype: str = "bf16", loss_chunk_tokens: int = 0,
                     activation_offloading: bool = False) -> int:
    """Activation bytes per GPU for one micro-batch of a decoder (formula and source: module docstring).
    `attention`: 'sdpa' (also flash) or 'eager'; `dtype`: 'bf16' or 'fp32'; `loss_chunk_tokens`: the recipes'
    --loss_chunk_tokens (the logits of at most that many tokens exist at once; 0 = the whole micro-batch's);
    `activation_offloading` (with checkpointing): the blocks' inputs live in host memory, at most
    OFFLOAD_INPUTS_ON_DEVICE of them on the device at once (`offloaded_activation_bytes` is what moves). The same for
    every engine."""
    s, b, h = seq_len, micro_batch_size, arch.hidden_size
    mlp = 3 * h + (8 if arch.gated_mlp else 4) * arch.intermediate_size
    layer = s * b * (15 * h + mlp)
    if attention == "eager":
        if arch.num_heads is None:
            raise UserError("--attention eager needs the number of heads; pass --model or --num_heads.")
        layer += 5 * arch.num_heads * s * s * b
    inputs_kept = min(arch.num_layers, OFFLOAD_INPUTS_ON_DEVICE) if activation_offloading else arch.num_layers
    layers = inputs_kept * 2 * s * b * h + layer if activation_checkpointing else arch.num_layers * layer
    e = element_bytes(dtype)
    loss_tokens = min(loss_chunk_tokens, s * b) if loss_chunk_tokens else s * b
    return layers * e // 2 + loss_tokens * arch.vocab_size * (e + 4)


def offloaded_activation_bytes(arch: Architecture, *, seq_len: int, micro_batch_size: int, dtype: str = "bf16") -> int:
    """Host bytes per rank that activation offloading holds: every checkpointed block's input (s x b x h elements in
    the compute dtype, L of them), in pinned memory on a GPU machine."""
    return arch.num_layers * seq_len * micro_batch_size * arch.hidden_size * element_bytes(dtype)


def transient_bytes(engine: Engine, arch: Architecture, *, dtype: str = "bf16", trainable_fraction: float = 1.0) -> int:
    """Bytes each engine adds at its peak beyond model states: buckets and gathered parameters in the compute
    dtype (the module docstring lists them per engine). Engines: all."""
    e = element_bytes(dtype)
    psi, h = arch.num_params, arch.hidden_size
    if engine.family == "single":  # no buckets, nothing gathered
        return 0
    if engine.is_data_parallel_only:
        return 25 * 2**20  # torch's bucket_cap_mb default
    buckets = deepspeed_bucket_elements(h)
    reduce_bucket, prefetch_bucket = buckets["reduce_bucket_size"], buckets["stage3_prefetch_bucket_size"]
    if engine.is_deepspeed and engine.zero_stage < 3:
        return e * (min(reduce_bucket, psi) + min(500_000_000, psi))
    if engine.is_deepspeed:  # ZeRO-3; its reduce bucket holds fp32 (the recipe reduces gradients in fp32)
        gathered = min(1_000_000_000, psi) + min(prefetch_bucket, psi) + arch.persistent_params
        return e * gathered + 4 * min(reduce_bucket, psi)
    unit = max(arch.block_params, arch.embed_params)
    unit_grad = e * int(unit * trainable_fraction)
    if engine.zero_stage == 2:  # fsdp2_zero2
        return e * psi + unit_grad
    return e * (arch.head_params + 2 * unit) + unit_grad



# accelerate's "auto" sizes (reduce h^2, prefetch 0.9 h^2 elements) make a small model pay one synchronising
# collective per weight matrix: at hidden 256, ZeRO-3 ran at 0.76x the Trainer's tokens/s (which gets DeepSpeed's
# 5e8 defaults), and 1.03x / 0.99x (two runs) with this floor (docs/BENCHMARKS.md, section 4). The floor is
# DDP's default gradient bucket (bucket_cap_mb=25) in fp32 elements; from hidden 2560 up, h^2 exceeds it and
# "auto" applies unchanged.
MIN_BUCKET_ELEMENTS = 25 * 2**20 // 4


def deepspeed_bucket_elements(hidden_size: int) -> dict[str, int]:
    """DeepSpeed ZeRO bucket sizes, in elements, for a model of hidden size `hidden_size` (h): accelerate's "auto"
    values (reduce bucket h^2, ZeRO-3 prefetch bucket 0.9 h^2, ZeRO-3 persistence threshold 10 h) with the two
    communication buckets raised to at least MIN_BUCKET_ELEMENTS (6.55M). Keys are DeepSpeed `zero_optimization`
    keys. zero_utils.memory.estimate uses the same sizes."""
    h = hidden_size
    return {"reduce_bucket_size": max(h * h, MIN_BUCKET_ELEMENTS),
            "stage3_prefetch_bucket_size": max(int(0.9 * h * h), MIN_BUCKET_ELEMENTS),
            "stage3_param_persistence_threshold": 10 * h}
