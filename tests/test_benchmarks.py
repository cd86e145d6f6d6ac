"""The benchmarks run and every row they report is sane (never timed: performance claims live in docs/BENCHMARKS.md).

`benchmarks/run.py --smoke` launches every engine once at 2 processes (12 launches, about 3 minutes here);
`benchmarks/gpu.py --smoke` checks the GPU script's logic on the CPU with a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, isolated_env

import zero_utils.memory_formulas

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
    # DeepSpeed's buckets are sized with memory_formulas's floor (25 MiB of fp32 elements), which holds all of
    # this model's gradients (3.3M elements): one gradient collective per step, as DDP's one 25 MiB bucket. With
    # accelerate's "auto" (h^2 = 65,536 elements) it was one per weight matrix (35 reduce-scatters, 33-41
    # all-reduces), 0.76x the Trainer's tokens/s.
    assert results["num_params"] < zero_utils.memory_formulas.MIN_BUCKET_ELEMENTS
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


@pytest.mark.distributed
def test_gpu_script_logic_on_cpu(tmp_path):
    """The GPU check's logic on a CPU: the recipe launched per variant at 1 process (FSDP2 and ZeRO-3), its
    summary read back, MFU from the PaLM formula (2 launches; compiled variants are GPU-only)."""
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--smoke", "--output_dir", str(tmp_path),
                           "--variants", "fsdp2", "zero3"], cwd=REPO, env=isolated_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert [(v["variant"], v["engine"]) for v in report["variants"]] == [("fsdp2", "fsdp2"), ("zero3", "zero3")]
    for v in report["variants"]:
        assert v["tokens_per_s"] > 0 and 0 < v["mfu_measured_peak"] < 1 and v["peak_mem_bytes"] > 0
        assert v["peak_mem_bytes_estimated"] > 0  # the fit check's, printed next to the allocated peak on a GPU
        assert v["peak_mem_measured"].startswith("process RSS") and v["peak_reserved_bytes"] is None  # CPU
        assert v["model_state_bytes"] == pytest.approx(v["model_state_bytes_expected"], rel=0.02)
        assert v["flops_per_token"] == 6 * (v["num_params"] - 872 * 64) + 12 * 2 * 64 * 64


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
