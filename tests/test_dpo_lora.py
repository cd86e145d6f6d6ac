"""recipes/llama_dpo_lora.py: DPO with LoRA adapters, the reference being the policy's own forward with its
adapters off. In a process: that forward is the base model's and leaves every trainable shard trainable under FSDP2.
Launched (4 runs, 2 ranks, fp32, 4 steps of 8 pairs): FSDP2, FSDP2 with 2 micro-steps, ZeRO-3 and DDP. Step 1 is
ln 2 with zero rewards; no second model is built and the fit check counts no reference bytes; the ranks hold the
same adapters; the engines and the accumulation train alike; the saved adapter, reloaded with PEFT, gives the
held-out pairs the rewards of the run's final eval, and --merge writes a plain model with the same logits."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

DPO_LORA = "recipes/llama_dpo_lora.py"
HELD_OUT = 24  # the first pairs of the bundled set: the test split


# ---------------------------------------------------------------------------------------------- in process
@pytest.mark.distributed
def test_adapters_off_is_the_base_forward_and_every_shard_stays_trainable():
    """FSDP2, one gloo process (tests/scripts/adapters_off_probe.py): inside `adapters_off` the logits are the base
    model's, outside the adapted ones; PEFT's disable_adapter flips requires_grad through the modules, which under
    FSDP2 hold the gathered copy of the last block (kept for backward), so without the restore 14 of the 56 adapter
    shards (that block's 7 linears x A, B) would stay frozen and be left out of the saved adapter."""
    from conftest import free_port

    out = subprocess.run([sys.executable, str(REPO / "tests/scripts/adapters_off_probe.py")], cwd=REPO, text=True,
                         capture_output=True, timeout=120, env={**os.environ, "MASTER_PORT": str(free_port())})
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["trainable"] == 56
    assert found["requiring_grad_after_step"] == [56, 56]
    assert found["reference_equals_base"] == [True, True] and found["policy_differs"] == [True, True]


# ---------------------------------------------------------------------------------------------- launched
FOUR_STEPS = ("--max_steps", "4", "--warmup_steps", "1", "--lr", "3e-3", "--lora_dropout", "0", "--eval_every", "0",
              "--max_new_tokens", "0", "--report_to", "none", "--dataset_split", "train,test")


@pytest.fixture(scope="module")
def pairs_with_a_test_split(session_root) -> str:
    """The bundled pairs as a save_to_disk DatasetDict: the first HELD_OUT pairs are the test split."""
    from datasets import DatasetDict, load_dataset

    from zero_utils.assets import BUNDLED_PREFERENCES

    path = session_root / "dpo-lora-pairs"
    if not path.exists():
        rows = load_dataset("json", data_files=BUNDLED_PREFERENCES, split="train")
        DatasetDict(train=rows.select(range(HELD_OUT, len(rows))), test=rows.select(range(HELD_OUT))).save_to_disk(
            path)
    return str(path)


@pytest.fixture(scope="module")
def dpo_lora_run(runs, session_root, base_model, pairs_with_a_test_split):
    """`dpo_lora_run(config, batch=4, accumulation=1, *flags)`: 4 steps on 2 ranks, fp32, a global batch of 8 pairs,
    the final eval on the test split, the saved tiny base (conftest.base_model); weights digested per rank
    (tests/scripts/harness.py)."""
    from conftest import isolated_env

    def get(config, batch=4, accumulation=1, *extra):
        env = {**isolated_env(session_root), "ZERO_RECIPES_HARNESS_VERIFY_REPLICAS": "1"}
        return runs(f"dpo-lora-{config}-{batch}x{accumulation}", "--model", base_model, "--dataset",
                    pairs_with_a_test_split, *FOUR_STEPS,
                    "--per_device_batch_size", str(batch), "--gradient_accumulation_steps", str(accumulation), *extra,
                    recipe=DPO_LORA, config=config, mixed_precision="no", env=env).check()
    return get


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("config", ["fsdp2", "zero3"])
def test_step_one_is_ln2_with_one_model_and_the_ranks_hold_the_same_adapters(dpo_lora_run, config):
    """The adapters start at B = 0, so the policy is its reference: loss ln 2, every reward 0. Each rank built one
    model (llama_dpo.py builds two), the fit check planned 0 reference bytes, and at the end both ranks see the same
    weights, adapters included (adapters attached after sharding would train per rank: their digests would differ),
    and the adapters moved."""
    run = dpo_lora_run(config, 4, 1, "--merge") if config == "fsdp2" else dpo_lora_run(config)
    first, summary = run.metrics()[0], run.summary()
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for key in ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy"):
        assert first[key] == pytest.approx(0.0, abs=1e-7), key
    assert summary["causal_lms_built_per_rank"] == [1, 1]
    assert summary["fit_check"]["reference_bytes"] == 0 and summary["reference_state_bytes"] == 0
    assert "reference (adapters off) 0.00 MB" in run.output
    assert summary["model_state_bytes"] == pytest.approx(summary["model_state_bytes_expected"], rel=0.01)
    digests = summary["weights_digest_per_rank"]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert abs(summary["eval_reward_margin"]) > 1e-3  # trained: the adapters are no longer zero


# FSDP2's per-step losses with the adapters-off reference, recorded with the code before the reference became one
# object (6aee865, issue 69): dpo_lora_run("fsdp2", 4, 1, "--merge").
PINNED_ADAPTERS_OFF = [0.6931471824645996, 0.661810576915741, 0.6664004027843475, 0.6603114902973175]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("other", ["accumulation", "zero3", "ddp"])
def test_engines_and_accumulation_train_as_fsdp2_does(dpo_lora_run, other):
    """FSDP2 with 2 micro-steps of 2 pairs per rank (its gradients reduce-scattered after each, the reference's
    forward before each policy forward), ZeRO-3 and DDP, against FSDP2 with one micro-step of 4: the same loss,
    margin and chosen log-probs at every step, and the same final eval (the SFT tests' tolerances)."""
    from test_dpo import PIN_RTOL
    from test_zero_math import LOSS_RTOL

    reference = dpo_lora_run("fsdp2", 4, 1, "--merge")
    run = dpo_lora_run("fsdp2", 2, 2) if other == "accumulation" else dpo_lora_run(other)
    # as before issue 69's reference object, to test_dpo's PIN_RTOL (another CPU's last digits)
    assert [m["loss"] for m in reference.metrics()] == pytest.approx(PINNED_ADAPTERS_OFF, rel=PIN_RTOL)
    for key in ("loss", "reward_margin", "logps_chosen"):
        assert [m[key] for m in run.metrics()] == pytest.approx([m[key] for m in reference.metrics()],
                                                               rel=LOSS_RTOL, abs=1e-6), key
    for key in ("eval_loss", "eval_reward_margin"):
        assert run.summary()[key] == pytest.approx(reference.summary()[key], rel=LOSS_RTOL, abs=1e-6), key
    assert reference.metrics()[-1]["reward_margin"] > 0  # trained: the comparison is not of zeros


def held_out_log_probs(model, tokenizer, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(chosen, rejected) summed answer log-probabilities of each HELD_OUT test pair under `model`, one pair at a
    time, unpadded, from the model's logits (Rafailov et al. eq. 7)."""
    from datasets import load_dataset

    from zero_utils.assets import BUNDLED_PREFERENCES
    from zero_utils.data.sft_examples import IGNORE_INDEX
    from zero_utils.preference.examples import tokenize_pair

    def answer_log_prob(ids, labels):
        labels = torch.tensor(labels)
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        kept = labels != IGNORE_INDEX
        return torch.log_softmax(logits[kept], -1).gather(-1, labels[kept].unsqueeze(-1)).sum()

    rows = load_dataset("json", data_files=BUNDLED_PREFERENCES, split="train").select(range(HELD_OUT))
    with torch.no_grad():
        pairs = [tokenize_pair(tokenizer, row["prompt"], row["chosen"], row["rejected"], seq_len) for row in rows]
        return [tuple(answer_log_prob(pair[f"{s}_ids"], pair[f"{s}_labels"]) for s in ("chosen", "rejected"))
                for pair in pairs]


def held_out_scores(model, tokenizer, beta: float, seq_len: int) -> dict:
    """The sigmoid DPO loss and rewards of the HELD_OUT test pairs (`held_out_log_probs`): the policy is `model` (a
    PeftModel), its reference the same model inside PEFT's `disable_adapter`."""
    policy = held_out_log_probs(model, tokenizer, seq_len)
    with model.disable_adapter():
        base = held_out_log_probs(model, tokenizer, seq_len)
    sums = {"loss": 0.0, "reward_chosen": 0.0, "reward_rejected": 0.0, "reward_margin": 0.0, "reward_accuracy": 0.0}
    for pair_policy, pair_base in zip(policy, base, strict=True):
        chosen, rejected = (beta * (p - b) for p, b in zip(pair_policy, pair_base, strict=True))
        for key, value in (("loss", -torch.nn.functional.logsigmoid(chosen - rejected)), ("reward_chosen", chosen),
                           ("reward_rejected", rejected), ("reward_margin", chosen - rejected),
                           ("reward_accuracy", float(chosen > rejected))):
            sums[key] += float(value)
    return {key: value / len(policy) for key, value in sums.items()}


@pytest.mark.distributed
@pytest.mark.slow
def test_the_reloaded_adapter_scores_the_held_out_pairs_as_the_final_eval_and_merge_is_plain(dpo_lora_run,
                                                                                              base_model):
    """final/ reloads with `PeftModel.from_pretrained` on the base --model: its
    rewards on the test split, computed here pair by pair, are the run's final eval_ metrics (an adapter missing any
    tensor, say the last block's, would score otherwise); final/merged/ is a plain model with the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = dpo_lora_run("fsdp2", 4, 1, "--merge")
    summary, final = run.summary(), run.output_dir / "final"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), final).eval()
    found = held_out_scores(model, AutoTokenizer.from_pretrained(final), summary["beta"], summary["seq_len"])
    for key, value in found.items():
        assert value == pytest.approx(summary[f"eval_{key}"], rel=1e-4, abs=1e-5), key
    assert abs(found["reward_margin"]) > 1e-3

    merged = AutoModelForCausalLM.from_pretrained(final / "merged")
    assert not (final / "merged" / "adapter_config.json").exists() and type(merged).__name__ == "LlamaForCausalLM"
    ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4,
                                   atol=1e-4)


@pytest.mark.distributed
@pytest.mark.slow
def test_merge_of_a_config_only_base_is_the_trained_model(runs, pairs_with_a_test_split):
    """The bundled model holds only a config, so the run draws its base from the seed; --merge must merge the
    adapters into that base, not into another draw: final/merged/, loaded with transformers alone, gives the
    held-out pairs (computed here) the chosen and rejected log-probs of the run's own final eval (ZeRO-3, fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = runs("dpo-lora-zero3-config-only-merge", "--dataset", pairs_with_a_test_split, *FOUR_STEPS, "--merge",
               "--per_device_batch_size", "4", recipe=DPO_LORA, config="zero3", mixed_precision="no").check()
    summary, merged_dir = run.summary(), run.output_dir / "final" / "merged"
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    log_probs = held_out_log_probs(merged, AutoTokenizer.from_pretrained(merged_dir), summary["seq_len"])
    chosen, rejected = (sum(float(pair[i]) for pair in log_probs) / len(log_probs) for i in (0, 1))
    assert chosen == pytest.approx(summary["eval_logps_chosen"], rel=1e-5)
    assert rejected == pytest.approx(summary["eval_logps_rejected"], rel=1e-5)
    assert abs(summary["eval_reward_margin"]) > 1e-3  # trained: the adapters are no longer zero


@pytest.mark.distributed
@pytest.mark.slow
def test_the_summary_and_the_tracker_config_keep_their_keys(dpo_lora_run):
    """Issue 71: summary.json and the W&B config of a LoRA-DPO run (with its held-out test split) hold exactly the
    keys the recipe wrote itself before the bookkeeping moved into the tracker (tests/record_keys.py)."""
    from record_keys import assert_record_keys

    assert_record_keys(dpo_lora_run("fsdp2", 4, 1, "--merge"), "llama_dpo_lora")
