"""The memory estimator (`python -m zero_utils.memory`): ZeRO formulas, LoRA, offload, HSDP, config-based
parameter counts, activations, the cheapest engine that fits, and the CLI's output and errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import REPO

from zero_utils.formulas import model_states as formulas
from zero_utils.memory import command as memory
from zero_utils.memory import estimate as estimator
from zero_utils.run.engine import Engine
from zero_utils.run.errors import UserError
from zero_utils.train import measurement

pytestmark = pytest.mark.unit

PAPER_ENGINES = ("ddp", "zero1", "zero2", "zero3")
LLAMA_7B = {"hidden_size": 4096, "num_layers": 32, "vocab_size": 32000, "intermediate_size": 11008, "num_heads": 32}
LLAMA_70B = {"hidden_size": 8192, "num_layers": 80, "vocab_size": 32000, "intermediate_size": 28672, "num_heads": 64}


def gpu_state_bytes(engine, num_params, world_size, mixed_precision="bf16", formula="paper", **kwargs) -> int:
    """The textbook ZeRO formula (the paper's 2 + 2 + 12 bytes) unless `formula="engine"`."""
    return formulas.model_state_bytes(Engine.parse(engine), num_params, world_size, mixed_precision, formula=formula,
                                    **kwargs).gpu_bytes


def test_7b_on_8_gpus_matches_the_zero_formulas():
    got = {engine: gpu_state_bytes(engine, 7 * 10**9, 8) for engine in (*PAPER_ENGINES, "fsdp2", "fsdp2_zero2")}
    assert got == {"ddp": 112e9, "zero1": 38.5e9, "zero2": 26.25e9, "zero3": 14e9, "fsdp2": 14e9, "fsdp2_zero2": 14e9}


def test_zero_paper_table_7_5b_on_64_gpus():
    got = [round(gpu_state_bytes(engine, 7_500_000_000, 64) / 1e9, 1) for engine in PAPER_ENGINES]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_engine_rows_are_the_measured_bytes_per_param():
    """Measured from live tensors at 4 ranks (docs/MEMORY.md), for an even split. Right after the step (what a run
    at accumulation 1 sees): fp32 DDP 16, ZeRO-1/2 4 + 20/N, ZeRO-3 24/N, FSDP2 16/N; bf16 ZeRO-1/2 2 + 18/N,
    ZeRO-3 22/N (its reduced gradient partition in fp32, as the recipe configures it). Between micro-batches
    (accumulation 2) ZeRO-1 holds whole gradients, before its reduction: fp32 4 + 4 + 12/N = 11, bf16
    2 + 2 + 12/N = 7 (the paper's ZeRO-1); the other engines hold no more than after the step. The estimate (no
    accumulation given) counts each engine's peak: ZeRO-1's whole gradients exist at accumulation 1 too, inside
    DeepSpeed's step."""
    psi = 1_000_000
    engines = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
    after_step = {"no": {"ddp": 16, "zero1": 9, "zero2": 9, "zero3": 6, "fsdp2": 4},
                  "bf16": {"ddp": 16, "zero1": 6.5, "zero2": 6.5, "zero3": 5.5, "fsdp2": 4}}
    between_micro_batches = {"no": {**after_step["no"], "zero1": 11}, "bf16": {**after_step["bf16"], "zero1": 7}}
    def per_param(precision, **kwargs):
        return {engine: formulas.expected_model_state_bytes(Engine.parse(engine), psi, 4, precision, **kwargs) / psi
                for engine in engines}

    for precision in ("no", "bf16"):
        assert per_param(precision, gradient_accumulation_steps=1) == after_step[precision]
        assert per_param(precision, gradient_accumulation_steps=2) == between_micro_batches[precision]
        assert per_param(precision) == between_micro_batches[precision]
    # at 2 ranks ZeRO-1's step holds as much or more (fp32 4 + 20/2 = 14 = 4 + 4 + 12/2; bf16 2 + 18/2 = 11 > 10)
    assert formulas.expected_model_state_bytes(Engine.parse("zero1"), psi, 2, "no") == 14 * psi
    assert formulas.expected_model_state_bytes(Engine.parse("zero1"), psi, 2, "bf16") == 11 * psi


def test_uneven_sharding_is_added_exactly_from_the_layout():
    """ZeRO-1/2 keep the gradients of whole parameters cut by a partition border; FSDP2 pads dim 0; ZeRO-3 pads
    each parameter: the remainder is computed from the shapes, not hidden in a tolerance."""
    groups = [[(10, 4), (7, 3)], [(5,)]]  # 40 + 21 + 5 = 66 parameters in two optimizer groups
    # FSDP2 at 4 ranks: rank 0 holds ceil(10/4)*4 + ceil(7/4)*3 + ceil(5/4) = 12 + 6 + 2 = 20 of an even 16.5
    assert formulas.sharding_remainder_bytes(Engine.parse("fsdp2"), groups, 4, "no") == round(3.5 * 16)
    # ZeRO-3 at 4 ranks: ceil(40/4) + ceil(21/4) + ceil(5/4) = 10 + 6 + 2 = 18 elements of 16.5, at 24 B each
    assert formulas.sharding_remainder_bytes(Engine.parse("zero3"), groups, 4, "no") == round(1.5 * 24)
    # ZeRO-2 at 2 ranks: group 0 (61 elements, padded to 64) splits at 32: rank 0 keeps the (10, 4) param whole
    # (40) and rank 1 both params it touches (40 + 21 = 61); group 1 (5, padded to 8) is on both: max 61 + 5 = 66
    assert formulas.sharding_remainder_bytes(Engine.parse("zero2"), groups, 2, "no") == round((66 - 33) * 4)
    assert formulas.sharding_remainder_bytes(Engine.parse("ddp"), groups, 2, "no") == 0


def test_recipe_call_counts_gpu_and_cpu_and_accepts_every_engine_name():
    psi = 2_000_000
    assert formulas.expected_model_state_bytes(Engine.parse("zero3_offload"), psi, 2, "bf16") == 22 * psi // 2
    assert formulas.expected_model_state_bytes(Engine.parse("fsdp2_zero2_offload"), psi, 2, "bf16") == 16 * psi // 2
    assert formulas.expected_model_state_bytes(Engine.parse("single"), psi, 1) == 16 * psi
    with pytest.raises(UserError, match="zero4"):
        estimator.engine_named("zero4")


@pytest.mark.parametrize("engine", ["ddp", "zero1", "zero2", "zero3", "fsdp2", "fsdp2_zero2"])
def test_lora_trains_a_fraction_and_stores_frozen_weights_as_the_engine_stores_params(engine):
    psi, world, fraction = 8_000_000, 4, 0.25
    full = formulas.model_state_bytes(Engine.parse(engine), psi, world, "bf16")
    lora = formulas.model_state_bytes(Engine.parse(engine), int(psi * fraction), world, "bf16",
                                      frozen_params=int(psi * (1 - fraction)))
    assert lora.gpu["grads"] == pytest.approx(full.gpu["grads"] * fraction, abs=2)
    assert lora.gpu["optimizer"] == pytest.approx(full.gpu["optimizer"] * fraction, abs=2)
    # frozen weights cost what a parameter costs under the engine: all parameters together cost the full model's
    assert lora.gpu["params"] == pytest.approx(full.gpu["params"], abs=2)


def test_lora_fraction_in_the_estimate_matches_the_formula():
    setup = estimator.Setup(num_params=8_000_000, num_gpus=4, lora_fraction=0.5, formula="paper")
    [zero3] = estimator.estimate(setup, (Engine.parse("zero3"),))
    assert zero3.model_states.gpu == {"params": 2 * 8_000_000 // 4, "grads": 2 * 4_000_000 // 4,
                                      "optimizer": 12 * 4_000_000 // 4}


def test_offload_moves_bytes_from_gpu_to_cpu():
    psi, world = 8_000_000, 8
    kept = formulas.model_state_bytes(Engine.parse("zero3"), psi, world, "bf16")
    optimizer_off = formulas.model_state_bytes(Engine.parse("zero3"), psi, world, "bf16", offload_optimizer=True)
    assert optimizer_off.gpu == {"params": kept.gpu["params"], "grads": 0, "optimizer": 0}
    assert optimizer_off.cpu == {"params": 0, "grads": kept.gpu["grads"], "optimizer": kept.gpu["optimizer"]}
    both_off = formulas.model_state_bytes(Engine.parse("zero3_offload"), psi, world, "bf16")
    assert both_off.gpu_bytes == 0 and both_off.cpu_bytes == kept.total_bytes
    fsdp_off = formulas.model_state_bytes(Engine.parse("fsdp2_offload"), psi, world, "bf16")
    fsdp_kept = formulas.model_state_bytes(Engine.parse("fsdp2"), psi, world, "bf16")
    assert fsdp_off.gpu_bytes == 0 and fsdp_off.cpu_bytes == fsdp_kept.total_bytes
    zero2_off = formulas.model_state_bytes(Engine.parse("zero2"), psi, world, "bf16", offload_optimizer=True)
    assert zero2_off.gpu == {"params": 2 * psi, "grads": 0, "optimizer": 0}  # whole bf16 params stay on every GPU


def test_offload_flags_apply_where_each_engine_can_offload():
    setup = estimator.Setup(num_params=8_000_000, num_gpus=8, offload_optimizer=True, formula="paper")
    cpu = {r.engine.name: r.model_states.cpu_bytes for r in estimator.estimate(setup)}
    assert cpu["ddp"] == 0 and cpu["fsdp2"] == 0  # DDP cannot offload; FSDP2 offloads only with its params
    assert cpu["zero1"] == 12 * 8_000_000 // 8 and cpu["zero3"] == 14 * 8_000_000 // 8


@pytest.mark.parametrize("engine, kwargs", [
    ("ddp", {"offload_optimizer": True}),
    ("zero2", {"offload_params": True}),
    ("fsdp2", {"offload_optimizer": True, "offload_params": False}),
])
def test_offload_an_engine_cannot_do_is_a_user_error(engine, kwargs):
    with pytest.raises(UserError, match="offload"):
        formulas.model_state_bytes(Engine.parse(engine), 1000, 2, "bf16", **kwargs)


def test_sgd_keeps_only_a_master_copy_where_the_engine_has_one():
    psi, world = 8_000_000, 8
    sgd = formulas.model_state_bytes(Engine.parse("zero3"), psi, world, "bf16", optimizer="sgd")
    assert sgd.gpu["optimizer"] == 4 * psi // world
    assert formulas.model_state_bytes(Engine.parse("fsdp2"), psi, world, "bf16", optimizer="sgd").gpu["optimizer"] == 0
    assert formulas.model_state_bytes(Engine.parse("ddp"), psi, world, "no", optimizer="sgd").gpu_bytes == 8 * psi


def test_hsdp_divides_fsdp2_by_the_shard_group_not_the_world():
    setup = estimator.Setup(num_params=7 * 10**9, num_gpus=8, num_nodes=4, formula="paper")
    flat = {r.engine.name: r.model_states.gpu_bytes for r in estimator.estimate(setup)}
    hsdp = {r.engine.name: r.model_states.gpu_bytes for r in estimator.estimate(estimator.Setup(**{**setup.__dict__,
                                                                                         "hsdp": True}))}
    assert flat["fsdp2"] == 16 * 7 * 10**9 // 32
    assert hsdp["fsdp2"] == hsdp["fsdp2_zero2"] == 16 * 7 * 10**9 // 8
    assert hsdp["zero3"] == flat["zero3"] == 16 * 7 * 10**9 // 32


@pytest.mark.parametrize("tied", [False, True])
def test_model_config_counts_exactly_the_parameters_of_the_model(tmp_path, tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=500, tie_word_embeddings=tied)
    config.save_pretrained(tmp_path)
    model = LlamaForCausalLM(config)
    expected = sum(p.numel() for p in model.parameters())
    for source in (tmp_path, tmp_path / "config.json"):
        arch = estimator.architecture_from_model(str(source))
        assert arch.num_params == expected
    assert arch.block_params == sum(p.numel() for p in model.model.layers[0].parameters())
    assert arch.embed_params == (0 if tied else 500 * 64)
    assert arch.num_layers * arch.block_params + arch.embed_params + arch.head_params == expected
    assert (arch.hidden_size, arch.intermediate_size, arch.num_heads, arch.gated_mlp) == (64, 176, 4, True)


def test_a_missing_model_path_is_a_user_error(tmp_path):
    for missing in (tmp_path / "nope", tmp_path / "nope" / "config.json"):
        with pytest.raises(UserError, match="does not exist"):
            estimator.architecture_from_model(str(missing))


def test_activations_follow_korthikanti_et_al():
    s, b, h, a, layers, vocab = 1024, 2, 512, 8, 4, 1000
    arch = formulas.architecture_from_sizes(10**8, h, layers, vocab, num_heads=a)  # GPT MLP (4h, not gated)
    logits = s * b * vocab * (2 + 4)
    kwargs = {"seq_len": s, "micro_batch_size": b, "activation_checkpointing": False}
    eager = formulas.activation_bytes(arch, attention="eager", **kwargs)
    assert eager == layers * s * b * h * (34 + 5 * a * s // h) + logits
    assert formulas.activation_bytes(arch, attention="sdpa", **kwargs) == layers * s * b * h * 34 + logits
    checkpointed = formulas.activation_bytes(arch, **{**kwargs, "activation_checkpointing": True})
    assert checkpointed == layers * 2 * s * b * h + s * b * h * 34 + logits
    assert formulas.activation_bytes(arch, dtype="fp32", **kwargs) == 2 * layers * s * b * h * 34 + s * b * vocab * 8


def test_activation_offloading_moves_the_checkpointed_inputs_to_host_memory(capsys):
    """8B (h 4096, 32 layers), 131,072 tokens per rank, bf16, checkpointed: each block's input is 131072 x 4096 x 2
    bytes = 1.07 GB, 34.4 GB for the 32 of them. Offloaded, the GPU keeps 2 in flight: its activation term drops by
    30 inputs (32.2 GB) and each rank's host memory holds all 32; without checkpointing there is nothing to offload."""
    s, h, layers = 131_072, 4096, 32
    arch = formulas.architecture_from_sizes(8 * 10**9, h, layers, 128_256, intermediate_size=14_336)
    one_input = s * h * 2
    setup = estimator.Setup(num_params=8 * 10**9, arch=arch, seq_len=s, activation_checkpointing=True)
    kept, offloaded = (estimator.estimate(replace(setup, activation_offloading=flag),
                                          (Engine.parse("fsdp2"),))[0] for flag in (False, True))
    assert kept.activation_bytes - offloaded.activation_bytes == (layers - 2) * one_input == 32_212_254_720
    assert offloaded.cpu_bytes - kept.cpu_bytes == layers * one_input == 34_359_738_368
    assert offloaded.total_bytes == kept.total_bytes - (layers - 2) * one_input
    with pytest.raises(UserError, match="--activation_offloading moves the checkpointed blocks' inputs to host "
                                        "memory: add --activation_checkpointing"):
        estimator.estimate(replace(setup, activation_checkpointing=False, activation_offloading=True))
    assert memory.main(["--params", "8B", "--hidden_size", str(h), "--num_layers", str(layers), "--vocab_size",
                        "128256", "--seq_len", str(s), "--activation_checkpointing", "--activation_offloading"]) == 0
    out = capsys.readouterr().out
    assert "(inputs offloaded to host memory)" in out and "activation offloading (the recipes'" in out


def test_fsdp2_without_reshard_keeps_the_whole_model_gathered():
    arch = formulas.architecture_from_sizes(7 * 10**9, **LLAMA_7B)
    zero2_like = formulas.transient_bytes(Engine.parse("fsdp2_zero2"), arch)
    zero3_like = formulas.transient_bytes(Engine.parse("fsdp2"), arch)
    assert zero2_like >= 2 * 7 * 10**9 > 5 * zero3_like


def test_params_alone_give_no_activations_and_say_why(capsys):
    [result] = estimator.estimate(estimator.Setup(num_params=7 * 10**9), (Engine.parse("zero3"),))
    assert result.activation_bytes is None and result.total_bytes is None
    assert memory.main(["--params", "7B"]) == 0
    assert "activations and transients need the architecture: pass --model" in capsys.readouterr().out
    assert memory.main(["--params", "7B", "--gpu_memory", "80GB"]) == 2
    assert "--device_memory needs activation estimates" in capsys.readouterr().err


def _pick(params, num_gpus, gpu_memory, **setup):
    arch = formulas.architecture_from_sizes(params, **LLAMA_7B)
    results = estimator.estimate(estimator.Setup(num_params=params, num_gpus=num_gpus, arch=arch, **setup))
    return estimator.cheapest_fit(results, memory.parse_bytes(gpu_memory)), {r.engine.name: r for r in results}


def test_gpu_memory_picks_the_cheapest_engine_that_fits():
    chosen, results = _pick(7 * 10**9, 8, "80GB", seq_len=2048, micro_batch_size=1, activation_checkpointing=True)
    assert chosen.engine.name == "zero1"
    assert not estimator.fits(results["ddp"], 80 * 10**9) and estimator.fits(results["zero1"], 80 * 10**9)
    # 13B on 8 x 40 GB: ZeRO-1/2 keep whole 16-bit params, fsdp2_zero2 gathers the whole model, DeepSpeed ZeRO-3
    # keeps 22 bytes/param/N (fp32 gradient partitions, 35.75 GB): FSDP2's 16/N is the first that fits.
    chosen, results = _pick(13 * 10**9, 8, "40GB", activation_checkpointing=True)
    assert chosen.engine.name == "fsdp2" and not estimator.fits(results["fsdp2_zero2"], 40 * 10**9)
    assert not estimator.fits(results["zero3"], 40 * 10**9)
    chosen, _ = _pick(70 * 10**9, 8, "80GB", activation_checkpointing=True)
    assert chosen.engine.name == "zero3_offload"


def test_nothing_fits_says_what_would(capsys):
    # 70B on 8 x 24 GB (21.6 GB usable): FSDP2 states of 1120 GB / N; at 128 GPUs 8.75 GB of states + 3.65 GB of
    # activations + 5.73 GB of gathered units + 3.47 GB fp32 reduce-scatter input of a 868M-parameter block + the
    # rest of the shape terms = 21.8 GB: 256 GPUs. Offloaded, GPUs hold activations and buffers.
    argv = ["--params", "70B", "--num_gpus", "8", "--gpu_memory", "24GB", "--activation_checkpointing",
            "--engines", "ddp,zero3,fsdp2", *[f"--{k}={v}" for k, v in LLAMA_70B.items()]]
    assert memory.main(argv) == 0
    out = capsys.readouterr().out
    assert "nothing fits" in out and "cheapest that fits" not in out
    assert "zero3_offload (CPU offload) fits on these GPUs" in out and "fsdp2 fits on 32 nodes of 8 GPUs" in out


def test_launch_command_for_one_and_several_nodes():
    assert estimator.launch_command(Engine.parse("zero1"), 8) == (
        "accelerate launch --config_file accelerate_configs/zero1.yaml "
                                                 "--num_processes 8 recipes/llama_zero3.py")
    multi = estimator.launch_command(Engine.parse("fsdp2"), 8, num_nodes=4, hsdp=True)
    assert "--num_processes 32 --num_machines 4 --machine_rank <0..3>" in multi
    assert "--parallelism_config_dp_replicate_size 4 --parallelism_config_dp_shard_size 8" in multi
    for engine in estimator.ENGINES:
        assert (REPO / "accelerate_configs" / f"{engine}.yaml").is_file()


@pytest.mark.parametrize("text, count", [("7e9", 7 * 10**9), ("7B", 7 * 10**9), ("7000000000", 7 * 10**9),
                                         ("1.5M", 1_500_000), ("125m", 125_000_000)])
def test_parse_count(text, count):
    assert memory.parse_count(text) == count


@pytest.mark.parametrize("text, nbytes", [("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("80e9", 80 * 10**9),
                                          ("40 GB", 40 * 10**9)])
def test_parse_bytes(text, nbytes):
    assert memory.parse_bytes(text) == nbytes


@pytest.mark.parametrize("argv, named", [
    (["--params", "7X"], "'7X'"),
    (["--params", "7B", "--num_gpus", "0"], "--num_gpus 0"),
    (["--params", "7B", "--num_gpus", "eight"], "'eight'"),
    (["--params", "7B", "--engines", "zero4"], "'zero4'"),
    (["--params", "7B", "--gpu_memory", "80"], "'80'"),
    (["--params", "7B", "--lora_fraction", "2"], "--lora_fraction 2"),
    (["--model", "./no/such/model"], "./no/such/model"),
    (["--num_gpus", "8"], "--params"),
])
def test_user_errors_exit_2_with_one_line(capsys, argv, named):
    assert memory.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith("error: ") and named in line


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "zero_utils.memory", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_cli_prints_the_zero_table():
    proc = _cli("--params", "7B", "--num_gpus", "8", "--formula", "paper")
    assert proc.returncode == 0, proc.stderr
    assert "Per-GPU memory in GB (1 GB = 1e9 bytes)" in proc.stdout
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.split()[:1] and
            line.split()[0] in [e.name for e in estimator.ENGINES]}
    assert [rows[e][4] for e in PAPER_ENGINES] == ["112.00", "38.50", "26.25", "14.00"]


def test_cli_json_matches_the_functions():
    proc = _cli("--params", "7B", "--num_gpus", "8", "--offload_optimizer", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [row["engine"] for row in data["engines"]] == [e.name for e in estimator.ENGINES]
    setup = estimator.Setup(num_params=7 * 10**9, num_gpus=8, offload_optimizer=True)
    for row, result in zip(data["engines"], estimator.estimate(setup), strict=True):
        assert row["model_state_bytes"] == result.model_states.gpu_bytes
        assert row["cpu_bytes"] == result.model_states.cpu_bytes
        assert row["model_state_bytes"] + row["cpu_bytes"] == formulas.expected_model_state_bytes(
            Engine.parse(row["engine"]), 7 * 10**9, 8, "bf16")


def test_cli_error_exits_2():
    proc = _cli("--params", "7B", "--engines", "zero4")
    assert proc.returncode == 2 and proc.stdout == ""
    expected = f"error: unknown engine 'zero4'; use one of: {', '.join(e.name for e in estimator.ENGINES)}."
    assert proc.stderr.strip().splitlines() == [expected]


def test_deepspeed_buckets_follow_the_hidden_size_with_a_floor_and_keep_a_users_setting():
    """What zero_utils.model.deepspeed_setup writes into DeepSpeed's config before `prepare` (the estimator uses the
    same sizes):
    accelerate's "auto" sizes from hidden 2560 up, the 25 MiB floor below, and a size the user's own DeepSpeed
    config file sets is left alone."""
    from types import SimpleNamespace

    from zero_utils.model import deepspeed_setup

    floor = 25 * 2**20 // 4
    assert formulas.deepspeed_bucket_elements(4096) == {
        "reduce_bucket_size": 4096**2, "stage3_prefetch_bucket_size": int(0.9 * 4096**2),
        "stage3_param_persistence_threshold": 40960}
    assert formulas.deepspeed_bucket_elements(256) == {
        "reduce_bucket_size": floor, "stage3_prefetch_bucket_size": floor, "stage3_param_persistence_threshold": 2560}

    zero_config = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 1234,
                   "stage3_param_persistence_threshold": "auto"}
    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": zero_config})
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=256))
    written = deepspeed_setup.size_deepspeed_buckets(accelerator, model)
    assert written == {"reduce_bucket_size": floor, "stage3_param_persistence_threshold": 2560}
    assert zero_config["stage3_prefetch_bucket_size"] == 1234
    no_deepspeed = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None))
    assert deepspeed_setup.size_deepspeed_buckets(no_deepspeed, model) == {}

    # the estimate's ZeRO-3 transients: live-parameter bound (here the model) + the two floored buckets (bounded by
    # the model) + persistent params
    arch = formulas.architecture_from_sizes(3_348_736, hidden_size=256, num_layers=4, vocab_size=2000)
    psi = arch.num_params
    assert formulas.transient_bytes(Engine.parse("zero3"), arch, dtype="fp32") == 4 * (psi + min(floor, psi)
                                                                          + min(floor, psi)
                                                                       + arch.persistent_params)


def test_gpu_peaks_are_allocated_and_reserved_since_the_reset(monkeypatch):
    """On a GPU the recipe reads both caching-allocator peaks (reserved is what nvidia-smi shows, less the CUDA
    context) after resetting them once set-up is done: checked here on what torch.cuda receives (no GPU in CI)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device=None: calls.append(("allocated", device)) or 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved",
                        lambda device=None: calls.append(("reserved", device)) or 4 * 2**30)
    cuda = torch.device("cuda", 1)
    measurement.reset_peak_memory(cuda)
    assert measurement.peak_memory(cuda) == {"peak_mem_bytes": 3 * 2**30, "peak_reserved_bytes": 4 * 2**30}
    assert calls == [("reset", cuda), ("allocated", cuda), ("reserved", cuda)]
    assert "max_memory_reserved" in measurement.peak_memory_measured(cuda)
    cpu = torch.device("cpu")
    measurement.reset_peak_memory(cpu)  # nothing to reset: the RSS high-water mark of the process
    assert list(measurement.peak_memory(cpu)) == ["peak_mem_bytes"] and "RSS" in measurement.peak_memory_measured(cpu)


def test_summary_table_shows_the_ranks_when_they_differ_by_more_than_5_percent():
    """summary.json keeps each rank's figures; the table a person reads names the smallest and largest rank only
    when they differ by more than 5% (here 10%: 100 vs 110 MB), and stays one number when they do not (3%)."""
    from zero_utils.train import tracking

    base = {"engine": "fsdp2", "world_size": 2, "steps": 4, "final_loss": 1.0, "eval_loss": None,
            "tokens_per_s": 1000.0, "peak_reserved_bytes": None, "model_state_bytes_expected": 7_690_000}
    uneven = {**base, "peak_mem_bytes": 110_000_000, "peak_mem_bytes_per_rank": [110_000_000, 100_000_000],
              "model_state_bytes": 7_690_000, "model_state_bytes_per_rank": [7_690_000, 7_460_000]}
    table = tracking.summary_table(uneven)
    assert "110.0 MB (ranks differ by 9%: rank 1 100.0 MB, rank 0 110.0 MB)" in table
    assert "7.69 / 7.69 MB\n" in table + "\n"  # 3% apart: one number
    even = {**uneven, "peak_mem_bytes_per_rank": [110_000_000, 107_000_000]}
    assert "ranks differ" not in tracking.summary_table(even)
    gpu = {**even, "peak_reserved_bytes": 130_000_000, "peak_reserved_bytes_per_rank": [100_000_000, 130_000_000]}
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in tracking.summary_table(gpu).splitlines())
    assert rows["peak reserved per rank (max)"] == "130.0 MB (ranks differ by 23%: rank 0 100.0 MB, rank 1 130.0 MB)"
    assert measurement.rank_spread([100, 110]) == pytest.approx(10 / 110) and measurement.rank_spread(None) is None


def test_chunked_loss_holds_one_chunk_of_logits(capsys):
    """Llama-3 8B's vocabulary at 4,096 tokens: the whole bf16 logits and their fp32 copy are 4096 x 128256 x 6 B =
    3.15 GB; the recipes' default --loss_chunk_tokens 1024 keeps a quarter of that; the CLI says which it assumed."""
    arch = formulas.architecture_from_sizes(8 * 10**9, hidden_size=4096, num_layers=32, vocab_size=128_256,
                                            intermediate_size=14_336, num_heads=32)
    whole, chunked = (formulas.activation_bytes(arch, seq_len=4096, micro_batch_size=1, activation_checkpointing=True,
                                                loss_chunk_tokens=chunk) for chunk in (0, 1024))
    assert whole - chunked == (4096 - 1024) * 128_256 * 6
    small = formulas.activation_bytes(arch, seq_len=512, micro_batch_size=1, activation_checkpointing=True,
                                      loss_chunk_tokens=1024)  # a micro-batch smaller than a chunk: all of it
    assert small == formulas.activation_bytes(arch, seq_len=512, micro_batch_size=1, activation_checkpointing=True)
    argv = ["--params", "8B", "--hidden_size", "4096", "--num_layers", "32", "--vocab_size", "128256"]
    assert memory.main(argv) == 0 and "loss over 1024-token chunks" in capsys.readouterr().out
    assert memory.main([*argv, "--loss_chunk_tokens", "0"]) == 0
    assert "loss over the whole logits" in capsys.readouterr().out
