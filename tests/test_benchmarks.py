"""The benchmarks run and every row they report is sane (never timed: performance claims live in docs/BENCHMARKS.md).

`benchmarks/run.py --smoke` launches every engine once at 2 processes (12 launches, about 3 minutes here);
`benchmarks/gpu.py --smoke` checks the GPU check's logic on the CPU with tiny shapes, from the wheels it carries."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, isolated_env

import zero_utils.formulas.model_states

ENGINES = ["ddp", "zero1", "zero2", "zero3", "fsdp2", "fsdp2_zero2", "fsdp2_accelerate_prep"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "benchmarks/run.py", "--smoke", "--output_dir", str(out)], cwd=REPO,
                          env=isolated_env(out), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "## Model-state bytes per rank" in proc.stdout  # the table is printed at the end
    assert (out / "results.md").exists()
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.distributed
def test_memory_rows(results):
    rows = {(r["engine"], r["world_size"]): r for r in results["memory"]}
    assert {e for e, _ in rows} == set(ENGINES)
    for engine in ("fsdp2", "fsdp2_zero2", "fsdp2_accelerate_prep"):  # no redundant copy anywhere
        assert abs(rows[(engine, 2)]["measured_over_limit"] - 1) < 0.02
    assert abs(rows[("ddp", 2)]["measured_over_limit"] - 2) < 0.02  # 16 Psi, the limit at N=2 is 8 Psi
    assert rows[("zero3", 2)]["measured_over_limit"] > 1.02  # DeepSpeed's excess over the limit is reported
    for r in rows.values():
        assert abs(r["measured_over_expected"] - 1) < 0.01, r  # the engine formulas hold


@pytest.mark.slow
@pytest.mark.distributed
def test_comm_rows(results):
    rows = {r["engine"]: r for r in results["comms"]}
    assert set(rows) == set(ENGINES)
    assert abs(rows["ddp"]["measured_over_theory"] - 1) < 0.01  # one all-reduce of every gradient
    assert rows["fsdp2"]["elements"]["reduce_scatter"] == results["num_params"]  # each gradient reduced once
    for r in rows.values():
        assert 0.4 < r["measured_over_theory"] < 2, r
    # DeepSpeed's buckets are sized with formulas.model_states's floor (25 MiB of fp32 elements), which holds all of
    # this model's gradients (3.3M elements): one gradient collective per step, as DDP's one 25 MiB bucket. With
    # accelerate's "auto" (h^2 = 65,536 elements) it was one per weight matrix (35 reduce-scatters, 33-41
    # all-reduces), 0.76x the Trainer's tokens/s.
    assert results["num_params"] < zero_utils.formulas.model_states.MIN_BUCKET_ELEMENTS
    assert rows["zero3"]["calls"]["c10d::_reduce_scatter_base_"] == 1
    for engine in ("zero1", "zero2"):
        assert rows[engine]["calls"]["c10d::allreduce_"] <= rows["ddp"]["calls"]["c10d::allreduce_"] + 1
    # The recipe's own bookkeeping (loss, grad norm, memory peaks, stop flag) is one all-gather per step under every
    # engine (distributed.reduce_step_values; the engines gather with _allgather_base_), and DDP's only
    # all-reduces are its two gradient buckets (the first is capped at 1 MiB): no scalar all-reduce is left.
    assert all(r["calls"]["c10d::allgather_"] == 1 for r in rows.values()), {e: r["calls"] for e, r in rows.items()}
    assert rows["ddp"]["calls"]["c10d::allreduce_"] == 2


@pytest.mark.slow
@pytest.mark.distributed
def test_timing_rows_and_trainer_really_shards(results):
    assert results["overhead"]["recipe_over_plain"]["median"] > 0
    assert {r["engine"] for r in results["sharding_cost"]} == set(ENGINES)
    assert all(r["step_time_over_ddp"]["median"] > 0 for r in results["sharding_cost"])
    assert [r["engine"] for r in results["trainer"]] == ["fsdp2", "zero3"]
    for r in results["trainer"]:
        assert r["trainer_engine"] == r["engine"]
        assert r["trainer_local_param_fraction_per_rank"] == [0.5, 0.5]  # not the silent single-process fallback
        assert r["recipe_peak_mem_bytes"]["median"] > 0 and r["trainer_peak_mem_bytes"]["median"] > 0
    assert results["zero3_default_buckets"]["over_trainer_tokens_per_s"]["median"] > 0


# The GPU image as issue 44 lists it (2026-11-17): what it has (with whatever they require), and what it lacks.
GPU_IMAGE_HAS = ["torch", "transformers", "accelerate", "tokenizers", "peft", "pyarrow", "xxhash", "msgpack",
                 "einops", "psutil", "py-cpuinfo", "ninja"]
GPU_IMAGE_LACKS = ["datasets", "dill", "multiprocess", "deepspeed", "hjson", "pydantic", "pydantic-core",
                   "annotated-types", "typing-inspection", "wandb"]


def _requires_closure(roots: list[str]) -> set[str]:
    """Every distribution `roots` need, by their installed Requires-Dist, for CPython 3.12 on x86_64 Linux."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    target = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    seen, todo = set(), [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            for line in metadata.requires(name) or []:
                requirement = Requirement(line)
                if requirement.marker is None or requirement.marker.evaluate(target):
                    todo.append(canonicalize_name(requirement.name))
    return seen


@pytest.mark.unit
def test_gpu_wheels_are_what_the_image_lacks_for_datasets_and_deepspeed():
    """benchmarks/gpu.py carries exactly the Requires-Dist closure of datasets and DeepSpeed (at our pins, read from
    this environment's metadata) less what the GPU image has: its packages and their own requirements, except the
    ones the image is known to lack (pydantic's family: newer huggingface-hub needs it, the image's does not)."""
    import importlib.util

    from packaging.utils import canonicalize_name

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks/gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)  # argparse runs in main() only
    on_image = _requires_closure(GPU_IMAGE_HAS) - {canonicalize_name(n) for n in GPU_IMAGE_LACKS}
    needed = _requires_closure(["datasets", "deepspeed"]) - on_image
    carried = {canonicalize_name(n) for n in gpu.WHEELS + gpu.BUILT_HERE}
    assert needed == carried
    assert {"pandas", "python-dateutil", "pydantic-core"} <= needed  # the closure is walked, not only the roots


@pytest.mark.slow
@pytest.mark.distributed
def test_gpu_check_runs_on_cpu_from_its_own_wheels(tmp_path):
    """The GPU check as the GPU machine runs it, on a CPU with tiny shapes: the wheels --download_wheels fetches
    (here for this Python), installed with --no-index --no-deps into a private --target that the steps import
    datasets and DeepSpeed from; every step passes; the recipe runs under FSDP2 and ZeRO-3 at accumulation 1 and 2
    (4 launches) and writes no checkpoint."""
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = isolated_env(tmp_path)
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--download_wheels", str(wheels), "--python_version",
                           python], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--smoke", "--output_dir", str(out), "--wheels",
                           str(wheels)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "| recipe_zero3_accum2 | ok |" in proc.stdout  # the closing table
    report = json.loads((out / "gpu.json").read_text())
    steps = {r["step"]: r for r in report["results"]}
    assert list(steps) == ["install", "environment", "attention", "chunked_head", "tokenizer_workers",
                           "recipe_fsdp2_accum1", "recipe_fsdp2_accum2", "recipe_zero3_accum1", "recipe_zero3_accum2",
                           "recipe_fsdp2_accum1_compiled", "recipe_fsdp2_accum1_offloaded"]
    compiled = steps.pop("recipe_fsdp2_accum1_compiled")  # skipped under --smoke, saying why
    assert compiled["status"] == "skipped" and "tests/test_compile.py" in compiled["reason"]
    assert {r["status"] for r in steps.values()} == {"ok"}, {k: r.get("log_tail") for k, r in steps.items()}
    assert report["wall_s"] < report["budget_s"] == 900  # --smoke's (the GPU's: 360)
    assert len(steps["install"]["result"]["installed"]) == len(list(wheels.glob("*.whl"))) == 12
    env_result = steps["environment"]["result"]
    for package in ("datasets", "deepspeed"):  # imported from the private folder, not from this environment
        assert env_result[f"{package}_imports"] is True and "gpu_check_site_" in env_result[f"{package}_from"]
    assert env_result["torch_2_13_only_missing"] == {} and env_result["matmul_peak_flops"] > 0  # torch 2.13 here
    ways = steps["attention"]["result"]["ways"]
    assert ways["packed_sdpa"]["loss_agrees"] and ways["unpacked_sdpa"]["loss_agrees"]
    assert ways["packed_sdpa"]["loss_tokens"] == ways["unpacked_sdpa"]["loss_tokens"] > 0
    assert any("scaled_dot_product" in k for k in ways["packed_sdpa"]["kernels"])
    assert "skipped" in ways["flash_varlen"]  # flash_attn is not installed here
    head = steps["chunked_head"]["result"]
    assert head["chunked"]["chunked"] and not head["whole_logits"]["chunked"]
    assert head["max_token_loss_difference"] < 1e-4
    workers = steps["tokenizer_workers"]["result"]
    assert workers["same_tokens"] and workers["examples"] == 4000 and workers["num_proc_2"]["examples_per_s"] > 0
    for engine in ("fsdp2", "zero3"):
        one, two = (steps[f"recipe_{engine}_accum{k}"]["result"] for k in (1, 2))
        assert (one["engine"], two["engine"]) == (engine, engine)
        assert two["global_batch_rows"] == 2 * one["global_batch_rows"] == 4  # --batch_size 2 at accumulation 2
        for r in (one, two):
            assert r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0
            # MFU is the formula's flops over the environment step's matmul peak; it is not bounded by 1 here:
            # the peak and the run are timed apart, and a CPU shared with another test can run either slower
            assert r["mfu_measured_peak"] == pytest.approx(
                r["flops_per_token"] * r["tokens_per_s"] / env_result["matmul_peak_flops"], rel=1e-6)
            assert r["peak_mem_bytes_estimated"] > 0  # the fit check's, next to the allocated peak on a GPU
            assert r["model_states_over_expected"] == pytest.approx(1, abs=0.02)
            assert r["flops_per_token"] == 6 * (r["num_params"] - 872 * 64) + 12 * 2 * 64 * 64
    offloaded = steps["recipe_fsdp2_accum1_offloaded"]["result"]
    assert offloaded["engine"] == "fsdp2" and offloaded["tokens_per_s"] > 0
    assert offloaded["saved_activation_bytes"] < steps["recipe_fsdp2_accum1"]["result"]["saved_activation_bytes"]
    assert not [p for p in out.rglob("*") if p.name in ("checkpoints", "final")]
    recipe_files = [p for p in out.glob("recipe_*/**/*") if p.is_file()]  # metrics, summary, the harness's probe
    assert recipe_files and max(p.stat().st_size for p in recipe_files) < 2**16  # a checkpoint here: ~3 MB


@pytest.mark.unit
def test_communication_counter_reads_nccl_as_well_as_gloo():
    """The same FSDP2-like step (one all-gather of a 10-element shard, one reduce-scatter of 20 elements, one
    scalar all-reduce at 2 ranks) as each backend's profiler events name it: NCCL's titles come from
    ProcessGroupNCCL.cpp, gloo's reduce-scatter runs as an all-reduce of the whole input."""
    from types import SimpleNamespace as Event

    sys.path.insert(0, str(REPO / "benchmarks"))
    from recipe_probe import count_collectives

    gloo = [Event(name="gloo:all_gather", input_shapes=[[10]], input_dtypes=["BFloat16"]),
            Event(name="c10d::_reduce_scatter_base_", input_shapes=[[10], [20]], input_dtypes=[]),
            Event(name="gloo:all_reduce", input_shapes=[[20]], input_dtypes=["Float"]),
            Event(name="gloo:all_reduce", input_shapes=[[1]], input_dtypes=["Float"])]
    nccl = [Event(name="c10d::_allgather_base_", input_shapes=[[20], [10]], input_dtypes=[]),
            Event(name="nccl:_all_gather_base", input_shapes=[[10]], input_dtypes=["BFloat16"]),
            Event(name="c10d::_reduce_scatter_base_", input_shapes=[[10], [20]], input_dtypes=[]),
            Event(name="nccl:_reduce_scatter_base", input_shapes=[[20]], input_dtypes=["Float"]),
            Event(name="nccl:all_reduce", input_shapes=[[1]], input_dtypes=["Float"])]
    expected = {"all_reduce": 1, "all_gather": 20, "reduce_scatter": 20, "reduce": 0, "broadcast": 0}
    for events, backend in ((gloo, "gloo"), (nccl, "nccl")):
        counted = count_collectives(events, world=2)
        assert counted["backend"] == backend and counted["nelems"] == expected, backend


@pytest.mark.slow
def test_data_prep_benchmark_reports_each_corpus(tmp_path):
    """benchmarks/data_prep.py on two tiny corpora of this checkout (the --before column runs the same code)."""
    proc = subprocess.run([sys.executable, "benchmarks/data_prep.py", "--output_dir", str(tmp_path), "--docs", "20,40"],
                          cwd=REPO, env=isolated_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "data_prep.json").read_text())
    assert [(r["checkout"], r["num_proc"]) for r in rows] == [("this checkout", 1)] * 2 + [("this checkout", 2)] * 2
    assert rows[0]["text_bytes"] < rows[1]["text_bytes"]
    assert all(0 < r["rss_anon_rise_bytes"] < 10**9 and r["seconds"] > 0 and r["text_mb_per_s"] > 0 for r in rows)
    # at --num_proc 1 the tokenizer's calls are timed: the rest, the main process's own pass, is a part of the whole
    assert all(0 < r["seconds_not_tokenizing"] < r["seconds"] for r in rows if r["num_proc"] == 1)
    assert all("seconds_not_tokenizing" not in r for r in rows if r["num_proc"] == 2)
    assert all(r["train_record_batches"] >= 1 and r["open_rss_anon_rise_bytes"] < 10**9 for r in rows)


def _trl_benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_dpo", REPO / "benchmarks/trl_dpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_the_trl_benchmark_table_and_its_pairs_without_trl(tmp_path):
    """benchmarks/trl_dpo.py's parts that need no trl, in a process: its flags; the pairs it gives trl are the
    recipe's global batch of each step in order, as chat messages; the table puts trl's row beside ours with ratios,
    the largest loss difference, and a run that failed or ran another engine as a row that says so."""
    bench = _trl_benchmark()
    args = bench.parser.parse_args(["--output_dir", str(tmp_path), "--skip_trl"])
    assert args.configs == ["fsdp2", "zero3"] and args.skip_trl and args.world_size == 2
    from zero_utils.assets import BUNDLED_PREFERENCES
    from zero_utils.data.training import global_batch_indices

    assert bench.ordered_pairs(tmp_path / "pairs.jsonl", 2, 8, 42) == 2000
    written = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    bundled = [json.loads(line) for line in open(BUNDLED_PREFERENCES)]
    expected = [bundled[i] for step in (1, 2) for i in global_batch_indices(2000, 8, step, 42)]
    assert [w["prompt"][0]["content"] for w in written] == [e["prompt"] for e in expected]
    assert written[0]["chosen"] == [{"role": "assistant", "content": expected[0]["chosen"]}]

    def side(name, losses, peak):
        return {"config": "fsdp2", "side": name, "engine": "fsdp2", "wall_s": 10.0, "step_time_s": 0.1,
                "peak_mem_bytes": peak, "reference_state_bytes": 2e6,
                "steps": [{"step": i + 1, "loss": loss, "margins": 0.5} for i, loss in enumerate(losses)]}

    lines = bench.table([side("ours", [0.693147, 0.6], 500e6), side("trl", [0.693147, 0.6001], 600e6),
                         {"config": "zero3", "side": "trl", "error": "ran single, not zero3"}], "python x")
    assert lines[0].startswith("DPO beside trl (`python x`): CPU")
    assert "| fsdp2 | trl | fsdp2 | 0.693147 | 0.600100 | 1.00e-04 | 0.5000 | 600.0 (1.20x) | 2.000 (1.00x) |" in \
        lines[5]
    assert lines[6] == "| zero3 | trl | failed: ran single, not zero3 | | | | | | | | |"


@pytest.mark.slow
@pytest.mark.distributed
def test_the_trl_benchmark_runs_our_side_without_trl(tmp_path):
    """One launch: our side of the benchmark under FSDP2, 2 steps, as the full run does it (a saved base, the
    pairs in order), and its table; no trl imported."""
    out = tmp_path / "trl"
    proc = subprocess.run([sys.executable, "benchmarks/trl_dpo.py", "--output_dir", str(out), "--skip_trl",
                           "--configs", "fsdp2", "--steps", "2"], cwd=REPO, env=isolated_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert [(r["config"], r["side"], r["engine"]) for r in rows] == [("fsdp2", "ours", "fsdp2")]
    assert rows[0]["steps"][0]["loss"] == pytest.approx(0.6931472, abs=1e-6) and len(rows[0]["steps"]) == 2
    assert rows[0]["reference_state_bytes"] > 0 and "| fsdp2 | ours | fsdp2 |" in (out / "results.md").read_text()
