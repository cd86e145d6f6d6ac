"""Memory per GPU, predicted: the ZeRO formulas for each engine's model states, activation and transient
estimates, and the estimator CLI. What a rank really holds is measured by zero_utils.measure.

Model states are parameters + gradients + optimizer state (AdamW: an fp32 master copy where the engine keeps one,
plus two fp32 moments). Formulas (Psi = trainable parameters, N = ranks sharing the shards; the ZeRO paper's
mixed-precision Adam has K = 12):

    engine       mixed precision (bf16)          fp32 training, as each engine stores it right after the step
    ddp          16 Psi                          16 Psi (params 4 + grads 4 + Adam 8)
    zero1/zero2  2 Psi + 14 Psi / N (paper:      4 Psi + 16 Psi / N (fp32 params; fp32 master 4, Adam 8 and an
                 ZeRO-1 4 Psi + 12 Psi / N)      fp32 gradient partition 4, all partitioned)
    zero3        16 Psi / N                      24 Psi / N (params 4, master 4, Adam 8, grads 4 + 4, partitioned)
    fsdp2        16 Psi / N                      16 Psi / N (no master copy: the fp32 shard is the master)

The fp32 column is what DeepSpeed 0.19.8 and torch 2.13 were measured to hold (docs/MEMORY.md). Engines:
ddp, single, zero1, zero2, zero3 (+_offload), fsdp2, fsdp2_zero2 (+_offload). Units: bytes.

Activations per micro-batch (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1, no tensor/sequence parallelism; s = seq_len, b = micro-batch, h = hidden, a = heads,
I = intermediate size, L = layers, V = vocab), in bytes for 16-bit activations:
    per layer  s*b*h*(34 + 5*a*s/h) = attention 11 sbh + 5 a s^2 b, MLP 19 sbh, two norms 4 sbh.
    Their MLP is GPT's (I = 4h): 19 sbh = sb*(3h + 4I). A gated (SwiGLU, Llama) MLP keeps two more I-wide
    tensors: sb*(3h + 8I). Flash/sdpa attention keeps no s x s matrices: the 5 a s^2 b term disappears.
    With activation checkpointing only each layer's input (2 sbh) is kept, plus one layer's full activations
    while it is recomputed. Logits add s*b*V*(2 + 4) (16-bit logits and their fp32 upcast for the loss).
    fp32 training doubles the layer terms (4-byte activations).

Transient peaks (engine buffers and gathered parameters, in the compute dtype, on top of model states):
    ddp          one 25 MiB gradient bucket (gradients are views into the buckets: gradient_as_bucket_view=True).
    zero1/zero2  reduce bucket + allgather bucket (DeepSpeed default 5e8 elements).
    zero3        live parameters (stage3_max_live_parameters, 1e9 elements, an upper bound) + reduce bucket
                 + prefetch bucket + persistent small params (<= 10 h elements each). Bucket sizes are those
                 zero_utils.accelerator.deepspeed_bucket_elements sets: accelerate's "auto" (h^2, 0.9 h^2 elements),
                 at least 25 MiB of fp32 elements each.
    fsdp2        the output-head group, kept gathered (zero_utils.wrapping), + the unit being computed and the
                 prefetched next one (2 x the largest unit) + that unit's gradient during backward.
    fsdp2_zero2  every unit stays gathered from its forward to its backward: the whole model + one unit's gradient.
Buckets never exceed the model. `fits` keeps SAFETY_MARGIN of the GPU free for the CUDA context and allocator
fragmentation. CLI: `python -m zero_utils.memory --params 7B --num_gpus 8` (see --help).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from zero_utils.accelerator import deepspeed_bucket_elements
from zero_utils.engine import Engine
from zero_utils.errors import UserError

# accelerate_configs/<name>.yaml, in the order the estimator recommends them: least communication first.
ENGINES = ("ddp", "zero1", "zero2", "fsdp2_zero2", "zero3", "fsdp2", "zero3_offload", "fsdp2_offload")
OPTIMIZERS = ("adamw", "sgd")
SAFETY_MARGIN = 0.10
_KINDS = ("params", "grads", "optimizer")

# Bytes per trainable parameter one rank holds right after the optimizer step, by kind, each as
# (replicated on every rank, divided over the shard group). master = fp32 copy the optimizer updates (none where the
# fp32 params are the master); moments = AdamW's two fp32 moments. This table is the one source of truth: the CLI
# and the recipe's `model_state_bytes_expected` both read it through `model_state_bytes`.
# "fp32" and "mixed" are MEASURED from live tensors (DeepSpeed 0.19.8, torch 2.13, accelerate 1.15; 2 and 4 ranks;
# docs/MEMORY.md): re-measure before editing. DeepSpeed keeps more than the paper: an fp32 gradient partition
# next to its 16-bit one (ZeRO-3: grads 4 + 2, or 4 + 4 in fp32), and under ZeRO-1/2 the gradients of the whole
# parameters that overlap the rank's partition (~1/N of them, counted here as (0, 2|4); the parameters cut by a
# partition border are added exactly by `expected_model_state_bytes(..., param_groups=...)`).
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
        "zero3": {"params": (0, 2), "grads": (0, 6), "master": (0, 4), "moments": (0, 8)},
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


def _engine(engine: str | Engine) -> Engine:
    try:
        return Engine.parse(str(engine))
    except ValueError:
        raise UserError(f"unknown engine {engine!r}; use one of: {', '.join(ENGINES)}.") from None


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


def model_state_bytes(engine: str, num_params: int, world_size: int, mixed_precision: str | None = "no", *,
                      optimizer: str = "adamw", frozen_params: int = 0, shard_group_size: int | None = None,
                      offload_optimizer: bool | None = None, offload_params: bool | None = None,
                      formula: str = "engine") -> ModelStateBytes:
    """Bytes one rank holds in params, grads and optimizer state for `engine` (any of ENGINES, 'single', and
    the '_offload' variants the recipe names), `num_params` trainable parameters and `world_size` ranks.

    `mixed_precision`: accelerate's value ('no'/'fp32' or 'bf16'/'fp16'). `optimizer`: 'adamw' or 'sgd' (no
    momentum: no state but a master copy where the engine keeps one). `frozen_params` (LoRA's base weights): stored
    as the engine stores its parameters (fp32 under DDP autocast and FSDP2, 16-bit under DeepSpeed in mixed
    precision), no grads, no optimizer state, sharded where the engine shards params. `shard_group_size`
    (HSDP: GPUs per node) divides the sharded parts instead of `world_size`. Offload defaults to what the engine
    name says (`zero3_offload`: optimizer and params; `zeroK_offload`: optimizer; `fsdp2*_offload`: all); the
    offloaded sharded parts are counted in `cpu`, not `gpu`. `formula`: 'engine' (what DeepSpeed 0.19.8 / torch
    2.13 really hold, measured) or 'paper' (the ZeRO paper's 2 + 2 + 12 bytes, for mixed precision).
    """
    engine = _engine(engine)
    if optimizer not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {optimizer!r}; use one of: {', '.join(OPTIMIZERS)}.")
    group = shard_group_size or world_size
    if group < 1 or world_size < 1:
        raise UserError(f"world size {world_size} (shard group {group}) must be at least 1.")
    if formula not in ("engine", "paper"):
        raise UserError(f"unknown formula {formula!r}; use 'engine' or 'paper'.")
    precision = _precision(mixed_precision)
    row = _BYTES_PER_PARAM["paper" if formula == "paper" else precision][_table_row(engine)]
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


def expected_model_state_bytes(engine: str, num_params: int, world_size: int, mixed_precision: str = "no", *,
                               param_groups: list[list[tuple[int, ...]]] | None = None, **kwargs) -> int:
    """Model-state bytes one rank holds, GPU and CPU together (what `measure_model_state_bytes` walks), for
    `engine` (see the module table), `num_params` trainable parameters, `world_size` ranks and accelerate's
    `mixed_precision` ('no' = fp32, 'bf16'/'fp16' = mixed). Keyword arguments: those of `model_state_bytes`.

    `param_groups`: the shapes of the trainable parameters in optimizer order, one list per param group. With
    them the result is exact for the most loaded rank (the one `model_state_bytes` in metrics.jsonl reports):
    what cannot shard evenly is added, not hidden in a tolerance (`sharding_remainder_bytes`).
    """
    ideal = model_state_bytes(engine, num_params, world_size, mixed_precision, **kwargs).total_bytes
    group = kwargs.get("shard_group_size") or world_size
    if param_groups is None or group == 1:
        return ideal
    return ideal + sharding_remainder_bytes(engine, param_groups, group, mixed_precision)


def sharding_remainder_bytes(engine: str, param_groups: list[list[tuple[int, ...]]], world_size: int,
                             mixed_precision: str = "no") -> int:
    """Bytes the most loaded rank holds beyond the even 1/N split of the module table, from the real layout:

    - FSDP2 shards every parameter on dim 0, padded: rank 0 holds ceil(dim0 / N) rows of each.
    - DeepSpeed ZeRO-3 partitions every parameter separately into ceil(numel / N) elements.
    - DeepSpeed ZeRO-1/2 flatten each param group (aligned to 2 N elements) into N equal partitions and keep the
      16-bit gradients of every whole parameter that overlaps the rank's partition (DeepSpeed's
      `params_in_partition`), so the parameters cut by a partition border count in full.
    Engines: fsdp2*, zero1, zero2, zero3 (+_offload); 0 for ddp/single.
    """
    engine = _engine(engine)
    n = world_size
    numels = [[_numel(shape) for shape in group] for group in param_groups]
    total = sum(map(sum, numels))
    even = total / n
    precision = _precision(mixed_precision)
    row = _BYTES_PER_PARAM[precision][_table_row(engine)]
    sharded_bytes = sum(row[k][1] for k in ("params", "grads", "master", "moments"))
    if engine.is_fsdp2:
        held = sum(-(-shape[0] // n) * _numel(shape[1:]) for group in param_groups for shape in group if shape)
        return round((held - even) * sharded_bytes)
    if engine.is_deepspeed and engine.zero_stage == 3:
        held = sum(-(-numel // n) for group in numels for numel in group)
        return round((held - even) * sharded_bytes)
    if engine.is_deepspeed:  # ZeRO-1/2
        grad_bytes = 4 if precision == "fp32" else 2  # the 16-bit (here: param-dtype) gradients of whole params
        in_partition = [0] * n
        for group in numels:
            padded = -(-sum(group) // (2 * n)) * 2 * n
            size = padded // n
            start = 0
            for numel in group:
                first, last = start // size, (start + numel - 1) // size
                for rank in range(first, min(last, n - 1) + 1):
                    in_partition[rank] += numel
                start += numel
        return round((max(in_partition) - even) * grad_bytes)
    return 0


def _numel(shape) -> int:
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


def architecture_from_sizes(num_params: int, hidden_size: int, num_layers: int, vocab_size: int,
                            intermediate_size: int | None = None, num_heads: int | None = None) -> Architecture:
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
                        vocab_size * hidden_size + hidden_size, (2 * num_layers + 1) * hidden_size)


def architecture_from_model(name_or_path: str) -> Architecture:
    """Read a causal LM's `Architecture` from its config alone (a Hub id, a local folder or a config.json path):
    the model is built on the meta device to count parameters exactly; no weights are loaded or downloaded."""
    from transformers import AutoModelForCausalLM

    from zero_utils.model import load_config
    from zero_utils.wrapping import find_block_classes

    if name_or_path.endswith(".json") and not Path(name_or_path).expanduser().is_file():
        raise UserError(f"--model {name_or_path!r} does not exist; pass a model folder, its config.json or a Hub id.")
    try:
        config = load_config(name_or_path)
    except (OSError, ValueError) as error:  # not on the Hub / offline, or a config transformers cannot read
        raise UserError(f"--model {name_or_path!r} has no readable config ({str(error).splitlines()[0]}); "
                        "check the name or pass a local config.json.") from None
    with torch.device("meta"):  # shapes only; ties shared weights like a real build
        model = AutoModelForCausalLM.from_config(config)
    hidden = config.hidden_size
    params = {id(p): p.numel() for p in model.parameters()}
    blocks = [m for m in model.modules() if isinstance(m, tuple(find_block_classes(model)))]
    block_sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    embed_params = 0 if tied else embedding.numel()
    return Architecture(
        num_params=sum(params.values()), hidden_size=hidden, num_layers=config.num_hidden_layers,
        vocab_size=config.vocab_size, intermediate_size=getattr(config, "intermediate_size", None) or 4 * hidden,
        num_heads=config.num_attention_heads,
        gated_mlp=any(name.endswith(("gate_proj", "gate_up_proj")) for name, _ in model.named_modules()),
        block_params=max(block_sizes), embed_params=embed_params,
        head_params=sum(params.values()) - sum(block_sizes) - embed_params,
        persistent_params=sum(n for n in params.values() if n <= 10 * hidden))


def activation_bytes(arch: Architecture, *, seq_len: int, micro_batch_size: int, activation_checkpointing: bool,
                     attention: str = "sdpa", dtype: str = "bf16") -> int:
    """Activation bytes per GPU for one micro-batch of a decoder (formula and source: module docstring).
    `attention`: 'sdpa' (also flash) or 'eager'; `dtype`: 'bf16' or 'fp32'. The same for every engine."""
    s, b, h = seq_len, micro_batch_size, arch.hidden_size
    mlp = 3 * h + (8 if arch.gated_mlp else 4) * arch.intermediate_size
    layer = s * b * (15 * h + mlp)
    if attention == "eager":
        if arch.num_heads is None:
            raise UserError("--attention eager needs the number of heads; pass --model or --num_heads.")
        layer += 5 * arch.num_heads * s * s * b
    layers = arch.num_layers * 2 * s * b * h + layer if activation_checkpointing else arch.num_layers * layer
    element_bytes = 4 if dtype == "fp32" else 2
    return layers * element_bytes // 2 + s * b * arch.vocab_size * (element_bytes + 4)


def transient_bytes(engine: str, arch: Architecture, *, dtype: str = "bf16", trainable_fraction: float = 1.0) -> int:
    """Bytes each engine adds at its peak beyond model states: buckets and gathered parameters in the compute
    dtype (the module docstring lists them per engine). Engines: all of ENGINES."""
    engine = _engine(engine)
    element_bytes = 4 if dtype == "fp32" else 2
    psi, h = arch.num_params, arch.hidden_size
    if engine.is_data_parallel_only:
        return 25 * 2**20  # torch's bucket_cap_mb default
    buckets = deepspeed_bucket_elements(h)
    reduce_bucket, prefetch_bucket = buckets["reduce_bucket_size"], buckets["stage3_prefetch_bucket_size"]
    if engine.is_deepspeed and engine.zero_stage < 3:
        return element_bytes * (min(reduce_bucket, psi) + min(500_000_000, psi))
    if engine.is_deepspeed:  # ZeRO-3
        gathered = (min(1_000_000_000, psi) + min(reduce_bucket, psi) + min(prefetch_bucket, psi)
                    + arch.persistent_params)
        return element_bytes * gathered
    unit = max(arch.block_params, arch.embed_params)
    unit_grad = element_bytes * int(unit * trainable_fraction)
    if engine.zero_stage == 2:  # fsdp2_zero2
        return element_bytes * psi + unit_grad
    return element_bytes * (arch.head_params + 2 * unit) + unit_grad


@dataclass(frozen=True)
class Setup:
    """What the estimate is for. Counts in parameters; `num_gpus` per node; `hsdp`: FSDP2 shards within a node."""

    num_params: int
    num_gpus: int = 8
    num_nodes: int = 1
    hsdp: bool = False
    dtype: str = "bf16"
    optimizer: str = "adamw"
    lora_fraction: float = 1.0
    offload_optimizer: bool = False
    offload_params: bool = False
    arch: Architecture | None = None
    seq_len: int = 2048
    micro_batch_size: int = 1
    activation_checkpointing: bool = False
    attention: str = "sdpa"
    formula: str = "engine"


@dataclass(frozen=True)
class EngineEstimate:
    """Per-GPU bytes for one engine. `activation_bytes`/`transient_bytes` are None without an architecture."""

    engine: str
    model_states: ModelStateBytes
    activation_bytes: int | None
    transient_bytes: int | None

    @property
    def total_bytes(self) -> int | None:
        if self.activation_bytes is None or self.transient_bytes is None:
            return None
        return self.model_states.gpu_bytes + self.activation_bytes + self.transient_bytes


def _offload_for(engine: str, setup: Setup) -> tuple[bool | None, bool | None]:
    """The offload flags, applied where the engine can do them; the `_offload` configs keep their own."""
    engine = _engine(engine)
    if engine.offload or engine.is_data_parallel_only:
        return None, None
    if engine.is_fsdp2:  # CPUOffloadPolicy moves params, and with them grads and optimizer state
        return setup.offload_params, setup.offload_params
    return setup.offload_optimizer, setup.offload_params and engine.shards_params


def estimate(setup: Setup, engines=ENGINES) -> list[EngineEstimate]:
    """Per-GPU memory of each engine in `engines` (default: all of ENGINES) for `setup`, in bytes."""
    for flag, value in (("--num_gpus", setup.num_gpus), ("--num_nodes", setup.num_nodes),
                        ("--seq_len", setup.seq_len), ("--micro_batch_size", setup.micro_batch_size)):
        if value < 1:
            raise UserError(f"{flag} {value} must be at least 1.")
    if not 0 < setup.lora_fraction <= 1:
        raise UserError(f"--lora_fraction {setup.lora_fraction} must be in (0, 1]; 1 trains every parameter.")
    if setup.dtype not in ("fp32", "bf16"):
        raise UserError(f"--dtype {setup.dtype!r} is unknown; use fp32 or bf16.")
    trainable = round(setup.num_params * setup.lora_fraction)
    world = setup.num_gpus * setup.num_nodes
    results = []
    for engine in engines:
        offload_optimizer, offload_params = _offload_for(engine, setup)
        group = setup.num_gpus if setup.hsdp and _engine(engine).is_fsdp2 else world
        states = model_state_bytes(engine, trainable, world, setup.dtype, optimizer=setup.optimizer,
                                   frozen_params=setup.num_params - trainable, shard_group_size=group,
                                   offload_optimizer=offload_optimizer, offload_params=offload_params,
                                   formula=setup.formula)
        activations = transient = None
        if setup.arch is not None:
            activations = activation_bytes(setup.arch, seq_len=setup.seq_len, micro_batch_size=setup.micro_batch_size,
                                           activation_checkpointing=setup.activation_checkpointing,
                                           attention=setup.attention, dtype=setup.dtype)
            transient = transient_bytes(engine, setup.arch, dtype=setup.dtype, trainable_fraction=setup.lora_fraction)
        results.append(EngineEstimate(engine, states, activations, transient))
    return results


def fits(result: EngineEstimate, gpu_memory_bytes: int) -> bool:
    """Whether `result`'s total stays within the GPU's bytes less SAFETY_MARGIN. Needs activations (an arch)."""
    if result.total_bytes is None:
        raise UserError("--gpu_memory needs activation estimates; pass --model, or --hidden_size, --num_layers and "
                        "--vocab_size.")
    return result.total_bytes <= gpu_memory_bytes * (1 - SAFETY_MARGIN)


def cheapest_fit(results: list[EngineEstimate], gpu_memory_bytes: int) -> EngineEstimate | None:
    """The first result (ENGINES order: least communication first) that fits, or None."""
    return next((r for r in results if fits(r, gpu_memory_bytes)), None)


def launch_command(engine: str, num_gpus: int, num_nodes: int = 1, hsdp: bool = False) -> str:
    """The `accelerate launch` line for `engine` (accelerate's --num_processes counts all nodes' processes)."""
    line = f"accelerate launch --config_file accelerate_configs/{engine}.yaml --num_processes {num_gpus * num_nodes}"
    if num_nodes > 1:
        line += (f" --num_machines {num_nodes} --machine_rank <0..{num_nodes - 1}> --main_process_ip <node 0 address>"
                 " --main_process_port 29500")
        if hsdp and _engine(engine).is_fsdp2:
            line += f" --parallelism_config_dp_replicate_size {num_nodes} --parallelism_config_dp_shard_size {num_gpus}"
    return line + " recipes/llama_zero3.py"


_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
               "gib": 2**30, "tib": 2**40}


def parse_count(text: str, flag: str = "--params") -> int:
    """'7e9', '7B', '7000000000', '1.5M' -> a positive integer count (K, M, B/G, T: powers of 1000)."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    try:
        value = round(float(match.group(1)) * _SUFFIXES[match.group(2)]) if match else 0
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"{flag} {text!r} is not a positive count; write e.g. 7B, 1.5M, 7e9 or 7000000000.")
    return value


def parse_bytes(text: str, flag: str = "--gpu_memory") -> int:
    """'80GB', '80GiB', '80e9' -> bytes (GB = 1e9, GiB = 2^30). A bare number is bytes and must be >= 1e6."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?i?b)?\s*", text.lower())
    try:
        value = round(float(match.group(1)) * _BYTE_UNITS[match.group(2) or "b"]) if match else 0
    except (ValueError, KeyError):
        value = 0
    if value < 10**6:
        raise UserError(f"{flag} {text!r} is not a memory size; write e.g. 80GB, 80GiB or 80e9 (bytes).")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line through main(), not argparse's usage block
        raise UserError(f"{message}; see --help.")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m zero_utils.memory", allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Per-GPU memory of model states, activations and engine buffers for DDP, DeepSpeed "
                            "ZeRO-1/2/3 and FSDP2,\nand the cheapest engine that fits (formulas: the docstring "
                            "of zero_utils/memory.py).",
                epilog="example: python -m zero_utils.memory --model Qwen/Qwen2.5-7B --num_gpus 8 "
                       "--gpu_memory 80GB --activation_checkpointing")
    d = Setup(num_params=1)  # the defaults live in Setup only
    model = p.add_argument_group("model (one of)")
    model.add_argument("--params", metavar="N", help="parameter count: 7B, 1.5M, 7e9, 7000000000")
    model.add_argument("--model", help="Hub id, local model folder or config.json (reads the config only)")
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--num_gpus", type=int, default=d.num_gpus, metavar="N",
                         help="GPUs per node (default: %(default)s)")
    cluster.add_argument("--num_nodes", type=int, default=d.num_nodes, metavar="N",
                         help="ranks = num_gpus x num_nodes (default: %(default)s)")
    cluster.add_argument("--hsdp", action="store_true", help="FSDP2 shards within a node, replicates across nodes")
    cluster.add_argument("--gpu_memory", metavar="SIZE", help="memory of one GPU (80GB, 80GiB, 80e9): marks what "
                         "fits and names the cheapest engine that does")
    training = p.add_argument_group("training")
    training.add_argument("--dtype", default=d.dtype, choices=["bf16", "fp32"], help="bf16 = mixed precision with "
                          "fp32 master weights (default: %(default)s)")
    training.add_argument("--formula", default=d.formula, choices=["engine", "paper"],
                          help="engine: what DeepSpeed 0.19.8 / torch 2.13 really hold (measured); paper: the ZeRO "
                          "paper's 2 + 2 + 12 bytes per parameter")
    training.add_argument("--optimizer", default=d.optimizer, choices=OPTIMIZERS, help="sgd = no momentum "
                          "(default: %(default)s)")
    training.add_argument("--lora_fraction", type=float, default=d.lora_fraction, metavar="F", help="fraction of "
                          "parameters trained; the rest frozen in the compute dtype (default: %(default)s)")
    training.add_argument("--offload_optimizer", action="store_true", help="optimizer state in CPU memory "
                          "(ZeRO-1/2/3)")
    training.add_argument("--offload_params", action="store_true", help="sharded params in CPU memory "
                          "(ZeRO-3; FSDP2 with grads and optimizer)")
    activations = p.add_argument_group("activations (sizes: with --params; --model reads them from its config)")
    activations.add_argument("--seq_len", type=int, default=d.seq_len, metavar="N", help="tokens per row "
                             "(default: %(default)s)")
    activations.add_argument("--micro_batch_size", type=int, default=d.micro_batch_size, metavar="N", help="rows per "
                             "GPU per micro-step (default: %(default)s)")
    activations.add_argument("--activation_checkpointing", action="store_true", help="keep only block inputs")
    activations.add_argument("--attention", default=d.attention, choices=["sdpa", "eager"], help="sdpa and "
                             "flash keep no seq_len^2 scores (default: %(default)s)")
    for name, help_text in (("hidden_size", "needed with --num_layers and --vocab_size"), ("num_layers", ""),
                            ("vocab_size", ""), ("intermediate_size", "gated MLP; default 4 x hidden, GPT's MLP"),
                            ("num_heads", "needed for --attention eager")):
        activations.add_argument(f"--{name}", type=int, metavar="N", help=help_text)
    output = p.add_argument_group("output")
    output.add_argument("--engines", default=",".join(ENGINES), help="comma-separated (default: all, in the "
                        "order of preference)")
    output.add_argument("--unit", default="GB", choices=["GB", "GiB"], help="table unit (default: GB = 1e9 bytes)")
    output.add_argument("--json", action="store_true", help="print JSON (bytes as integers) instead of the table")
    return p


def _setup_from_args(args) -> Setup:
    if bool(args.params) == bool(args.model):
        raise UserError("pass exactly one of --params (e.g. 7B) or --model (Hub id, folder or config.json).")
    sizes = {name: getattr(args, name) for name in ("hidden_size", "num_layers", "vocab_size", "intermediate_size",
                                                    "num_heads") if getattr(args, name) is not None}
    if args.model and sizes:
        raise UserError(f"--model reads the sizes from its config; drop {', '.join('--' + n for n in sizes)}.")
    if args.model:
        arch = architecture_from_model(args.model)
        num_params = arch.num_params
    else:
        num_params = parse_count(args.params)
        needed = {"hidden_size", "num_layers", "vocab_size"}
        if sizes and not needed <= sizes.keys():
            raise UserError(f"activation sizes need all of --hidden_size, --num_layers and --vocab_size; "
                            f"missing: {', '.join('--' + n for n in sorted(needed - sizes.keys()))}.")
        arch = architecture_from_sizes(num_params, **sizes) if sizes else None
    return Setup(num_params=num_params, num_gpus=args.num_gpus, num_nodes=args.num_nodes, hsdp=args.hsdp,
                 dtype=args.dtype, optimizer=args.optimizer, lora_fraction=args.lora_fraction,
                 offload_optimizer=args.offload_optimizer, offload_params=args.offload_params, arch=arch,
                 seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                 activation_checkpointing=args.activation_checkpointing, attention=args.attention,
                 formula=args.formula)


def _notes(setup: Setup) -> list[str]:
    notes = []
    if setup.arch is None:
        notes.append("activations and transients need the architecture: pass --model, or --hidden_size, "
                     "--num_layers and --vocab_size.")
    if setup.offload_optimizer and not setup.offload_params:
        notes.append("FSDP2 offloads optimizer state only together with its params (--offload_params).")
    if setup.offload_params:
        notes.append("ZeRO-1/2 cannot offload params; FSDP2's offload moves its grads and optimizer state too.")
    if setup.hsdp:
        notes.append(f"HSDP: FSDP2 shards over the {setup.num_gpus} GPUs of a node; DeepSpeed rows shard over all.")
    return notes


def _advice(setup: Setup, gpu_memory_bytes: int) -> list[str]:
    """What would fit when nothing does: CPU offload, more GPUs (FSDP2's states shrink as 1/N), LoRA, shorter rows."""
    advice = ["nothing fits. Lower activations with a shorter --seq_len, a smaller --micro_batch_size or "
              "--activation_checkpointing; --lora_fraction 0.01 drops most gradients and optimizer state."]
    offloaded = cheapest_fit(estimate(setup, ("zero3_offload", "fsdp2_offload")), gpu_memory_bytes)
    if offloaded is not None:
        advice.append(f"{offloaded.engine} (CPU offload) fits on these GPUs.")
    for nodes in (2**k * setup.num_nodes for k in range(1, 11)):
        if cheapest_fit(estimate(replace(setup, num_nodes=nodes, hsdp=False), ("fsdp2",)), gpu_memory_bytes):
            return advice + [f"fsdp2 fits on {nodes} nodes of {setup.num_gpus} GPUs."]
    return advice


def report(setup: Setup, results: list[EngineEstimate], gpu_memory_bytes: int | None = None) -> dict:
    """The estimate as plain data (bytes as integers): inputs, one entry per engine, the cheapest fit."""
    chosen = cheapest_fit(results, gpu_memory_bytes) if gpu_memory_bytes else None
    inputs = {k: v for k, v in asdict(setup).items() if k != "arch"}
    return {
        "unit": "bytes", "inputs": inputs, "architecture": asdict(setup.arch) if setup.arch else None,
        "gpu_memory_bytes": gpu_memory_bytes, "safety_margin": SAFETY_MARGIN,
        "engines": [{
            "engine": r.engine, "params_bytes": r.model_states.gpu["params"],
            "grads_bytes": r.model_states.gpu["grads"], "optimizer_bytes": r.model_states.gpu["optimizer"],
            "model_state_bytes": r.model_states.gpu_bytes, "cpu_bytes": r.model_states.cpu_bytes,
            "activation_bytes": r.activation_bytes, "transient_bytes": r.transient_bytes,
            "total_bytes": r.total_bytes, "fits": fits(r, gpu_memory_bytes) if gpu_memory_bytes else None,
        } for r in results],
        "cheapest_fit": chosen.engine if chosen else None,
        "command": launch_command(chosen.engine, setup.num_gpus, setup.num_nodes, setup.hsdp) if chosen else None,
        "advice": _advice(setup, gpu_memory_bytes) if gpu_memory_bytes and not chosen else [],
        "notes": _notes(setup) + ([f"CPU offload needs cpu/rank x {setup.num_gpus} of host memory per node."]
                                  if any(r.model_states.cpu_bytes for r in results) else []),
    }


def format_report(data: dict, unit: str = "GB") -> str:
    """`report`'s data as an aligned text table in `unit` ('GB' = 1e9 bytes, 'GiB' = 2^30 bytes)."""
    scale, inputs = (1e9 if unit == "GB" else 2**30), data["inputs"]
    precision = "bf16 mixed precision (fp32 master)" if inputs["dtype"] == "bf16" else "fp32"
    trained = f", {inputs['lora_fraction']:g} trainable" if inputs["lora_fraction"] < 1 else ""
    lines = [f"Per-GPU memory in {unit} (1 {unit} = {'1e9' if unit == 'GB' else '2^30'} bytes); cpu/rank = host "
             "memory per rank.",
             f"{inputs['num_params']:,} params{trained}, {inputs['num_gpus']} GPUs x {inputs['num_nodes']} node(s), "
             f"{precision}, {inputs['optimizer']}.",
             f"Activations: seq_len {inputs['seq_len']}, micro-batch {inputs['micro_batch_size']}, "
             f"{inputs['attention']} attention, activation checkpointing "
             f"{'on' if inputs['activation_checkpointing'] else 'off'}.", ""]
    columns = ("params", "grads", "optimizer", "states", "activations", "transient", "total", "cpu/rank")
    keys = ("params_bytes", "grads_bytes", "optimizer_bytes", "model_state_bytes", "activation_bytes",
            "transient_bytes", "total_bytes", "cpu_bytes")
    lines.append(f"{'engine':<14}" + "".join(f"{c:>12}" for c in columns) + "  fits")
    for row in data["engines"]:
        cells = "".join(f"{'n/a':>12}" if row[k] is None else f"{row[k] / scale:>12.2f}" for k in keys)
        lines.append(f"{row['engine']:<14}{cells}  {({True: 'yes', False: 'no'}).get(row['fits'], '-')}")
    if data["gpu_memory_bytes"]:
        usable = data["gpu_memory_bytes"] * (1 - data["safety_margin"])
        lines += ["", f"fits = total <= {usable / scale:.2f} {unit}: {1 - data['safety_margin']:.0%} of "
                      f"{data['gpu_memory_bytes'] / scale:.2f} {unit}, the rest kept for the CUDA context and "
                      "allocator fragmentation."]
        if data["cheapest_fit"]:
            lines += [f"cheapest that fits: {data['cheapest_fit']}", f"  {data['command']}"]
        lines += data["advice"]
    return "\n".join(lines + [f"note: {n}" for n in data["notes"]])


def main(argv: list[str] | None = None) -> int:
    """`python -m zero_utils.memory`: print the estimate; a user error prints one line and exits 2."""
    try:
        args = _parser().parse_args(argv)
        setup = _setup_from_args(args)
        engines = [e.strip() for e in args.engines.split(",") if e.strip()]
        for engine in engines:
            if engine not in ENGINES:
                raise UserError(f"unknown engine {engine!r}; use one of: {', '.join(ENGINES)}.")
        results = estimate(setup, engines)
        gpu_memory_bytes = parse_bytes(args.gpu_memory) if args.gpu_memory else None
        data = report(setup, results, gpu_memory_bytes)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(data, indent=2) if args.json else format_report(data, args.unit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
