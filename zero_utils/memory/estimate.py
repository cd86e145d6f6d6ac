"""The memory estimator: for a model, a cluster and a run's shape, the per-GPU bytes of every engine (from
zero_utils.formulas.model_states), whether each fits a GPU, the cheapest engine that does and its launch line, and what
to change when nothing fits. Its command line is `python -m zero_utils.memory` (memory.command). Units: bytes.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from zero_utils.formulas.model_states import (
    OFFLOAD_INPUTS_ON_DEVICE,
    REFERENCES,
    Architecture,
    ModelStateBytes,
    activation_bytes,
    model_state_bytes,
    offloaded_activation_bytes,
    reference_model_bytes,
    transient_bytes,
)
from zero_utils.formulas.peak_terms import TERMS, peak_terms
from zero_utils.run.engine import Engine
from zero_utils.run.errors import UserError

# The engines of accelerate_configs/<engine.name>.yaml, in the order the estimator recommends them: least
# communication first.
ENGINES = tuple(Engine.parse(name) for name in ("ddp", "zero1", "zero2", "fsdp2_zero2", "zero3", "fsdp2",
                                                "zero3_offload", "fsdp2_offload"))
SP_ENGINES = tuple(Engine.parse(name) for name in ("zero2", "zero3"))  # with an _sp YAML (Ulysses: DeepSpeed only)
SAFETY_MARGIN = 0.10
TIGHT_FRACTION = 0.85  # an estimate above this share of the usable memory fits, with a warning
_BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
               "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, flag: str = "--device_memory") -> int:
    """'80GB', '80GiB', '80e9' -> bytes (GB = 1e9, GiB = 2^30). A bare number is bytes and must be >= 1e6."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?i?b)?\s*", text.lower())
    try:
        value = round(float(match.group(1)) * _BYTE_UNITS[match.group(2) or "b"]) if match else 0
    except (ValueError, KeyError):
        value = 0
    if value < 10**6:
        raise UserError(f"{flag} {text!r} is not a memory size; write e.g. 80GB, 80GiB or 80e9 (bytes).")
    return value


def format_bytes(nbytes: float) -> str:
    """Bytes as people read them: '812.35 MB' below 1 GB, else '12.34 GB' (MB = 1e6, GB = 1e9 bytes)."""
    return f"{nbytes / 1e6:.2f} MB" if abs(nbytes) < 1e9 else f"{nbytes / 1e9:.2f} GB"


def engine_named(name: str) -> Engine:
    """The engine of `accelerate_configs/<name>.yaml` (one of ENGINES); `UserError` naming the choices otherwise."""
    for engine in ENGINES:
        if engine.name == name:
            return engine
    raise UserError(f"unknown engine {name!r}; use one of: {', '.join(e.name for e in ENGINES)}.")


def architecture_from_model(name_or_path: str) -> Architecture:
    """Read a causal LM's `Architecture` from its config alone (a Hub id, a local folder or a config.json path):
    the model is built on the meta device to count parameters exactly; no weights are loaded or downloaded."""
    from zero_utils.model.loading import load_config

    if name_or_path.endswith(".json") and not Path(name_or_path).expanduser().is_file():
        raise UserError(f"--model {name_or_path!r} does not exist; pass a model folder, its config.json or a Hub id.")
    try:
        config = load_config(name_or_path)
    except (OSError, ValueError) as error:  # not on the Hub / offline, or a config transformers cannot read
        raise UserError(f"--model {name_or_path!r} has no readable config ({str(error).splitlines()[0]}); "
                        "check the name or pass a local config.json.") from None
    return architecture_from_config(config)


def meta_model(config, trust_remote_code: bool = False):
    """The causal LM of a transformers `config` on the meta device: shapes only, no memory used, no weights read;
    shared weights are tied as in a real build. Under a DeepSpeed ZeRO-3 launch, call it inside
    `deepspeed_setup.zero3_init_disabled` (transformers would otherwise partition it, a collective)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def architecture_from_config(config, model=None) -> Architecture:
    """The `Architecture` of a transformers causal-LM `config`, counted on `model` (default: `meta_model(config)`)."""
    from zero_utils.model.wrapping import find_block_classes

    model = meta_model(config) if model is None else model
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
        persistent_params=sum(n for n in params.values() if n <= 10 * hidden),
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


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
    activation_offloading: bool = False  # the checkpointed blocks' inputs in host memory (needs checkpointing)
    attention: str = "sdpa"  # "sdpa", "eager" or "flash" (flash-attention's varlen kernel: no mask)
    packed_rows: bool = True  # the SFT recipes pack rows (a block mask under sdpa); the DPO recipes pad pairs
    loss_chunk_tokens: int = 1024  # the recipes' default
    formula: str = "engine"
    reference: str = "none"  # a preference loss's reference: "model" (a frozen copy: recipes/llama_dpo.py), "adapters"
    # (the LoRA policy with its adapters off: recipes/llama_dpo_lora.py, no bytes), "precomputed" (its log-probs
    # computed before training, the copy freed: no bytes during training), "none" (reference-free)
    reference_params: int | None = None  # the frozen model's parameters when it is another model than the policy
    # (zero_utils.train.frozen_model: a distillation teacher); None: a copy of the policy (num_params)
    sequence_parallel: int = 1  # DeepSpeed Ulysses: each rank holds seq_len / sp of every row (DeepSpeed ZeRO only)


@dataclass(frozen=True)
class EngineEstimate:
    """Per-GPU bytes for one engine. `activation_bytes`/`transient_bytes` are None without an architecture."""

    engine: Engine
    model_states: ModelStateBytes
    activation_bytes: int | None
    transient_bytes: int | None
    reference_bytes: int = 0  # a preference loss's reference model, on the GPU
    reference_cpu_bytes: int = 0  # ... and in CPU memory (offload configs)
    activation_cpu_bytes: int = 0  # activation offloading: the checkpointed blocks' inputs in host memory
    peak_terms: dict[str, int] | None = None  # formulas.peak_terms: block mask, loss backward, ... (with an arch)

    @property
    def total_bytes(self) -> int | None:
        if self.activation_bytes is None or self.transient_bytes is None:
            return None
        return (self.model_states.gpu_bytes + self.reference_bytes + self.activation_bytes + self.transient_bytes
                + sum((self.peak_terms or {}).values()))

    @property
    def cpu_bytes(self) -> int:
        """Host memory per rank: offloaded model states, reference and activations."""
        return self.model_states.cpu_bytes + self.reference_cpu_bytes + self.activation_cpu_bytes


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
    if setup.reference not in REFERENCES:
        raise UserError(f"--reference {setup.reference!r} is unknown; use {', '.join(REFERENCES)}.")
    if setup.reference == "adapters" and setup.lora_fraction == 1:
        raise UserError("--reference adapters is the LoRA policy's own forward with its adapters off: give "
                        "--lora_fraction, the adapters' share of the parameters (e.g. 0.01).")
    if setup.activation_offloading and not setup.activation_checkpointing:
        raise UserError("--activation_offloading moves the checkpointed blocks' inputs to host memory: add "
                        "--activation_checkpointing.")
    if setup.dtype not in ("fp32", "bf16"):
        raise UserError(f"--dtype {setup.dtype!r} is unknown; use fp32 or bf16.")
    sp = setup.sequence_parallel
    if sp > 1:
        if setup.seq_len % sp or (setup.num_gpus * setup.num_nodes) % sp:
            raise UserError(f"--sp {sp} must divide --seq_len ({setup.seq_len}) and the GPUs "
                            f"({setup.num_gpus * setup.num_nodes}).")
        others = [e.name for e in engines if not e.is_deepspeed]
        if others:
            raise UserError(f"--sp {sp}: sequence parallelism runs under DeepSpeed ZeRO only (accelerate's Ulysses "
                            f"backend); drop {', '.join(others)} from --engines.")
    rank_seq_len = setup.seq_len // sp  # [SP] a rank's positions of every row
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
        activations = transient = terms = None
        if setup.arch is not None:
            activations = activation_bytes(setup.arch, seq_len=rank_seq_len, micro_batch_size=setup.micro_batch_size,
                                           activation_checkpointing=setup.activation_checkpointing,
                                           attention=setup.attention, dtype=setup.dtype,
                                           loss_chunk_tokens=setup.loss_chunk_tokens,
                                           activation_offloading=setup.activation_offloading)
            transient = transient_bytes(engine, setup.arch, dtype=setup.dtype, trainable_fraction=setup.lora_fraction)
            terms = peak_terms(engine, setup.arch, seq_len=rank_seq_len, micro_batch_size=setup.micro_batch_size,
                               dtype=setup.dtype, activation_checkpointing=setup.activation_checkpointing,
                               attention=setup.attention, packed_rows=setup.packed_rows and sp == 1,
                               loss_chunk_tokens=setup.loss_chunk_tokens, trainable_fraction=setup.lora_fraction,
                               sequence_parallel=sp)
        reference = (0, 0) if setup.reference == "none" else reference_model_bytes(
            engine, setup.reference_params or setup.num_params, world, setup.dtype, shard_group_size=group,
            held_as=setup.reference)
        on_host = offloaded_activation_bytes(setup.arch, seq_len=rank_seq_len, micro_batch_size=setup.micro_batch_size,
                                             dtype=setup.dtype) if setup.activation_offloading and setup.arch else 0
        results.append(EngineEstimate(engine, states, activations, transient, *reference, peak_terms=terms,
                                      activation_cpu_bytes=on_host))
    return results


def fits(result: EngineEstimate, gpu_memory_bytes: int) -> bool:
    """Whether `result`'s total stays within the GPU's bytes less SAFETY_MARGIN. Needs activations (an arch)."""
    if result.total_bytes is None:
        raise UserError("--device_memory needs activation estimates; pass --model, or --hidden_size, --num_layers and "
                        "--vocab_size.")
    return result.total_bytes <= gpu_memory_bytes * (1 - SAFETY_MARGIN)


def cheapest_fit(results: list[EngineEstimate], gpu_memory_bytes: int) -> EngineEstimate | None:
    """The first result (ENGINES order: least communication first) that fits, or None."""
    return next((r for r in results if fits(r, gpu_memory_bytes)), None)


def launch_command(engine: Engine, num_gpus: int, num_nodes: int = 1, hsdp: bool = False,
                   recipe: str = "recipes/llama_zero3.py", sequence_parallel: int = 1) -> str:
    """The `accelerate launch` line of `recipe` for `engine` (accelerate's --num_processes counts all nodes'
    processes); with `sequence_parallel` > 1 its `_sp` YAML and the SP and data-parallel sizes."""
    sp = (f" --parallelism_config_sp_size {sequence_parallel} --parallelism_config_dp_shard_size "
          f"{num_gpus * num_nodes // sequence_parallel}") if sequence_parallel > 1 else ""
    line = (f"accelerate launch --config_file accelerate_configs/{engine.name}{'_sp' if sp else ''}.yaml "
            f"--num_processes {num_gpus * num_nodes}{sp}")
    if num_nodes > 1:
        line += (f" --num_machines {num_nodes} --machine_rank <0..{num_nodes - 1}> --main_process_ip <node 0 address>"
                 " --main_process_port 29500")
        if hsdp and engine.is_fsdp2:
            line += f" --parallelism_config_dp_replicate_size {num_nodes} --parallelism_config_dp_shard_size {num_gpus}"
    return f"{line} {recipe}"


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
    if setup.activation_offloading:
        notes.append("activation offloading (the recipes' --activation_offloading): the checkpointed blocks' inputs "
                     f"wait in host memory (cpu/rank counts them), at most {OFFLOAD_INPUTS_ON_DEVICE} on the GPU at "
                     "once.")
    if setup.reference == "precomputed":
        notes.append("reference: precomputed (recipes/llama_dpo.py --reference precomputed): the frozen copy scores "
                     "every pair before the policy is built and is freed; training holds 0 bytes of it (the pass "
                     "itself holds the copy and one no-grad forward, less than training).")
    if setup.reference == "adapters":
        notes.append("reference: the LoRA policy's own forward with its adapters off (recipes/llama_dpo_lora.py): "
                     "no second model, 0 bytes.")
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
            "model_state_bytes": r.model_states.gpu_bytes, "reference_bytes": r.reference_bytes,
            "cpu_bytes": r.cpu_bytes,
            "activation_bytes": r.activation_bytes, "transient_bytes": r.transient_bytes,
            **{f"{name}_bytes": (r.peak_terms or {}).get(name) for name in TERMS},
            "total_bytes": r.total_bytes, "fits": fits(r, gpu_memory_bytes) if gpu_memory_bytes else None,
        } for r in results],
        "cheapest_fit": chosen.engine.name if chosen else None,
        "command": launch_command(chosen.engine, setup.num_gpus, setup.num_nodes, setup.hsdp,
                                  sequence_parallel=setup.sequence_parallel) if chosen else None,
        "advice": _advice(setup, gpu_memory_bytes) if gpu_memory_bytes and not chosen else [],
        "notes": _notes(setup) + ([f"CPU offload needs cpu/rank x {setup.num_gpus} of host memory per node."]
                                  if any(r.cpu_bytes for r in results) else []),
    }




@dataclass(frozen=True)
class FitVerdict:
    """Whether one run fits its device. `total_bytes`: what one rank needs (the estimate's total, plus its offloaded
    bytes where host memory is the device); `usable_bytes` = capacity x (1 - SAFETY_MARGIN). `status`: 'fits',
    'tight' (above TIGHT_FRACTION of usable: fits, warned) or 'too_big'; `advice`: for 'too_big', one sentence
    naming the cheapest engine or setting that fits with its launch line, or, when nothing does, the most offloaded
    config's need and the number of GPUs that would fit."""

    estimate: EngineEstimate
    total_bytes: int
    capacity_bytes: int
    usable_bytes: int
    status: str
    advice: str = ""


def _need(result: EngineEstimate, device_is_host: bool) -> int:
    return result.total_bytes + (result.cpu_bytes if device_is_host else 0)


def _first_fit(setup: Setup, usable: int, device_is_host: bool, engines: tuple[Engine, ...] = ENGINES):
    return next((r for r in estimate(setup, engines) if _need(r, device_is_host) <= usable), None)


def fit_verdict(setup: Setup, engine: Engine, capacity_bytes: int, *, device_is_host: bool = False,
                recipe: str = "recipes/llama_zero3.py") -> FitVerdict:
    """Whether a run of `engine` with `setup` (which needs an architecture) fits `capacity_bytes` per rank, by the
    rule of `fits` (SAFETY_MARGIN kept free), and if not, what does. The advice tries, in order, without CPU
    offload: another engine with the same settings (ENGINES order: least communication first); then
    `--gradient_checkpointing`; then also `--per_device_batch_size 1`. When none fits it says so, names the offload
    config that needs the least device memory (whether it fits or not) and the number of GPUs (nodes doubled, up to
    1024x) on which an engine fits without offload, with the first of those settings that makes it fit.
    `device_is_host`: the device is the host's memory (a CPU run), which also holds what an engine offloads, so
    offload configs are not offered. Launch lines name `recipe`.
    Engines: all (fsdp2_hsdp as fsdp2 with `setup.hsdp`). Units: bytes."""
    if setup.arch is None:
        raise ValueError("fit_verdict needs setup.arch for activations and transients")
    usable = int(capacity_bytes * (1 - SAFETY_MARGIN))
    hsdp = engine.hsdp or setup.hsdp
    mine = estimate(replace(setup, hsdp=hsdp), (replace(engine, hsdp=False),))[0]
    need = _need(mine, device_is_host)

    def verdict(status: str, advice: str = "") -> FitVerdict:
        return FitVerdict(mine, need, capacity_bytes, usable, status, advice)

    if need <= usable:
        return verdict("tight" if need > TIGHT_FRACTION * usable else "fits")
    sp = setup.sequence_parallel
    in_memory = SP_ENGINES if sp > 1 else tuple(e for e in ENGINES if not e.offload)
    unit, units = ("process", "processes") if device_is_host else ("GPU", "GPUs")

    def line(result: EngineEstimate, trial: Setup, flags: str = "") -> str:
        command = launch_command(result.engine, trial.num_gpus, trial.num_nodes, trial.hsdp, recipe, sp)
        return f"{result.engine} fits ({format_bytes(_need(result, device_is_host))} per {unit}): {command}{flags}"

    tried = []  # (settings, the flags that say them)
    for trial, flags in ((setup, ""), (replace(setup, activation_checkpointing=True), " --gradient_checkpointing"),
                         (replace(setup, activation_checkpointing=True, micro_batch_size=1),
                          " --gradient_checkpointing --per_device_batch_size 1 (raise --gradient_accumulation_steps "
                          "to keep the global batch)")):
        if all(trial != t for t, _ in tried):
            tried.append((trial, flags))
            found = _first_fit(trial, usable, device_is_host, in_memory)
            if found is not None:
                return verdict("too_big", line(found, trial, flags))
    world = setup.num_gpus * setup.num_nodes
    parts = [f"nothing fits on {world} {units if world > 1 else unit} of {format_bytes(capacity_bytes)}"
             + ("" if device_is_host else " without CPU offload")]
    if not device_is_host and sp == 1:  # no offload config ships with sequence parallelism
        offloaded = min(estimate(setup, tuple(e for e in ENGINES if e.offload)), key=lambda r: r.total_bytes)
        parts.append(f"of the CPU-offload configs {offloaded.engine} needs least: "
                     + (line(offloaded, setup) if offloaded.total_bytes <= usable else
                        f"{format_bytes(offloaded.total_bytes)} per GPU"))
    for nodes in (2**k * setup.num_nodes for k in range(1, 11)):
        for trial, flags in ((replace(t, num_nodes=nodes, hsdp=False), f) for t, f in tried):
            found = _first_fit(trial, usable, device_is_host, in_memory)
            if found is not None:
                parts.append(f"on {setup.num_gpus * nodes} {units} ({nodes} nodes of {setup.num_gpus}) "
                             + line(found, trial, flags))
                return verdict("too_big", "; ".join(parts))
    least = estimate(tried[-1][0], (in_memory[-1],))[0].activation_bytes
    parts.append(f"no number of {units} up to {world * 1024} fits: even with --gradient_checkpointing and "
                 f"--per_device_batch_size 1 the activations alone need {format_bytes(least)}; shorten --seq_len")
    return verdict("too_big", "; ".join(parts))
