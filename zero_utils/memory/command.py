"""`python -m zero_utils.memory`: the memory estimator's command line (the estimate: zero_utils.memory.estimate; the
formulas behind it: zero_utils.formulas.model_states). Prints a table (or --json) of the per-GPU bytes of every engine
and, with --device_memory, the cheapest engine that fits and its launch line. A user error prints one line, exit 2.
Example: `python -m zero_utils.memory --params 7B --num_gpus 8` (see --help).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from zero_utils.formulas.model_states import OPTIMIZERS, REFERENCES, architecture_from_sizes
from zero_utils.formulas.peak_terms import TERM_NAMES, TERMS
from zero_utils.memory.estimate import (
    ENGINES,
    SP_ENGINES,
    Setup,
    architecture_from_model,
    engine_named,
    estimate,
    parse_bytes,
    report,
)
from zero_utils.run.errors import UserError

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


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


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line through main(), not argparse's usage block
        raise UserError(f"{message}; see --help.")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m zero_utils.memory", allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Per-GPU memory of model states, activations and engine buffers for DDP, DeepSpeed "
                            "ZeRO-1/2/3 and FSDP2,\nand the cheapest engine that fits (formulas: the docstring "
                            "of zero_utils/memory/command.py).",
                epilog="example: python -m zero_utils.memory --model Qwen/Qwen2.5-7B --num_gpus 8 "
                       "--device_memory 80GB --activation_checkpointing")
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
    cluster.add_argument("--device_memory", "--gpu_memory", dest="device_memory", metavar="SIZE",
                         help="memory of one GPU (80GB, 80GiB, 80e9): marks what fits and names the cheapest engine "
                         "that does; the recipes' fit check takes the same flag (--gpu_memory: an alias)")
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
    training.add_argument("--reference", default=d.reference, choices=REFERENCES, help="model: a preference "
                          "loss's frozen reference model (recipes/llama_dpo.py), in the compute dtype, held as the "
                          "engine holds params; adapters: the LoRA policy with its adapters off "
                          "(recipes/llama_dpo_lora.py, with --lora_fraction): no second model, 0 bytes; precomputed: "
                          "the copy scores every pair once and is freed before training, 0 bytes "
                          "(default: %(default)s)")
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
    activations.add_argument("--activation_offloading", action="store_true", help="with --activation_checkpointing: "
                             "the block inputs in host memory (cpu/rank), two at a time on the GPU")
    activations.add_argument("--attention", default=d.attention, choices=["sdpa", "eager", "flash"], help="sdpa and "
                             "flash keep no seq_len^2 scores; packed rows under sdpa add a block mask "
                             "(default: %(default)s)")
    activations.add_argument("--padded_rows", action="store_true", help="rows padded, not packed (the DPO recipes' "
                             "pairs): no block mask")
    activations.add_argument("--sp", type=int, default=d.sequence_parallel, metavar="N", help="DeepSpeed Ulysses "
                             "sequence parallelism: each GPU holds seq_len / N of every row (ZeRO engines only; "
                             "accelerate_configs/zero3_sp.yaml)")
    activations.add_argument("--loss_chunk_tokens", type=int, default=d.loss_chunk_tokens, metavar="N", help="the "
                             "recipes' flag: logits of N tokens at a time; 0 = the whole micro-batch's "
                             "(default: %(default)s)")
    for name, help_text in (("hidden_size", "needed with --num_layers and --vocab_size"), ("num_layers", ""),
                            ("vocab_size", ""), ("intermediate_size", "gated MLP; default 4 x hidden, GPT's MLP"),
                            ("num_heads", "needed for --attention eager"),
                            ("num_kv_heads", "grouped-query K/V heads (default: --num_heads)")):
        activations.add_argument(f"--{name}", type=int, metavar="N", help=help_text)
    output = p.add_argument_group("output")
    output.add_argument("--engines", default=",".join(e.name for e in ENGINES),
                        help="comma-separated (default: all, in the order of preference)")
    output.add_argument("--unit", default="GB", choices=["GB", "GiB"], help="table unit (default: GB = 1e9 bytes)")
    output.add_argument("--json", action="store_true", help="print JSON (bytes as integers) instead of the table")
    return p


def _setup_from_args(args) -> Setup:
    if bool(args.params) == bool(args.model):
        raise UserError("pass exactly one of --params (e.g. 7B) or --model (Hub id, folder or config.json).")
    sizes = {name: getattr(args, name) for name in ("hidden_size", "num_layers", "vocab_size", "intermediate_size",
                                                    "num_heads", "num_kv_heads") if getattr(args, name) is not None}
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
                 activation_checkpointing=args.activation_checkpointing,
                 activation_offloading=args.activation_offloading, attention=args.attention,
                 packed_rows=not args.padded_rows, loss_chunk_tokens=args.loss_chunk_tokens, formula=args.formula,
                 reference=args.reference, sequence_parallel=args.sp)



def format_report(data: dict, unit: str = "GB") -> str:
    """`report`'s data as an aligned text table in `unit` ('GB' = 1e9 bytes, 'GiB' = 2^30 bytes)."""
    scale, inputs = (1e9 if unit == "GB" else 2**30), data["inputs"]
    precision = "bf16 mixed precision (fp32 master)" if inputs["dtype"] == "bf16" else "fp32"
    trained = f", {inputs['lora_fraction']:g} trainable" if inputs["lora_fraction"] < 1 else ""
    loss = f"{inputs['loss_chunk_tokens']}-token chunks" if inputs["loss_chunk_tokens"] else "the whole logits"
    sp = inputs.get("sequence_parallel", 1)
    sp_text = f" over sequence parallelism {sp} ({inputs['seq_len'] // sp} positions per GPU)" if sp > 1 else ""
    lines = [f"Per-GPU memory in {unit} (1 {unit} = {'1e9' if unit == 'GB' else '2^30'} bytes); cpu/rank = host "
             "memory per rank.",
             f"{inputs['num_params']:,} params{trained}, {inputs['num_gpus']} GPUs x {inputs['num_nodes']} node(s), "
             f"{precision}, {inputs['optimizer']}.",
             f"Activations: seq_len {inputs['seq_len']}{sp_text}, micro-batch {inputs['micro_batch_size']}, "
             f"{inputs['attention']} attention, activation checkpointing "
             f"{'on' if inputs['activation_checkpointing'] else 'off'}"
             f"{' (inputs offloaded to host memory)' if inputs['activation_offloading'] else ''}, "
             f"loss over {loss}.", ""]
    columns = ("params", "grads", "optimizer", "states", "reference", "activations", "transient", "shapes", "total",
               "cpu/rank")
    keys = ("params_bytes", "grads_bytes", "optimizer_bytes", "model_state_bytes", "reference_bytes",
            "activation_bytes", "transient_bytes", "shape_bytes", "total_bytes", "cpu_bytes")
    for row in data["engines"]:  # "shapes": the peak terms of zero_utils.formulas.peak_terms, listed below the table
        terms = [row[f"{name}_bytes"] for name in TERMS]
        row["shape_bytes"] = None if None in terms else sum(terms)
    if inputs["reference"] == "none":  # the column only when there is a reference
        columns, keys = columns[:4] + columns[5:], keys[:4] + keys[5:]
    lines.append(f"{'engine':<14}" + "".join(f"{c:>12}" for c in columns) + "  fits")
    for row in data["engines"]:
        cells = "".join(f"{'n/a':>12}" if row[k] is None else f"{row[k] / scale:>12.2f}" for k in keys)
        lines.append(f"{row['engine']:<14}{cells}  {({True: 'yes', False: 'no'}).get(row['fits'], '-')}")
    lines += _shape_terms(data["engines"], scale, unit)
    if data["gpu_memory_bytes"]:
        usable = data["gpu_memory_bytes"] * (1 - data["safety_margin"])
        lines += ["", f"fits = total <= {usable / scale:.2f} {unit}: {1 - data['safety_margin']:.0%} of "
                      f"{data['gpu_memory_bytes'] / scale:.2f} {unit}, the rest kept for the CUDA context and "
                      "allocator fragmentation."]
        if data["cheapest_fit"]:
            lines += [f"cheapest that fits: {data['cheapest_fit']}", f"  {data['command']}"]
        lines += data["advice"]
    return "\n".join(lines + [f"note: {n}" for n in data["notes"]])


def _shape_terms(rows: list[dict], scale: float, unit: str) -> list[str]:
    """One line naming each non-zero term of the "shapes" column, with the engines it applies to."""
    parts = []
    for name in TERMS:
        values = {row["engine"]: row[f"{name}_bytes"] for row in rows if row[f"{name}_bytes"]}
        if values:
            which = "" if len(values) == len(rows) else f" ({', '.join(values)})"
            parts.append(f"{TERM_NAMES[name]} {max(values.values()) / scale:.2f}{which}")
    return ["", f"shapes ({unit}, zero_utils.formulas.peak_terms): {'; '.join(parts)}."] if parts else []


def main(argv: list[str] | None = None) -> int:
    """`python -m zero_utils.memory`: print the estimate; a user error prints one line and exits 2."""
    try:
        args = _parser().parse_args(argv)
        setup = _setup_from_args(args)
        engines = tuple(engine_named(name.strip()) for name in args.engines.split(",") if name.strip())
        if setup.sequence_parallel > 1 and args.engines == _parser().get_default("engines"):
            engines = SP_ENGINES  # [SP] DeepSpeed ZeRO, the engines with an _sp YAML
        results = estimate(setup, engines)
        gpu_memory_bytes = parse_bytes(args.device_memory) if args.device_memory else None
        data = report(setup, results, gpu_memory_bytes)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(data, indent=2) if args.json else format_report(data, args.unit))
    return 0
