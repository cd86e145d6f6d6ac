"""How close each engine comes to its limits, measured side by side on this machine (CPU, gloo).

    python benchmarks/run.py --output_dir runs/bench            # every row: world sizes 1, 2, 4; 3 repeats
    python benchmarks/run.py --quick --output_dir runs/bench    # world size 2 only; 3 repeats; < 10 min
    python benchmarks/run.py --smoke --output_dir runs/bench    # CI: --quick with 1 repeat and 6 short steps

Rows (results.json keys; docs/BENCHMARKS.md explains each and holds the figures):
    memory         model-state bytes per rank of every engine vs the ZeRO limit 16 Psi / N (fp32 AdamW: params 4 +
                   grads 4 + moments 8 bytes per parameter, divided over N ranks) and vs the engine's own formula;
                   the excess over the limit split into params / grads / optimizer (where it comes from).
    comms          elements moved per rank in one steady-state optimizer step (step 3), counted at the collectives,
                   vs the ZeRO paper: DDP and ZeRO-1/2 2 Psi, ZeRO-3 3 Psi. Convention: all-reduce of n elements
                   counts 2n (reduce-scatter + all-gather, as the paper counts it), all-gather n (the gathered
                   tensor), reduce-scatter n (the full input), reduce and broadcast n.
    overhead       recipes/llama_zero3.py at world size 1 vs benchmarks/plain_loop.py (plain PyTorch), tokens/s.
    trainer        the recipe vs benchmarks/trainer_baseline.py (transformers Trainer) under fsdp2.yaml and
                   zero3.yaml at 2 processes: tokens/s and peak memory per rank; the Trainer's sharding asserted.
                   Also the recipe under ZeRO-3 with DeepSpeed's default bucket sizes, the Trainer's (ours: the hidden
                   size's, at least 25 MiB: zero_utils.formulas.model_states.deepspeed_bucket_elements).
    sharding_cost  step time of each engine / DDP's at world size 2 and 4, plus FSDP2 prepared by accelerate itself
                   (benchmarks/recipe_probe.py skips zero_utils.model.wrapping) vs ours.
The machine is shared and noisy: every timing is a ratio of runs interleaved within one repeat (A B A B ...),
over --repeats repeats; results give the median ratio and its min-max. Throughput of a run = global tokens per
step / median step time over the steps after the first 4 (step 3 is the profiled one in comms runs).
Writes --output_dir/results.json and results.md (the table, also printed at the end).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import make_model  # noqa: E402  (benchmarks/memory.py: the 3.3M-parameter Llama of the tests)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from zero_utils.launch.launcher import accelerate_launch_command, config_file, free_port  # noqa: E402

ENGINES = ["ddp", "zero1", "zero2", "zero3", "fsdp2", "fsdp2_zero2"]
ACCELERATE_PREP = "fsdp2_accelerate_prep"  # FSDP2 wrapped by accelerate's prepare instead of zero_utils.model.wrapping
TRAINER_ENGINES = ["fsdp2", "zero3"]
# ZeRO-3 with DeepSpeed's default bucket sizes, as the Trainer gets them from the same YAML (our runtime sizes them
# from the hidden size, with a floor): isolates that one difference in the Trainer comparison.
DS_DEFAULT_BUCKETS = "zero3_default_buckets"
WARMUP_STEPS = 4  # left out of every median: first-step setup, and step 3, which comms runs profile
COMMS_STEP = 3
# ZeRO paper (Rajbhandari et al. 2020, section 7): elements per rank per step, in units of Psi.
COMMS_THEORY_PSI = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3, "fsdp2": 3, "fsdp2_zero2": 2, ACCELERATE_PREP: 3}
# The ZeRO limit in fp32 with AdamW, per parameter over N ranks, split by kind.
LIMIT_BYTES_PER_PARAM = {"params": 4, "grads": 4, "optimizer": 8}


@dataclass
class Bench:
    """What every launch of one benchmark run shares: its arguments, folders, environment and recipe flags."""

    args: argparse.Namespace
    command: str  # how this run was started, for results.json
    out_dir: Path
    env: dict
    common: list
    recipe_flags: list
    started: float = field(default_factory=time.time)
    retried: list = field(default_factory=list)  # launches that failed once and passed on their retry

    @property
    def world_sizes(self) -> list[int]:
        """World sizes of the comms and sharding-cost rows."""
        return [2] if self.args.quick else [2, 4]

    @property
    def memory_world_sizes(self) -> list[int]:
        """World sizes of the memory rows (world size 1: model states only)."""
        return [2] if self.args.quick else [1, 2, 4]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--quick", action="store_true", help="world size 2 only (memory, comms, sharding cost)")
    parser.add_argument("--smoke", action="store_true", help="--quick, 1 repeat, 6 steps of 128 tokens (CI)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max_steps", type=int, default=12)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--per_device_batch_size", type=int, default=4)
    return parser


def _bench(args: argparse.Namespace, command: str) -> Bench:
    if args.smoke:
        args.quick, args.repeats, args.max_steps, args.seq_len = True, 1, WARMUP_STEPS + 2, 128
    out_dir = Path(args.output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    # A fixed glibc mmap threshold makes peak RSS comparable between processes: with glibc's dynamic threshold,
    # freed large blocks raise it and later ones stay on the heap, so RSS depends on the order of allocations
    # (measured under zero3.yaml: the recipe 55-90 MB/rank above the Trainer with the dynamic threshold, 5-10 MB
    # below with this one).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled", "MALLOC_MMAP_THRESHOLD_": "131072"}
    model_dir = (make_model(out_dir / "model") if not (out_dir / "model/config.json").exists()
                 else str(out_dir / "model"))
    common = ["--model", model_dir, "--seq_len", str(args.seq_len), "--per_device_batch_size",
              str(args.per_device_batch_size)]
    recipe_flags = common + ["--overwrite", "--eval_fraction", "0", "--max_new_tokens", "0", "--report_to", "none"]
    return Bench(args, command, out_dir, env, common, recipe_flags)


def launch(bench: Bench, script: str, name: str, world: int, config: str | None, flags: list,
           extra_env: dict | None = None) -> Path:
    """`accelerate launch` a script the way users do (its own free port: launches on one port collide)."""
    run_dir = bench.out_dir / "runs" / name
    cmd = accelerate_launch_command(REPO / script, ["--output_dir", run_dir, *flags],
                                    config_file=config_file(config) if config else None, num_processes=world,
                                    main_process_port=free_port(), mixed_precision="no")
    t0 = time.time()
    for attempt in range(2):  # a shared machine: one retry when a rank dies from outside (seen: SIGKILL)
        proc = subprocess.run(cmd, cwd=REPO, env={**bench.env, **(extra_env or {})}, capture_output=True, text=True)
        if proc.returncode == 0:
            break
        if attempt == 1:
            raise RuntimeError(f"{name} failed ({proc.returncode}):\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
        bench.retried.append(name)
        print(f"  {name} failed ({proc.returncode}), retrying once:\n{proc.stderr[-600:]}", flush=True)
        cmd[cmd.index("--main_process_port") + 1] = str(free_port())
    print(f"  [{time.time() - bench.started:6.0f} s] {name}: {time.time() - t0:.0f} s", flush=True)
    return run_dir


def recipe(bench: Bench, engine: str, world: int, repeat: int, steps: int, count_comms: bool = False) -> dict:
    """One recipe launch; returns its summary plus tokens_per_s over the steps after WARMUP_STEPS."""
    name = f"{engine}-{world}x-r{repeat}"
    # recipes/llama_zero3.py through the probe, which adds the per-rank evidence (sharding_per_rank) to summary.json
    extra_env, script = {}, "benchmarks/recipe_probe.py"
    if count_comms:
        extra_env.update(BENCH_COMMS_STEP=str(COMMS_STEP),
                         BENCH_COMMS_FILE=str(bench.out_dir / "runs" / f"{name}.comms"))
    if engine == ACCELERATE_PREP:
        extra_env["BENCH_ACCELERATE_FSDP2_PREP"] = "1"
    if engine == DS_DEFAULT_BUCKETS:
        extra_env["BENCH_DEEPSPEED_DEFAULT_BUCKETS"] = "1"
    config = {ACCELERATE_PREP: "fsdp2", DS_DEFAULT_BUCKETS: "zero3", "single": None}.get(engine, engine)
    run_dir = launch(bench, script, name, world, config, bench.recipe_flags + ["--max_steps", str(steps)], extra_env)
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times_s = [summary["global_batch_rows"] * bench.args.seq_len / m["tokens_per_s"] for m in metrics]
    summary["tokens_per_s"] = summary["global_batch_rows"] * bench.args.seq_len / statistics.median(
        step_times_s[WARMUP_STEPS:] or step_times_s)  # the 2-step memory runs have no steady state to time
    summary["step_times_s"] = step_times_s
    if count_comms:
        summary["comms"] = json.loads((bench.out_dir / "runs" / f"{name}.comms.rank0").read_text())
    return summary


def script_run(bench: Bench, script: str, name: str, world: int, config: str | None, result_file: str) -> dict:
    flags = bench.common + ["--max_steps", str(bench.args.max_steps), "--untimed_steps", str(WARMUP_STEPS)]
    return json.loads((launch(bench, script, name, world, config, flags) / result_file).read_text())


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def run_all(bench: Bench) -> dict:
    """Every launch, interleaved: each repeat runs every candidate once, in the same order, so a slow minute on
    the shared machine hits all of them. Returns {(label, world size): [summary per repeat]}."""
    args = bench.args
    runs = {}  # (label, world) -> list over repeats
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
        for world in bench.world_sizes:
            for engine in ENGINES + [ACCELERATE_PREP]:
                count_comms = repeat == 0 and world == 2
                runs.setdefault((engine, world), []).append(
                    recipe(bench, engine, world, repeat, args.max_steps, count_comms))
            if world == 2:
                for engine in TRAINER_ENGINES:
                    runs.setdefault((f"trainer_{engine}", 2), []).append(script_run(
                        bench, "benchmarks/trainer_baseline.py", f"trainer_{engine}-2x-r{repeat}", 2, engine,
                        "trainer.json"))
                runs.setdefault((DS_DEFAULT_BUCKETS, 2), []).append(
                    recipe(bench, DS_DEFAULT_BUCKETS, 2, repeat, args.max_steps))
        runs.setdefault(("single", 1), []).append(recipe(bench, "single", 1, repeat, args.max_steps))
        runs.setdefault(("plain_loop", 1), []).append(script_run(
            bench, "benchmarks/plain_loop.py", f"plain_loop-1x-r{repeat}", 1, None, "plain_loop.json"))
    for world in bench.memory_world_sizes:  # world size 1: model states only (2 steps)
        if world not in bench.world_sizes:
            for engine in ENGINES:
                runs[(engine, world)] = [recipe(bench, engine, world, 0, 2)]
    return runs


def rows(bench: Bench, runs: dict) -> dict:
    """results.json: the rows docs/BENCHMARKS.md explains, from the launches' summaries."""
    args = bench.args
    results = {"date": time.strftime("%Y-%m-%d"), "machine": {
        "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), platform.processor()), "cores": os.cpu_count(), "gpu": None},
        "command": bench.command, "settings": {
        "repeats": args.repeats, "max_steps": args.max_steps, "warmup_steps": WARMUP_STEPS, "seq_len": args.seq_len,
        "per_device_batch_size": args.per_device_batch_size, "precision": "fp32",
        "model": "Llama, hidden 256, 4 layers"}}
    psi = runs[("ddp", 2)][0]["num_params"]
    results["num_params"] = psi

    results["memory"] = []
    for world in bench.memory_world_sizes:
        for engine in ENGINES + ([ACCELERATE_PREP] if world > 1 else []):
            s = runs[(engine, world)][0]
            limit = 16 * psi / world
            breakdown = s["model_state_breakdown_bytes"]
            excess = {k: breakdown[k] - LIMIT_BYTES_PER_PARAM[k] * psi / world for k in LIMIT_BYTES_PER_PARAM}
            results["memory"].append({
                "engine": engine, "world_size": world, "engine_run": s["engine"],
                "model_state_bytes": s["model_state_bytes"],
                "model_state_bytes_expected": s["model_state_bytes_expected"], "limit_bytes": limit,
                "measured_over_limit": s["model_state_bytes"] / limit,
                "measured_over_expected": s["model_state_bytes"] / s["model_state_bytes_expected"],
                "breakdown_bytes": breakdown, "excess_over_limit_bytes": excess,
                "excess_over_limit_bytes_per_param_times_n": {k: v * world / psi for k, v in excess.items()}})

    results["comms"] = []
    for engine in ENGINES + [ACCELERATE_PREP]:
        comms = runs[(engine, 2)][0]["comms"]
        n = comms["nelems"]
        # The convention of the module docstring: an all-reduce is a reduce-scatter plus an all-gather.
        volume = 2 * n["all_reduce"] + n["all_gather"] + n["reduce_scatter"] + n["reduce"] + n["broadcast"]
        results["comms"].append({
            "engine": engine, "world_size": 2, "elements": n, "volume_elements": volume, "volume_psi": volume / psi,
            "bytes": volume * 4, "theory_psi": COMMS_THEORY_PSI[engine],
            "measured_over_theory": volume / psi / COMMS_THEORY_PSI[engine], "calls": comms["calls"],
            "dtypes": comms["dtypes"]})

    recipe_tps = [r["tokens_per_s"] for r in runs[("single", 1)]]
    plain_tps = [r["tokens_per_s"] for r in runs[("plain_loop", 1)]]
    results["overhead"] = {"recipe_tokens_per_s": spread(recipe_tps), "plain_loop_tokens_per_s": spread(plain_tps),
                           "recipe_over_plain": spread([a / b for a, b in zip(recipe_tps, plain_tps, strict=True)])}

    results["trainer"] = []
    for engine in TRAINER_ENGINES:
        ours, theirs = runs[(engine, 2)], runs[(f"trainer_{engine}", 2)]
        results["trainer"].append({
            "engine": engine, "world_size": 2, "trainer_engine": theirs[0]["engine"],
            "trainer_local_param_fraction_per_rank": theirs[0]["local_param_fraction_per_rank"],
            "recipe_tokens_per_s": spread([r["tokens_per_s"] for r in ours]),
            "trainer_tokens_per_s": spread([r["tokens_per_s"] for r in theirs]),
            "recipe_over_trainer_tokens_per_s": spread([a["tokens_per_s"] / b["tokens_per_s"]
                                                        for a, b in zip(ours, theirs, strict=True)]),
            "recipe_peak_mem_bytes": spread([r["peak_mem_bytes"] for r in ours]),
            "trainer_peak_mem_bytes": spread([r["peak_mem_bytes"] for r in theirs])})
    default_buckets, trainer_zero3 = runs[(DS_DEFAULT_BUCKETS, 2)], runs[("trainer_zero3", 2)]
    results["zero3_default_buckets"] = {
        "world_size": 2, "tokens_per_s": spread([r["tokens_per_s"] for r in default_buckets]),
        "over_trainer_tokens_per_s": spread([a["tokens_per_s"] / b["tokens_per_s"]
                                             for a, b in zip(default_buckets, trainer_zero3, strict=True)]),
        "over_recipe_tokens_per_s": spread([a["tokens_per_s"] / b["tokens_per_s"]
                                            for a, b in zip(default_buckets, runs[("zero3", 2)], strict=True)]),
        "peak_mem_bytes": spread([r["peak_mem_bytes"] for r in default_buckets])}

    results["sharding_cost"] = []
    for world in bench.world_sizes:
        ddp = runs[("ddp", world)]
        for engine in ENGINES + [ACCELERATE_PREP]:
            mine = runs[(engine, world)]
            results["sharding_cost"].append({
                "engine": engine, "world_size": world, "tokens_per_s": spread([r["tokens_per_s"] for r in mine]),
                "step_time_over_ddp": spread([d["tokens_per_s"] / r["tokens_per_s"]
                                              for r, d in zip(mine, ddp, strict=True)])})
        ours, theirs = runs[("fsdp2", world)], runs[(ACCELERATE_PREP, world)]
        results.setdefault("fsdp2_ours_vs_accelerate_prep", []).append({
            "world_size": world, "accelerate_prep_step_time_over_ours": spread(
                [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs, strict=True)]),
            "ours_model_state_bytes": ours[0]["model_state_bytes"], "accelerate_prep_model_state_bytes":
                theirs[0]["model_state_bytes"], "ours_fsdp_units": ours[0]["sharding_per_rank"][0]["fsdp_units"],
            "accelerate_prep_fsdp_units": theirs[0]["sharding_per_rank"][0]["fsdp_units"]})
    results["elapsed_s"] = time.time() - bench.started
    results["retried_launches"] = bench.retried
    return results


def rng(s: dict, fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def md_table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def report(results: dict, args: argparse.Namespace) -> str:
    """results.md: the tables of results.json."""
    psi = results["num_params"]
    mb = 1e6
    machine = results["machine"]
    lines = [f"# Benchmarks ({results['date']}, {machine['cpu']}, {machine['cores']} cores, no GPU)",
             "", f"`{results['command']}`: {psi:,} parameters, fp32, seq_len {args.seq_len}, "
             f"{args.per_device_batch_size} rows per rank, {args.repeats} interleaved repeats, "
             f"{results['elapsed_s']:.0f} s. MB = 1e6 bytes. Ratios: median (min-max) over repeats.", "",
             "## Model-state bytes per rank vs the ZeRO limit 16 Psi / N", ""]
    lines += md_table(
        ["engine", "N", "measured MB", "limit MB", "measured / limit", "engine formula MB", "measured / formula",
         "excess params / grads / optimizer (bytes per param x N)"],
        [[r["engine"], r["world_size"], f"{r['model_state_bytes'] / mb:.2f}", f"{r['limit_bytes'] / mb:.2f}",
          f"{r['measured_over_limit']:.4f}", f"{r['model_state_bytes_expected'] / mb:.2f}",
          f"{r['measured_over_expected']:.4f}", " / ".join(
              f"{r['excess_over_limit_bytes_per_param_times_n'][k]:+.2f}" for k in LIMIT_BYTES_PER_PARAM)]
         for r in results["memory"]])
    lines += ["", "## Communication per rank, one steady-state step, 2 ranks (elements; x4 for bytes in fp32)", ""]
    lines += md_table(
        ["engine", "all-reduce", "all-gather", "reduce-scatter", "reduce", "broadcast", "volume (Psi)", "theory (Psi)",
         "measured / theory"],
        [[r["engine"], *(f"{r['elements'][k]:,}" for k in ("all_reduce", "all_gather", "reduce_scatter", "reduce",
                                                            "broadcast")),
          f"{r['volume_psi']:.3f}", r["theory_psi"], f"{r['measured_over_theory']:.3f}"] for r in results["comms"]])
    o = results["overhead"]
    lines += ["", "## Overhead of the recipe (world size 1)", "",
              f"recipe / plain PyTorch loop, tokens/s: **{rng(o['recipe_over_plain'])}** (recipe "
              f"{rng(o['recipe_tokens_per_s'], '{:.0f}')}, plain {rng(o['plain_loop_tokens_per_s'], '{:.0f}')} "
              "tokens/s)",
              "", "## Recipe vs transformers Trainer, same accelerate config, 2 processes", ""]
    lines += md_table(
        ["config", "recipe / Trainer tokens/s", "recipe tokens/s", "Trainer tokens/s", "recipe peak MB/rank",
         "Trainer peak MB/rank", "Trainer local param fraction"],
        [[r["engine"], rng(r["recipe_over_trainer_tokens_per_s"]), rng(r["recipe_tokens_per_s"], "{:.0f}"),
          rng(r["trainer_tokens_per_s"], "{:.0f}"), f"{r['recipe_peak_mem_bytes']['median'] / mb:.0f}",
          f"{r['trainer_peak_mem_bytes']['median'] / mb:.0f}", r["trainer_local_param_fraction_per_rank"]]
         for r in results["trainer"]])
    z = results["zero3_default_buckets"]
    lines += ["", f"ZeRO-3 recipe with DeepSpeed's default bucket sizes (the Trainer's), tokens/s over the Trainer's: "
              f"**{rng(z['over_trainer_tokens_per_s'])}**, over the recipe's (its own bucket sizes): "
              f"{rng(z['over_recipe_tokens_per_s'])}; peak {z['peak_mem_bytes']['median'] / mb:.0f} MB/rank."]
    lines += ["", "## Cost of sharding: step time / DDP's, same model and batch", ""]
    lines += md_table(["engine", "N", "step time / DDP", "tokens/s"],
                      [[r["engine"], r["world_size"], rng(r["step_time_over_ddp"]), rng(r["tokens_per_s"], "{:.0f}")]
                       for r in results["sharding_cost"]])
    for r in results["fsdp2_ours_vs_accelerate_prep"]:
        lines.append(f"\nFSDP2 at {r['world_size']} ranks, accelerate's own preparation / ours, step time: "
                     f"**{rng(r['accelerate_prep_step_time_over_ours'])}**; FSDP units ours {r['ours_fsdp_units']}, "
                     f"accelerate's {r['accelerate_prep_fsdp_units']}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench = _bench(_parser().parse_args(argv), " ".join(["python", "benchmarks/run.py", *argv]))
    results = rows(bench, run_all(bench))
    table = report(results, bench.args)
    out_dir = bench.out_dir
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "results.md").write_text(table)
    print("\n" + table)
    print(f"wrote {out_dir / 'results.json'} and {out_dir / 'results.md'} ({results['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
