"""The memory estimator: for a model, a cluster and a run's shape, the per-GPU bytes of every engine (from
zero_utils.memory_formulas), whether each fits a GPU, the cheapest engine that does and its launch line, and what
to change when nothing fits. Its command line is `python -m zero_utils.memory` (zero_utils.memory). Units: bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from zero_utils.engine import Engine
from zero_utils.errors import UserError
from zero_utils.memory_formulas import (
    Architecture,
    ModelStateBytes,
    activation_bytes,
    model_state_bytes,
    transient_bytes,
)

# The engines of accelerate_configs/<engine.name>.yaml, in the order the estimator recommends them: least
# communication first.
ENGINES = tuple(Engine.parse(name) for name in ("ddp", "zero1", "zero2", "fsdp2_zero2", "zero3", "fsdp2",
                                                "zero3_offload", "fsdp2_offload"))
SAFETY_MARGIN = 0.10


def engine_named(name: str) -> Engine:
    """The engine of `accelerate_configs/<name>.yaml` (one of ENGINES); `UserError` naming the choices otherwise."""
    for engine in ENGINES:
        if engine.name == name:
            return engine
    raise UserError(f"unknown engine {name!r}; use one of: {', '.join(e.name for e in ENGINES)}.")


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
    loss_chunk_tokens: int = 1024  # the recipes' default
    formula: str = "engine"


@dataclass(frozen=True)
class EngineEstimate:
    """Per-GPU bytes for one engine. `activation_bytes`/`transient_bytes` are None without an architecture."""

    engine: Engine
    model_states: ModelStateBytes
    activation_bytes: int | None
    transient_bytes: int | None

    @property
    def total_bytes(self) -> int | None:
        if self.activation_bytes is None or self.transient_bytes is None:
            return None
        return self.model_states.gpu_bytes + self.activation_bytes + self.transient_bytes


def _offload_for(engine: Engine, setup: Setup) -> tuple[bool | None, bool | None]:
    """The offload flags, applied where the engine can do them; the `_offload` configs keep their own."""
    if engine.offload or engine.is_data_parallel_only:
        return None, None
    if engine.is_fsdp2:  # CPUOffloadPolicy moves params, and with them grads and optimizer state
        return setup.offload_params, setup.offload_params
    return setup.offload_optimizer, setup.offload_params and engine.shards_params


def estimate(setup: Setup, engines: tuple[Engine, ...] = ENGINES) -> list[EngineEstimate]:
    """Per-GPU memory of each engine in `engines` (default: all of ENGINES, in their order) for `setup`, in bytes."""
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
        group = setup.num_gpus if setup.hsdp and engine.is_fsdp2 else world
        states = model_state_bytes(engine, trainable, world, setup.dtype, optimizer=setup.optimizer,
                                   frozen_params=setup.num_params - trainable, shard_group_size=group,
                                   offload_optimizer=offload_optimizer, offload_params=offload_params,
                                   formula=setup.formula)
        activations = transient = None
        if setup.arch is not None:
            activations = activation_bytes(setup.arch, seq_len=setup.seq_len, micro_batch_size=setup.micro_batch_size,
                                           activation_checkpointing=setup.activation_checkpointing,
                                           attention=setup.attention, dtype=setup.dtype,
                                           loss_chunk_tokens=setup.loss_chunk_tokens)
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


def launch_command(engine: Engine, num_gpus: int, num_nodes: int = 1, hsdp: bool = False) -> str:
    """The `accelerate launch` line for `engine` (accelerate's --num_processes counts all nodes' processes)."""
    line = (f"accelerate launch --config_file accelerate_configs/{engine.name}.yaml "
            f"--num_processes {num_gpus * num_nodes}")
    if num_nodes > 1:
        line += (f" --num_machines {num_nodes} --machine_rank <0..{num_nodes - 1}> --main_process_ip <node 0 address>"
                 " --main_process_port 29500")
        if hsdp and engine.is_fsdp2:
            line += f" --parallelism_config_dp_replicate_size {num_nodes} --parallelism_config_dp_shard_size {num_gpus}"
    return line + " recipes/llama_zero3.py"


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
    offloaded = cheapest_fit(estimate(setup, tuple(e for e in ENGINES if e.offload)), gpu_memory_bytes)
    if offloaded is not None:
        advice.append(f"{offloaded.engine} (CPU offload) fits on these GPUs.")
    for nodes in (2**k * setup.num_nodes for k in range(1, 11)):
        if cheapest_fit(estimate(replace(setup, num_nodes=nodes, hsdp=False), (Engine("fsdp2", 3),)), gpu_memory_bytes):
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
            "engine": r.engine.name, "params_bytes": r.model_states.gpu["params"],
            "grads_bytes": r.model_states.gpu["grads"], "optimizer_bytes": r.model_states.gpu["optimizer"],
            "model_state_bytes": r.model_states.gpu_bytes, "cpu_bytes": r.model_states.cpu_bytes,
            "activation_bytes": r.activation_bytes, "transient_bytes": r.transient_bytes,
            "total_bytes": r.total_bytes, "fits": fits(r, gpu_memory_bytes) if gpu_memory_bytes else None,
        } for r in results],
        "cheapest_fit": chosen.engine.name if chosen else None,
        "command": launch_command(chosen.engine, setup.num_gpus, setup.num_nodes, setup.hsdp) if chosen else None,
        "advice": _advice(setup, gpu_memory_bytes) if gpu_memory_bytes and not chosen else [],
        "notes": _notes(setup) + ([f"CPU offload needs cpu/rank x {setup.num_gpus} of host memory per node."]
                                  if any(r.model_states.cpu_bytes for r in results) else []),
    }


