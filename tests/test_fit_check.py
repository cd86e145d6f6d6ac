"""The fit check (zero_utils.memory.fit_check, its verdict in zero_utils.memory.estimate.fit_verdict): in process, the
verdict and its advice on an 8B Llama-shaped model, every expected byte computed here by hand from the formulas
the docs state (the ZeRO paper's 16 bytes/param, docs/MEMORY.md's per-engine table, Korthikanti et al.'s
activations); launched, a run that does not fit stops on every rank before the model is built."""

from __future__ import annotations

import json
import re

import pytest
from conftest import LOSS_CHUNK

from zero_utils.formulas.model_states import architecture_from_sizes, model_state_bytes
from zero_utils.memory import command as memory
from zero_utils.memory.estimate import Setup, fit_verdict
from zero_utils.run.engine import Engine

# An 8B Llama-3-shaped model: h 4096, 32 layers, vocab 128256, gated MLP of 14336, untied embeddings.
PSI, H, L, V, FFN = 8_000_000_000, 4096, 32, 128_256, 14_336
ARCH = architecture_from_sizes(PSI, hidden_size=H, num_layers=L, vocab_size=V, intermediate_size=FFN, num_heads=32)
S = 2048  # seq_len, micro-batch 1, bf16, loss in 1024-token chunks (the recipes' default)
RUN = Setup(num_params=PSI, num_gpus=8, arch=ARCH, seq_len=S, micro_batch_size=1, dtype="bf16")

# By hand, bytes per GPU. Activations (16-bit, sdpa): per layer s*b*(15h + 3h + 8I) (attention 11 sbh, norms
# 4 sbh, gated MLP 3h + 8I), plus 1024 tokens of logits in 16 bits and their fp32 upcast.
ACTIVATIONS = L * S * (18 * H + 8 * FFN) + 1024 * V * (2 + 4)
BUCKET = H * H  # DeepSpeed's reduce bucket at this hidden size (accelerate's "auto": h^2 elements > 25 MiB floor)
ZERO1_TRANSIENT = 2 * (BUCKET + 500_000_000)  # reduce + allgather bucket, bf16
ZERO3_TRANSIENT = 2 * (1_000_000_000 + int(0.9 * H * H) + (2 * L + 1) * H) + 4 * BUCKET  # live params, prefetch,
# persistent norms (bf16) and the fp32 reduce bucket
UNIT = V * H  # FSDP2's largest unit: the input embedding (a block is (PSI - 2 V h) / L = 217M)
FSDP2_TRANSIENT = 2 * ((V * H + H) + 2 * UNIT) + 2 * UNIT  # head group gathered + 2 units + one unit's gradient
# What real shapes add (zero_utils.formulas.peak_terms; ARCH has no GQA, so no K/V is repeated): packed rows under sdpa,
# the bool (1, 1, s, s) block mask and its bf16 copy in each of the L layers; the loss backward's 12 bytes per token and
# vocabulary entry less the 2 + 4 the activations count, for one 1024-token chunk. FSDP2 adds the fp32
# reduce-scatter input of its largest unit.
SHAPES = S * S * (1 + 2 * L) + (12 - (2 + 4)) * 1024 * V
FSDP2_SHAPES = SHAPES + 4 * UNIT
# With activation checkpointing: each layer's input (2 sbh), one layer recomputed, the logits of one chunk; of the
# block mask, one layer's copy.
CHECKPOINTED = L * 2 * S * H + S * (18 * H + 8 * FFN) + 1024 * V * 6
CHECKPOINTED_SHAPES = S * S * (1 + 2) + (12 - 6) * 1024 * V


def test_the_papers_16_bytes_per_parameter_and_the_engines_own_table():
    """8B, bf16, ZeRO-3 on 8 GPUs: the paper's 2 + 2 + 12 bytes/param over 8 = 16 GB each; what DeepSpeed holds
    here is 22 bytes/param over 8 (fp32 gradient partition, docs/PRECISION.md); DDP holds 16 bytes/param whole."""
    zero3 = Engine.parse("zero3")
    assert model_state_bytes(zero3, PSI, 8, "bf16", formula="paper").gpu_bytes == 16 * 10**9
    assert model_state_bytes(zero3, PSI, 8, "bf16").gpu_bytes == 22 * 10**9
    assert model_state_bytes(Engine.parse("ddp"), PSI, 8, "bf16").gpu_bytes == 128 * 10**9


def test_ddp_on_80gb_gpus_is_refused_naming_zero1():
    """DDP needs 128 GB of model states alone > 72 GB usable (90% of 80); ZeRO-1 (at its peak, before its gradient
    reduction: whole bf16 gradients, 2 + 2 + (4 + 8) / 8 bytes/param, measured between micro-batches,
    docs/MEMORY.md = 44 GB, + activations + its buckets + the block mask and loss backward = 59.23 GB) is the first
    that fits."""
    verdict = fit_verdict(RUN, Engine.parse("ddp"), 80 * 10**9)
    assert verdict.status == "too_big" and verdict.total_bytes > 128 * 10**9
    zero1 = 44 * 10**9 + ACTIVATIONS + ZERO1_TRANSIENT + SHAPES
    assert zero1 <= 72 * 10**9
    assert verdict.advice == (f"zero1 fits ({zero1 / 1e9:.2f} GB per GPU): accelerate launch --config_file "
                              "accelerate_configs/zero1.yaml --num_processes 8 recipes/llama_zero3.py")


def test_zero3_on_42gb_gpus_is_refused_naming_fsdp2():
    """ZeRO-3: 22 GB of states + activations + 2 GB live/bucket buffers + 1.06 GB of block mask and loss backward =
    38.3 GB > 37.8 GB usable; DDP, ZeRO-1/2 and fsdp2_zero2 (the whole model gathered) do not fit either; FSDP2 (16 GB
    of states, the head group and two units gathered, the fp32 reduce-scatter input of the embedding) does: 36.5 GB."""
    zero3 = 22 * 10**9 + ACTIVATIONS + ZERO3_TRANSIENT + SHAPES
    fsdp2 = 16 * 10**9 + ACTIVATIONS + FSDP2_TRANSIENT + FSDP2_SHAPES
    assert fsdp2 <= 37.8 * 10**9 < zero3
    verdict = fit_verdict(RUN, Engine.parse("zero3"), 42 * 10**9, recipe="recipes/llama_lora.py")
    assert (verdict.status, verdict.total_bytes) == ("too_big", zero3)
    assert verdict.advice == (f"fsdp2 fits ({fsdp2 / 1e9:.2f} GB per GPU): accelerate launch --config_file "
                              "accelerate_configs/fsdp2.yaml --num_processes 8 recipes/llama_lora.py")


def test_within_15_percent_of_the_usable_memory_is_a_warning():
    fsdp2 = 16 * 10**9 + ACTIVATIONS + FSDP2_TRANSIENT + FSDP2_SHAPES
    engine = Engine.parse("fsdp2")
    assert fit_verdict(RUN, engine, round(fsdp2 / 0.9 / 0.9)).status == "tight"  # 90% of usable
    assert fit_verdict(RUN, engine, round(fsdp2 / 0.8 / 0.9)).status == "fits"  # 80% of usable
    assert fit_verdict(RUN, engine, round(fsdp2 / 0.9) - 10).status == "too_big"  # just above usable


def test_checkpointing_is_the_setting_named_when_no_engine_fits_as_set():
    """28 GB GPUs (25.2 GB usable): as set, the activations alone (13.1 GB) leave no engine room (FSDP2: 36.5 GB);
    with --gradient_checkpointing a layer keeps only its input (2 sbh) while one layer is recomputed (and one layer's
    copy of the block mask exists), and FSDP2 fits: 16 GB + 1.71 GB + 4.2 GB + 2.9 GB of shape terms = 24.84 GB."""
    fsdp2 = 16 * 10**9 + CHECKPOINTED + FSDP2_TRANSIENT + CHECKPOINTED_SHAPES + 4 * UNIT
    assert fsdp2 <= 25.2 * 10**9 < 16 * 10**9 + ACTIVATIONS + FSDP2_TRANSIENT + FSDP2_SHAPES
    verdict = fit_verdict(RUN, Engine.parse("fsdp2"), 28 * 10**9)
    assert verdict.advice == (f"fsdp2 fits ({fsdp2 / 1e9:.2f} GB per GPU): accelerate launch --config_file "
                              "accelerate_configs/fsdp2.yaml --num_processes 8 recipes/llama_zero3.py "
                              "--gradient_checkpointing")


def test_nothing_fits_names_the_offload_config_and_how_many_gpus_would_fit():
    """16 GB GPUs (14.4 GB usable): at 8 GPUs FSDP2's states alone are 16 Psi / 8 = 16 GB, so no engine fits in
    GPU memory with any setting; the advice names the offload config that needs least and the first GPU count at
    which an engine fits, whose states by hand (16 or 22 Psi / N) are below the usable memory."""
    verdict = fit_verdict(RUN, Engine.parse("fsdp2"), 16 * 10**9)
    assert verdict.status == "too_big"
    assert verdict.advice.startswith("nothing fits on 8 GPUs of 16.00 GB without CPU offload; of the CPU-offload "
                                     "configs ")
    assert re.search(r"configs (zero3|fsdp2)_offload needs least: ", verdict.advice)
    found = re.search(r"; on (\d+) GPUs \((\d+) nodes of 8\) (\w+) fits \(([\d.]+) GB per GPU\): accelerate launch "
                      r"--config_file accelerate_configs/\3.yaml --num_processes \1 --num_machines \2 ",
                      verdict.advice)
    gpus, engine = int(found.group(1)), found.group(3)
    assert gpus == 32 and {"fsdp2": 16, "zero3": 22}[engine] * PSI / gpus <= 14.4e9, verdict.advice
    # at 16 GPUs, checkpointed: ZeRO-3 15.6 GB, FSDP2 16.8 GB, both above 14.4 GB
    assert 22 * PSI / 16 + CHECKPOINTED + ZERO3_TRANSIENT + CHECKPOINTED_SHAPES > 14.4e9
    assert 16 * PSI / 16 + CHECKPOINTED + FSDP2_TRANSIENT + CHECKPOINTED_SHAPES + 4 * UNIT > 14.4e9
    # 128k-token rows: even checkpointed, one micro-batch's layer inputs are L * 2 s h = 34.4 GB on any GPU count
    verdict = fit_verdict(Setup(num_params=PSI, num_gpus=8, arch=ARCH, seq_len=131_072, dtype="bf16"),
                          Engine.parse("fsdp2"), 24 * 10**9)
    assert "no number of GPUs up to 8192 fits" in verdict.advice and "shorten --seq_len" in verdict.advice
    assert L * 2 * 131_072 * H > 21.6e9


def test_on_a_cpu_host_the_offloaded_bytes_count_and_offload_is_not_offered():
    engine = Engine.parse("zero3_offload")
    small = Setup(num_params=PSI, num_gpus=2, arch=ARCH, seq_len=S, micro_batch_size=1, dtype="bf16")
    on_gpu = fit_verdict(small, engine, 10**12)
    on_host = fit_verdict(small, engine, 10**12, device_is_host=True)
    assert on_host.total_bytes == on_gpu.total_bytes + on_gpu.estimate.model_states.cpu_bytes
    refused = fit_verdict(small, Engine.parse("ddp"), 10**10, device_is_host=True)
    assert "offload" not in refused.advice and "processes" in refused.advice


def test_the_cli_takes_device_memory_and_keeps_gpu_memory(capsys):
    for flag in ("--device_memory", "--gpu_memory"):
        assert memory.main(["--params", "8B", "--hidden_size", str(H), "--num_layers", str(L), "--vocab_size",
                            str(V), "--intermediate_size", str(FFN), "--json", flag, "80GB"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["gpu_memory_bytes"] == 80 * 10**9 and data["cheapest_fit"] == "zero1"


@pytest.mark.parametrize("text", ["80", "lots"])
def test_a_bad_device_memory_is_one_sentence(text):
    from zero_utils.memory.fit_check import device_capacity
    from zero_utils.run.errors import UserError

    with pytest.raises(UserError, match=f"--device_memory '{text}' is not a memory size"):
        device_capacity(__import__("torch").device("cpu"), 1, text)


def cli_estimate(capsys, model: str, world: int, batch: int, dtype: str = "fp32", *extra: str) -> dict:
    """`python -m zero_utils.memory --json` for a recipe run of the tests (LOSS_CHUNK: 40-token chunks): {engine:
    total bytes per rank}. The recipes' fit check must print the same numbers."""
    assert memory.main(["--model", model, "--num_gpus", str(world), "--dtype", dtype, "--seq_len", "64",
                        "--micro_batch_size", str(batch), "--loss_chunk_tokens", LOSS_CHUNK[1], "--json",
                        *extra]) == 0
    return {row["engine"]: row["total_bytes"] for row in json.loads(capsys.readouterr().out)["engines"]}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_the_estimate_kept_next_to_the_peak_is_the_clis(run_layout, small_model, capsys, engine):
    """The shared 8-step runs (2 ranks x 4 rows of 64 tokens, fp32) keep in summary.json the estimate the fit
    check printed, equal to `python -m zero_utils.memory` for the same settings, and the capacity it came from."""
    summary = run_layout(engine, 2, 4, 1).summary()
    assert summary["peak_mem_bytes_estimated"] == cli_estimate(capsys, small_model, 2, 4)[engine]
    assert summary["fit_check"]["status"] == "fits" and summary["peak_mem_bytes"] > 0
    assert summary["fit_check"]["capacity_source"] == "host memory available / 2 local process(es)"


@pytest.mark.distributed
def test_a_run_that_does_not_fit_stops_every_rank_before_the_model_is_built(runs, small_model, capsys):
    """DDP on 2 ranks with --device_memory between DDP's estimate and the smallest other engine's: both ranks print
    the sentence naming the first engine that fits (by the CLI's numbers) with its launch line and exit 2; the
    fit-check line shows the CLI's total; neither the data nor the model was prepared (no packing bar, no
    start-up line)."""
    totals = cli_estimate(capsys, small_model, 2, 4)
    others = ("zero1", "zero2", "fsdp2_zero2", "zero3", "fsdp2")  # ENGINES order, without offload
    usable = (totals["ddp"] + min(totals[e] for e in others)) // 2
    fitting = next(e for e in others if totals[e] <= usable)
    capacity = round(usable / 0.9) + 1
    run = runs("fit-refused", "--model", small_model, "--seq_len", "64", "--per_device_batch_size", "4",
               "--max_steps", "1", "--report_to", "none", "--device_memory", str(capacity), config="ddp",
               mixed_precision="no", timeout=180)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert errors and run.stderr.count("error: this run needs") == 2, run.output[-3000:]  # one per rank
    assert errors[0].startswith(f"error: this run needs an estimated {totals['ddp'] / 1e6:.2f} MB per rank under "
                                "ddp, more than the ")
    assert (f"{fitting} fits ({totals[fitting] / 1e6:.2f} MB per process): accelerate launch --config_file "
            f"accelerate_configs/{fitting}.yaml --num_processes 2 recipes/llama_zero3.py") in errors[0]
    report = re.findall(r"rank\s+:\s+(\d+) \(local_rank: \d+\)\n\s+exitcode\s+:\s+(-?\d+)", run.stderr)
    assert sorted(report) == [("0", "2"), ("1", "2")], run.stderr[-3000:]
    assert f"= {totals['ddp'] / 1e6:.2f} MB per rank; capacity" in run.stdout
    assert "tokenize and pack" not in run.output and "engine ddp |" not in run.stdout


class OneProcess:
    """What check_fit reads of an Accelerator, for one CPU process (no process group: nothing to agree on)."""

    num_processes, mixed_precision, device, state = 1, "no", __import__("torch").device("cpu"), None

    def __init__(self):
        self.printed = []

    def print(self, text):
        self.printed.append(text)

    def wait_for_everyone(self):
        pass


def check_bundled(**kwargs):
    from zero_utils.assets import BUNDLED_MODEL
    from zero_utils.memory.fit_check import check_fit
    from zero_utils.model.loading import load_config

    accelerator = OneProcess()
    check = check_fit(accelerator, Engine.parse("single"), load_config(BUNDLED_MODEL), seq_len=64, micro_batch_size=4,
                      activation_checkpointing=False, attn_implementation="", loss_chunk_tokens=40, **kwargs)
    return check, accelerator.printed


def test_check_fit_refuses_warns_or_is_skipped_in_process():
    from zero_utils.run.errors import UserError

    check, printed = check_bundled(device_memory="1TB")
    need = check.verdict.total_bytes
    assert check.verdict.status == "fits" and len(printed) == 1 and printed[0].startswith("fit check [single, 1 ")
    assert check.summary()["peak_mem_bytes_estimated"] == need
    tight, printed = check_bundled(device_memory=str(round(need / 0.9 / 0.9)))
    assert tight.verdict.status == "tight" and printed[1].startswith("warning: the estimate is 90% of the usable")
    with pytest.raises(UserError, match=r"^this run needs an estimated .* under single, more than the .*; nothing fits "
                                        r"on 1 process of 2.00 MB; .*Pass --no-fit_check to start it anyway\.$"):
        check_bundled(device_memory="2MB")
    skipped, printed = check_bundled(device_memory="2MB", enabled=False)
    assert skipped.summary() == {"peak_mem_bytes_estimated": None, "fit_check": None} and printed == []
    warned, printed = check_bundled(device_memory="2MB", refuse=False)  # QLoRA: counted as 16-bit, never refused
    assert warned.verdict.status == "too_big" and printed[1].startswith("warning: this run needs an estimated")


def test_the_reference_model_adds_its_formula_and_the_dpo_fit_check_counts_it(capsys):
    """`--reference model` (recipes/llama_dpo.py): the estimate grows by the reference's parameters in bf16, 2 Psi
    (16 GB for 8B) on every GPU where the engine keeps whole parameters, 2 Psi / 8 (2 GB) where it shards them, and
    on the host under the offload configs. The fit check with the reference refuses a capacity between the two."""
    sizes = ["--params", "8B", "--hidden_size", str(H), "--num_layers", str(L), "--vocab_size", str(V),
             "--intermediate_size", str(FFN), "--num_gpus", "8", "--json"]
    rows = {}
    for reference in ("none", "model"):
        assert memory.main([*sizes, "--reference", reference]) == 0
        rows[reference] = {r["engine"]: r for r in json.loads(capsys.readouterr().out)["engines"]}
    for engine, without in rows["none"].items():
        with_reference = rows["model"][engine]
        whole, sharded = 2 * PSI, 2 * PSI // 8
        gpu, cpu = {"ddp": (whole, 0), "zero1": (whole, 0), "zero2": (whole, 0), "fsdp2_zero2": (sharded, 0),
                    "zero3": (sharded, 0), "fsdp2": (sharded, 0), "zero3_offload": (0, sharded),
                    "fsdp2_offload": (0, sharded)}[engine]
        assert with_reference["total_bytes"] - without["total_bytes"] == gpu == with_reference["reference_bytes"]
        assert with_reference["cpu_bytes"] - without["cpu_bytes"] == cpu, engine
    plain, _ = check_bundled(device_memory="1TB")
    with_reference, printed = check_bundled(device_memory="1TB", reference="model")
    replica = 4 * with_reference.setup.num_params  # fp32, one process: a whole replica
    assert with_reference.verdict.total_bytes == plain.verdict.total_bytes + replica
    assert " + reference 3.85 MB + " in printed[0]
    between = str(round((plain.verdict.total_bytes + replica / 2) / 0.9))
    assert check_bundled(device_memory=between)[0].verdict.status != "too_big"
    from zero_utils.run.errors import UserError

    with pytest.raises(UserError, match="this run needs an estimated"):
        check_bundled(device_memory=between, reference="model")
    # a frozen model other than the policy (zero_utils.train.frozen_model: a teacher) counts with its own parameters:
    # a Llama of hidden 128 and 4 layers, built by transformers in process to count them
    from transformers import AutoModelForCausalLM, LlamaConfig

    teacher = LlamaConfig(vocab_size=872, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    teacher_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(teacher).parameters())
    with_teacher, printed = check_bundled(device_memory="1TB", reference="model", frozen_config=teacher)
    assert with_teacher.verdict.total_bytes == plain.verdict.total_bytes + 4 * teacher_params  # fp32, one process
    assert teacher_params != with_reference.setup.num_params


def test_a_lora_policy_as_its_own_reference_adds_nothing_and_needs_its_adapters(capsys):
    """`--reference adapters` (recipes/llama_dpo_lora.py: the policy's forward with its adapters off): no second
    model, so every engine's total and host bytes are those of `--reference none` at the same --lora_fraction, the
    reference column reads 0; without --lora_fraction it is one sentence. The LoRA-DPO fit check plans the bytes of
    the same LoRA run without a reference and prints the reference term as 0."""
    from peft import LoraConfig

    sizes = ["--params", "8B", "--hidden_size", str(H), "--num_layers", str(L), "--vocab_size", str(V),
             "--intermediate_size", str(FFN), "--num_gpus", "8", "--lora_fraction", "0.01", "--json"]
    rows = {}
    for reference in ("none", "adapters"):
        assert memory.main([*sizes, "--reference", reference]) == 0
        rows[reference] = {r["engine"]: r for r in json.loads(capsys.readouterr().out)["engines"]}
    for engine, without in rows["none"].items():
        adapters = rows["adapters"][engine]
        assert adapters["reference_bytes"] == 0 and adapters["total_bytes"] == without["total_bytes"] > 0, engine
        assert adapters["cpu_bytes"] == without["cpu_bytes"], engine
    assert memory.main([*sizes[:-1], "--reference", "adapters"]) == 0  # the table
    assert "reference: the LoRA policy's own forward with its adapters off" in capsys.readouterr().out
    assert memory.main([*sizes[:-3], "--reference", "adapters"]) == 2  # every parameter trained: no adapters
    assert capsys.readouterr().err.strip() == ("error: --reference adapters is the LoRA policy's own forward with its "
                                               "adapters off: give --lora_fraction, the adapters' share of the "
                                               "parameters (e.g. 0.01).")
    lora = LoraConfig(r=4, target_modules="all-linear")
    plain, _ = check_bundled(device_memory="1TB", lora_config=lora)
    with_adapters, printed = check_bundled(device_memory="1TB", lora_config=lora, reference="adapters")
    assert with_adapters.verdict.total_bytes == plain.verdict.total_bytes
    assert " + reference (adapters off) 0.00 MB + " in printed[0] and "LoRA" in printed[0]
    assert with_adapters.summary()["fit_check"]["reference_bytes"] == 0


def test_a_precomputed_reference_holds_nothing_during_training(capsys):
    """`--reference precomputed` (recipes/llama_dpo.py): the copy is freed before training, so every engine's total
    is that of `--reference none` and the reference column reads 0, with a note; the DPO fit check prints the term as
    0 and plans the bytes of the run without a reference."""
    sizes = ["--params", "8B", "--hidden_size", str(H), "--num_layers", str(L), "--vocab_size", str(V),
             "--intermediate_size", str(FFN), "--num_gpus", "8"]
    rows = {}
    for reference in ("none", "precomputed"):
        assert memory.main([*sizes, "--json", "--reference", reference]) == 0
        rows[reference] = {r["engine"]: r for r in json.loads(capsys.readouterr().out)["engines"]}
    for engine, without in rows["none"].items():
        assert rows["precomputed"][engine]["reference_bytes"] == 0, engine
        assert rows["precomputed"][engine]["total_bytes"] == without["total_bytes"] > 0, engine
    assert memory.main([*sizes, "--reference", "precomputed"]) == 0
    assert "reference: precomputed (recipes/llama_dpo.py --reference precomputed)" in capsys.readouterr().out
    plain, _ = check_bundled(device_memory="1TB")
    precomputed, printed = check_bundled(device_memory="1TB", reference="precomputed")
    assert precomputed.verdict.total_bytes == plain.verdict.total_bytes
    assert " + reference (precomputed, freed) 0.00 MB + " in printed[0]

