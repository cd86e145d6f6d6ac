"""recipes/llama_dpo.py: preference tuning under every engine. In process: each loss against a value computed by
hand from its paper's formula, the objective with --sft_weight, the pairs' tokens, truncation and batching. Launched
as users launch (runs named in the closing note): step 1 of DPO is ln 2 with zero rewards under DDP, ZeRO-1/2/3
and FSDP2 (fp32, and bf16 as shipped); the engines train as one process does; the reference never changes and
costs what its formula says; FSDP2 gathers at most two of its units at once; the default run learns."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from zero_utils.preference.loss import answer_log_probs, learning_rate, objective_sum, pair_scores, resolve
from zero_utils.run.errors import UserError

# ---------------------------------------------------------------------------------------------- in process


def test_dpo_sigmoid_loss_by_hand():
    """Rafailov et al. eq. 7: -log sigmoid(beta ((p_c - r_c) - (p_r - r_r))) with summed answer log-probs.
    p_c -10, r_c -11, p_r -12, r_r -11, beta 0.1: the margin is 1 - (-1) = 2, the loss log(1 + e^-0.2)."""
    t = torch.tensor
    scores = pair_scores("sigmoid", 0.1, t([-10.0]), t([-12.0]), t([-11.0]), t([-11.0]))
    assert scores.losses.item() == pytest.approx(math.log1p(math.exp(-0.2)), rel=1e-6)
    assert scores.chosen_rewards.item() == pytest.approx(0.1) and scores.rejected_rewards.item() == pytest.approx(-0.1)
    sums = scores.sums()
    assert sums["reward_margin"].item() == pytest.approx(0.2) and sums["reward_accuracy"].item() == 1.0


def test_ipo_loss_averages_token_log_probs_by_hand():
    """Azar et al. eq. 17 with trl's per-token means: chosen tokens (-1, -3) -> -2, reference (-2, -2) -> -2;
    rejected (-4) -> -4, reference (-3) -> -3; the log-ratio difference is 0 - (-1) = 1, beta 0.1: (1 - 5)^2 = 16."""
    token_logps = torch.tensor([[-1.0, -3.0], [-4.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    policy = answer_log_probs(token_logps, mask, average=True)
    reference = answer_log_probs(torch.tensor([[-2.0, -2.0], [-3.0, 9.0]]), mask, average=True)
    assert policy.tolist() == [-2.0, -4.0] and reference.tolist() == [-2.0, -3.0]
    scores = pair_scores("ipo", 0.1, policy[:1], policy[1:], reference[:1], reference[1:])
    assert scores.losses.item() == pytest.approx(16.0)


def test_simpo_loss_is_reference_free_by_hand():
    """Meng et al. eq. 6: -log sigmoid(beta (avg p_c - avg p_r) - gamma); -2 and -4, beta 2, gamma 1: log(1 + e^-3)."""
    scores = pair_scores("simpo", 2.0, torch.tensor([-2.0]), torch.tensor([-4.0]), simpo_gamma=1.0)
    assert scores.losses.item() == pytest.approx(math.log1p(math.exp(-3.0)), rel=1e-6)
    assert scores.chosen_rewards.item() == -4.0 and scores.rejected_rewards.item() == -8.0


def test_sft_weight_adds_the_chosen_nll_per_chosen_token_of_the_global_batch():
    """Two ranks, one pair each, 3 and 5 chosen tokens with summed NLL 6 and 20: the step's loss is the mean pair
    loss (0.5, 0.7 -> 0.6) + 0.5 x (6 + 20) / 8 = 2.225, as the sum over ranks divided by the 2 pairs."""
    rank_parts = []
    for loss, nll in ((0.5, 6.0), (0.7, 20.0)):
        scores = pair_scores("sigmoid", 0.1, torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1))
        scores.losses = torch.tensor([loss])
        rank_parts.append(objective_sum(scores, torch.tensor(nll), sft_weight=0.5, global_pairs=2,
                                        global_chosen_tokens=8))
    assert (sum(rank_parts) / 2).item() == pytest.approx(0.6 + 0.5 * 26 / 8)


def test_reference_and_beta_follow_the_loss():
    assert resolve("sigmoid", 0.0, "") == (0.1, "model") and resolve("simpo", 0.0, "") == (2.0, "none")
    assert resolve("ipo", 0.3, "model") == (0.3, "model")
    assert resolve("sigmoid", 0.0, "precomputed") == (0.1, "precomputed")
    with pytest.raises(UserError, match="--loss simpo is reference-free: drop --reference precomputed"):
        resolve("simpo", 0.0, "precomputed")
    with pytest.raises(UserError, match="^--reference precomputed frees a frozen copy of the model, but this recipe's "
                                        "reference is the base with its adapters off"):
        resolve("sigmoid", 0.0, "precomputed", lora=True)
    with pytest.raises(UserError, match="--loss sigmoid compares the policy with a reference model: drop "
                                        "--reference none"):
        resolve("sigmoid", 0.0, "none")
    with pytest.raises(UserError, match="--loss simpo is reference-free"):
        resolve("simpo", 0.0, "model")


def test_lr_not_given_is_1e_3_for_a_config_only_model_and_refused_for_pretrained_weights(tmp_path):
    """The README's demo (the bundled model, random weights) learns at --lr 1e-3 without naming it; the same default
    on pretrained weights would destroy them, so a DPO recipe given pretrained weights and no --lr stops before any
    work with the preset's rate (presets/zephyr-7b-dpo-full.yaml) in its sentence. Both DPO recipes default to it."""
    import runpy

    import yaml
    from conftest import REPO

    from zero_utils.assets import BUNDLED_MODEL
    from zero_utils.launch.cli import parse_settings

    assert not any(Path(BUNDLED_MODEL).glob("*.safetensors"))  # the bundled model holds only a config
    assert learning_rate(None, BUNDLED_MODEL) == 1e-3
    preset_lr = yaml.safe_load((REPO / "presets/zephyr-7b-dpo-full.yaml").read_text())["lr"]
    suggested = f"{preset_lr:.0e}".replace("e-0", "e-")  # 5e-7
    (tmp_path / "pretrained").mkdir()
    (tmp_path / "pretrained" / "model.safetensors").write_bytes(b"")
    for model in (str(tmp_path / "pretrained"), "HuggingFaceH4/mistral-7b-sft-beta"):  # a Hub id: weights too
        with pytest.raises(UserError, match=rf"^--lr is not given, and its default 0.001 .* would destroy the "
                                            rf"pretrained weights of --model {model} within a few steps: pass --lr, "
                                            rf"e.g. {suggested} as presets/zephyr-7b-dpo-full.yaml does.$"):
            learning_rate(None, model)
        assert learning_rate(5e-7, model) == 5e-7 and learning_rate(0.0, model) == 0.0  # given: kept, 0 too
    for recipe in ("recipes/llama_dpo.py", "recipes/llama_dpo_lora.py"):
        settings = runpy.run_path(str(REPO / recipe), run_name="lr_test")["Settings"]
        assert parse_settings(settings, []).lr is None
        assert parse_settings(settings, ["--config", str(REPO / "presets/zephyr-7b-dpo-full.yaml")]).lr == preset_lr


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from zero_utils.assets import BUNDLED_MODEL

    return AutoTokenizer.from_pretrained(BUNDLED_MODEL)


def test_a_pair_is_two_sequences_with_loss_on_the_answers_only(tokenizer):
    from zero_utils.data.sft_examples import IGNORE_INDEX
    from zero_utils.preference.examples import tokenize_pair

    pair = tokenize_pair(tokenizer, "Spell the word tiger.", "t-i-g-e-r", "tiger", 128)
    for side, answer in (("chosen", "t-i-g-e-r"), ("rejected", "tiger")):
        ids, labels = pair[f"{side}_ids"], pair[f"{side}_labels"]
        trained = [label for label in labels if label != IGNORE_INDEX]
        assert tokenizer.decode(trained).rstrip("\n") == answer + tokenizer.eos_token  # the answer and its end only
        assert labels[:-1] == [ids[t + 1] if labels[t] != IGNORE_INDEX else IGNORE_INDEX for t in range(len(ids) - 1)]
    assert not pair["truncated"]


def test_truncation_keeps_the_first_seq_len_tokens_and_drops_pairs_without_an_answer(tokenizer):
    from zero_utils.data.sft_examples import IGNORE_INDEX
    from zero_utils.preference.examples import tokenize_pair

    whole = tokenize_pair(tokenizer, "Spell the word tiger.", "t-i-g-e-r " * 10, "tiger", 128)
    prompt_tokens = whole["chosen_labels"].index(next(x for x in whole["chosen_labels"] if x != IGNORE_INDEX))
    cut = tokenize_pair(tokenizer, "Spell the word tiger.", "t-i-g-e-r " * 10, "tiger", prompt_tokens + 4)
    assert cut["truncated"] and len(cut["chosen_ids"]) == prompt_tokens + 4
    assert cut["chosen_ids"] == whole["chosen_ids"][:prompt_tokens + 4] and cut["chosen_labels"][-1] == IGNORE_INDEX
    assert tokenize_pair(tokenizer, "Spell the word tiger.", "t-i-g-e-r", "tiger", prompt_tokens) is None


def unpadded(row: torch.Tensor, pad_token_id: int) -> list[int]:
    """A right-padded row's tokens without the padding."""
    tokens = row.tolist()
    while tokens and tokens[-1] == pad_token_id:
        tokens.pop()
    return tokens


def test_a_pairs_answers_share_a_micro_batch_chosen_rows_first(tokenizer):
    from datasets import Dataset

    from zero_utils.data.sft_examples import IGNORE_INDEX
    from zero_utils.preference.data import PreferenceData
    from zero_utils.preference.examples import tokenize_pair

    raw = [("Spell the word tiger.", "t-i-g-e-r", "tiger"), ("Write the number 7 in words.", "seven", "7"),
           ("What color is snow?", "Snow is white.", "Snow is black."), ("Add 2 and 3.", "2 plus 3 is 5.", "23")]
    pairs = [tokenize_pair(tokenizer, *r, 64) for r in raw]
    stored = Dataset.from_list([{**p, "chosen_tokens": sum(x != IGNORE_INDEX for x in p["chosen_labels"]),
                                 "tokens": len(p["chosen_ids"]) + len(p["rejected_ids"])} for p in pairs])
    data = [PreferenceData(stored, stored.select(range(3)), {}, per_device_batch_size=1,
                           gradient_accumulation_steps=2, seed=0, pad_token_id=3, rank=rank, world_size=2,
                           device=torch.device("cpu")) for rank in (0, 1)]
    seen = []
    for rank_data in data:
        for micro in rank_data.step_batches(1).micro_batches:
            assert micro.inputs["input_ids"].shape[0] == 2  # one pair: its chosen row, then its rejected row
            assert set(micro.inputs) == {"input_ids", "use_cache"}  # right-padded, causal: no mask to read
            chosen, rejected = (unpadded(row, 3) for row in micro.inputs["input_ids"])
            match = next(p for p in pairs if p["chosen_ids"] == chosen)
            assert match["rejected_ids"] == rejected
            seen.append(chosen)
    assert len(seen) == 4 and len({tuple(s) for s in seen}) == 4  # the global batch, each pair once
    eval_counts = [[weights.tolist() for _, weights in rank_data.eval_batches()] for rank_data in data]
    assert eval_counts == [[[1.0], [1.0]], [[1.0], [0.0]]]  # as many batches on each rank; a filler weighs 0


def test_precomputed_log_probs_reach_each_micro_batch_by_pair_and_average_as_the_loss_does(tokenizer):
    """In a process, 2 ranks' views of 5 pairs with precomputed log-probs (pair i: chosen -i, rejected -10 - i): every
    micro-batch of a step, of eval and of the strided pass carries its own pairs' values, chosen rows first; the
    averaged form (ipo) is the stored sum over each row's answer tokens, as loss.answer_log_probs takes
    the mean of token log-probs."""
    from datasets import Dataset

    from zero_utils.data.sft_examples import IGNORE_INDEX
    from zero_utils.preference.data import PreferenceData
    from zero_utils.preference.examples import tokenize_pair
    from zero_utils.preference.reference_logps import PrecomputedReference

    raw = [("Spell the word tiger.", "t-i-g-e-r", "tiger"), ("Write the number 7 in words.", "seven", "7"),
           ("What color is snow?", "Snow is white.", "Snow is black."), ("Add 2 and 3.", "2 plus 3 is 5.", "23"),
           ("Name a fruit.", "An apple.", "A chair.")]
    pairs = [tokenize_pair(tokenizer, *r, 64) for r in raw]
    stored = Dataset.from_list([{**p, "chosen_tokens": sum(x != IGNORE_INDEX for x in p["chosen_labels"]),
                                 "tokens": len(p["chosen_ids"]) + len(p["rejected_ids"])} for p in pairs])
    logps = torch.tensor([[-float(i), -10.0 - i] for i in range(5)])
    for rank in (0, 1):
        data = PreferenceData(stored, stored, {}, per_device_batch_size=1, gradient_accumulation_steps=2, seed=0,
                              pad_token_id=3, rank=rank, world_size=2, device=torch.device("cpu"))
        data.attach_reference_logps(logps, logps)
        micro_batches = [*data.step_batches(1).micro_batches, *(m for m, _ in data.eval_batches()),
                         *(m for m, _ in data.strided_batches("train"))]
        for micro in micro_batches:
            chosen = unpadded(micro.inputs["input_ids"][0], 3)
            i = next(k for k, p in enumerate(pairs) if p["chosen_ids"] == chosen)
            assert micro.reference_logps.tolist() == [-float(i), -10.0 - i]
    token_logps = torch.tensor([[-1.0, -3.0, 0.0], [-4.0, -2.0, -6.0]])
    answers = torch.tensor([[True, True, False], [True, True, True]])

    class Micro:
        reference_logps = answer_log_probs(token_logps, answers, average=False)

    precomputed = PrecomputedReference("digest", torch.float32, Path("x"), 5, reused=True, seconds=0.0,
                                       pass_state_bytes=0, built=False)
    chosen, rejected = precomputed.pair_log_probs(Micro, answers, average=True)
    assert [*chosen.tolist(), *rejected.tolist()] == answer_log_probs(token_logps, answers, average=True).tolist() \
        == [-2.0, -4.0]
    chosen, rejected = precomputed.pair_log_probs(Micro, answers, average=False)
    assert [*chosen.tolist(), *rejected.tolist()] == [-4.0, -12.0]


def test_a_set_without_pair_columns_names_the_ones_it_has():
    from zero_utils.preference.examples import pair_layout, parse_pair_columns

    with pytest.raises(UserError, match=r"has columns \['messages'\] but a preference set needs prompt, chosen and "
                                        r"rejected \(missing: prompt, chosen, rejected;"):
        pair_layout(["messages"], {"messages": []}, {})
    row = {"q": "hi", "good": "a", "bad": "b"}
    assert pair_layout(["q", "good", "bad"], row, parse_pair_columns("prompt=q,chosen=good,rejected=bad")) == "pairs"
    with pytest.raises(UserError, match=r"missing: prompt"):  # strings need their prompt
        pair_layout(["chosen", "rejected"], {"chosen": "a", "rejected": "b"}, {})


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_the_prompt_of_conversational_pairs_by_hand():
    """UltraFeedback-binarized (a prompt string, both lists starting with it), Anthropic HH (no prompt: the shared
    leading turns), a prompt given as messages with bare answers, and plain strings."""
    from zero_utils.preference.examples import pair_layout, split_pair

    ultrafeedback = {"prompt": "What is 2+2?", "chosen": [user("What is 2+2?"), assistant("4")],
                     "rejected": [user("What is 2+2?"), assistant("5")], "score_chosen": 9.0, "score_rejected": 2.0}
    assert pair_layout(list(ultrafeedback), ultrafeedback, {}) == "conversational"
    assert split_pair(ultrafeedback["prompt"], ultrafeedback["chosen"], ultrafeedback["rejected"]) == (
        [user("What is 2+2?")], [assistant("4")], [assistant("5")])
    hh = {"chosen": [user("Hi"), assistant("Hello!"), user("Capital of France?"), assistant("Paris.")],
          "rejected": [user("Hi"), assistant("Hello!"), user("Capital of France?"), assistant("Lyon.")]}
    assert pair_layout(list(hh), hh, {}) == "conversational, shared turns"
    assert split_pair(None, hh["chosen"], hh["rejected"]) == (
        [user("Hi"), assistant("Hello!"), user("Capital of France?")], [assistant("Paris.")], [assistant("Lyon.")])
    system = [{"role": "system", "content": "Be brief."}, user("Spell cat.")]
    assert split_pair(system, [assistant("c-a-t")], [assistant("cat")]) == (
        system, [assistant("c-a-t")], [assistant("cat")])
    assert split_pair("Spell cat.", "c-a-t", "cat") == ([user("Spell cat.")], [assistant("c-a-t")], [assistant("cat")])
    assert split_pair(None, hh["chosen"], hh["chosen"]) is None  # no answer of its own


def test_a_conversational_pair_trains_only_its_final_answer(tokenizer):
    from zero_utils.data.sft_examples import IGNORE_INDEX
    from zero_utils.preference.examples import tokenize_pair

    chosen = [user("Hi"), assistant("Hello!"), user("Capital of France?"), assistant("Paris.")]
    rejected = chosen[:3] + [assistant("Lyon.")]
    pair = tokenize_pair(tokenizer, None, chosen, rejected, 128)
    for side, answer in (("chosen", "Paris."), ("rejected", "Lyon.")):
        trained = [label for label in pair[f"{side}_labels"] if label != IGNORE_INDEX]
        assert tokenizer.decode(trained).rstrip("\n") == answer + tokenizer.eos_token  # not "Hello!"


# ---------------------------------------------------------------------------------------------- launched
DPO = "recipes/llama_dpo.py"
FOUR_STEPS = ("--max_steps", "4", "--warmup_steps", "2", "--eval_fraction", "0", "--max_new_tokens", "0",
              "--report_to", "none", "--save_every", "2")
ENGINES_FP32 = ["ddp", "zero1", "zero2", "zero3", "fsdp2"]
PROBED = {"fsdp2", "fsdp2_zero2"}  # the reference's gathered parameters recorded (tests/scripts/harness.py)
FROZEN_PROBED = {"fsdp2", "zero3"}  # another model held as a FrozenModel beside the policy (tests/scripts/harness.py)


def smaller_llama(root) -> str:
    """A tiny Llama smaller than the bundled one (hidden 32, 2 layers) with the bundled tokenizer, config only."""
    from conftest import llama_from_config

    return llama_from_config(root / "llama-smaller", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def dpo_run(runs, session_root):
    """`dpo_run(config, mixed_precision="no", world=2, batch=4, accumulation=1)`: 4 DPO steps (sigmoid) on the
    bundled model and pairs, a global batch of 8 pairs; config None = one process without an accelerate config.
    Probes (tests/scripts/harness.py): the live tensor bytes at the end of step 1; the host syncs of step 3; the
    reference's gathered parameters and weak references under FSDP2 and ZeRO-3; there, a smaller model held as a
    FrozenModel beside the policy, then released."""
    from conftest import CPU_BF16, isolated_env, sync_probe

    def get(config, mixed_precision="no", world=2, batch=4, accumulation=1):
        env = {**isolated_env(session_root), **CPU_BF16, "ZERO_RECIPES_HARNESS_LIVE_TENSORS": "1", **sync_probe(3),
               **({"ZERO_RECIPES_HARNESS_REFERENCE_PROBE": "1"} if config in PROBED | {"zero3"} else {}),
               **({"ZERO_RECIPES_HARNESS_FROZEN_PROBE": smaller_llama(session_root)} if config in FROZEN_PROBED
                  else {})}
        name = f"dpo-{config or 'single'}-{mixed_precision}-{world}x{batch}x{accumulation}"
        return runs(name, *FOUR_STEPS, "--per_device_batch_size", str(batch), "--gradient_accumulation_steps",
                    str(accumulation), recipe=DPO, config=config, num_processes=world,
                    mixed_precision=mixed_precision, env=env).check()
    return get


# The bundled pairs' figures before the pairs were prepared once per job (every rank tokenized every pair in memory;
# recorded with the code of e2e33a6): DDP, 2 processes, fp32, TODAY_ARGS. Steps 1-4 and the evals at steps 2 and 4.
TODAY_ARGS = ("--max_steps", "4", "--warmup_steps", "2", "--eval_fraction", "0.05", "--eval_every", "2",
              "--max_new_tokens", "0", "--report_to", "none", "--per_device_batch_size", "4", "--lr", "3e-4")
TODAY = {"loss": [0.6931471824645996, 0.6655547320842743, 0.6509440541267395, 0.6582489013671875],
         "eval_loss": [0.6468142867088318, 0.641472339630127],
         "eval_reward_accuracy": [0.6600000262260437, 0.6299999952316284]}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(FROZEN_PROBED))
def test_a_frozen_model_of_another_size_is_held_as_the_engine_holds_the_policy(dpo_run, session_root, config):
    """zero_utils.train.frozen_model.FrozenModel holding a smaller tiny Llama (the policy's tokenizer) beside the
    DPO policy, fp32, 2 ranks (dpo_run's FSDP2 and ZeRO-3 runs, tests/scripts/harness.py): its parameters are the
    ones transformers builds from its config, and each rank holds 4 bytes x parameters / 2, its formula, to 1%
    (padding of the shards), where the policy has five times as many parameters or more."""
    from transformers import AutoConfig, AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(smaller_llama(session_root))).parameters())
    run = dpo_run(config)
    probes = run.summary()["frozen_probe_per_rank"]
    assert len(probes) == 2 and params < run.summary()["num_params"] / 5
    for probe in probes:
        assert probe["num_params"] == params
        assert probe["state_bytes"] == pytest.approx(4 * params / 2, rel=0.01)
        assert probe["formula_bytes"] == probe["expected_state_bytes"] == -(-4 * params // 2)
        assert probe["measured_state_bytes"] == max(p["state_bytes"] for p in probes)


def test_every_reference_mode_answers_the_same_calls_and_none_is_the_null_case():
    """zero_utils.preference.reference.build_reference, in process, for the modes that build nothing before the
    policy: `none` (SimPO) gives (None, None) log-probs, no line and a summary of Nones; a LoRA policy's `model` is
    its adapters off: 0 bytes, no second model, the summary's mode still `model`."""
    from types import SimpleNamespace

    from zero_utils.preference.reference import AdaptersOffReference, NoReference, build_reference

    one = SimpleNamespace(num_processes=1)
    none = build_reference("none", one, None, None, model="m", seed=0, loss_chunk_tokens=40)
    assert type(none) is NoReference and none.pair_log_probs(None, None, False) == (None, None)
    none.start(None, None)
    assert none.describe() == "" and set(none.summary().values()) == {"none", None}
    lora = build_reference("model", one, None, None, model="m", seed=0, loss_chunk_tokens=40, lora=True)
    assert type(lora) is AdaptersOffReference and "adapters off (no second model: 0 bytes)" in lora.describe()
    assert lora.summary() == {**none.summary(), "reference": "model", "reference_state_bytes": 0}
    assert set(lora.summary()) == set(none.summary()) == {
        "reference", "reference_logps", "reference_state_bytes", "reference_state_bytes_expected",
        "reference_digest_start", "reference_digest_end"}


def test_a_frozen_model_with_another_vocabulary_is_one_sentence():
    from transformers import LlamaConfig

    from zero_utils.run.errors import UserError
    from zero_utils.train.frozen_model import check_same_vocabulary

    with pytest.raises(UserError, match=r"^--teacher 'big-llama' has a vocabulary of 128256 tokens and the policy "
                                        r"--model 'tiny' one of 872; a frozen model must share the policy's "
                                        r"tokenizer: pick one of the same model family\.$"):
        check_same_vocabulary(LlamaConfig(vocab_size=128256), LlamaConfig(vocab_size=872), flag="--teacher",
                              name="big-llama", policy_name="tiny")
    check_same_vocabulary(LlamaConfig(vocab_size=872), LlamaConfig(vocab_size=872), flag="--teacher", name="a",
                          policy_name="b")  # the same vocabulary: nothing


# Per-step losses of every reference mode, recorded with the code before the reference became one object (6aee865,
# issue 69): DDP, 2 processes, fp32, FOUR_STEPS, a micro-batch of 4 pairs (`--reference model`: TODAY above;
# LoRA-DPO's adapters off: tests/test_dpo_lora.py). The runs after it must train these to PIN_RTOL.
# PIN_RTOL: the same code on another CPU gives other last digits (AVX2 against AVX512 kernels: up to 3.7e-7 seen,
# 2026-12-07); a changed reference or loss moves a step's loss by 1e-3 or more.
PIN_RTOL = 1e-6
PINNED = {"precomputed": [0.6931471228599548, 0.6452320218086243, 0.6193743646144867, 0.5804722905158997],
          "none": [1.280958890914917, 1.2685195803642273, 1.0922970175743103, 1.2297831177711487]}


@pytest.mark.distributed
@pytest.mark.slow
def test_simpo_without_a_reference_trains_the_pinned_losses(runs):
    """`--loss simpo` (no reference: the null case), DDP on 2 ranks, fp32: the losses recorded before the reference
    became one object (to PIN_RTOL); no reference bytes, digests or log-probs in the summary."""
    run = runs("dpo-simpo-ddp", *FOUR_STEPS, "--loss", "simpo", "--per_device_batch_size", "4", recipe=DPO,
               config="ddp", mixed_precision="no").check()
    assert [m["loss"] for m in run.metrics()] == pytest.approx(PINNED["none"], rel=PIN_RTOL)
    summary = run.summary()
    assert summary["reference"] == "none" and summary["reference_state_bytes"] is None
    assert summary["reference_digest_start"] is None and summary["reference_logps"] is None
    assert "reference:" not in run.output


@pytest.fixture(scope="module")
def prepared_twice(tmp_path_factory):
    """TODAY_ARGS launched twice on one cold datasets cache, as a user relaunches: the first tokenizes with 2
    worker processes, the second finds the pairs prepared."""
    from conftest import isolated_env, launch

    root = tmp_path_factory.mktemp("dpo-pairs")
    env = isolated_env(root)
    first = launch(root / "first", *TODAY_ARGS, "--num_proc", "2", recipe=DPO, config="ddp", mixed_precision="no",
                   env=env).check()
    again = launch(root / "again", *TODAY_ARGS, recipe=DPO, config="ddp", mixed_precision="no", env=env).check()
    return first, again


@pytest.mark.distributed
@pytest.mark.slow
def test_pairs_are_tokenized_by_one_process_and_a_relaunch_reuses_them(prepared_twice):
    """Rank 1 never calls the tokenizer and writes no file; rank 0 tokenized the 100 held-out pairs itself (its
    2 workers the 1,900 train pairs) and wrote both files; the relaunch tokenizes nothing, says it reused the pairs
    and trains to the same first loss."""
    first, again = prepared_twice
    calls = first.summary()["tokenizer_calls_in_data_prep_per_rank"]
    assert calls[0] > 0 and calls[1] == 0, calls
    assert first.summary()["data_cache_files_written_per_rank"] == [2, 0]
    assert "(2 tokenizing processes)" in first.output and "pairs prepared in" in first.output
    assert again.summary()["tokenizer_calls_in_data_prep_per_rank"] == [0, 0]
    assert again.summary()["data_cache_files_written_per_rank"] == [0, 0]
    assert "prepared pairs reused from" in again.output
    assert again.metrics()[0]["loss"] == first.metrics()[0]["loss"]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_losses_are_those_of_the_in_memory_pairs_before(prepared_twice):
    first, again = prepared_twice
    for run in (first, again):
        metrics = run.metrics()
        assert [m["loss"] for m in metrics] == pytest.approx(TODAY["loss"], rel=1e-6)
        evals = [m for m in metrics if "eval_loss" in m]
        for key in ("eval_loss", "eval_reward_accuracy"):
            assert [m[key] for m in evals] == pytest.approx(TODAY[key], rel=1e-6), key


@pytest.fixture(scope="module")
def bundled_params() -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    from zero_utils.assets import BUNDLED_MODEL

    return sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BUNDLED_MODEL))
               .parameters())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES_FP32)
def test_step_one_is_ln2_with_zero_rewards_and_the_reference_never_changes(dpo_run, bundled_params, engine):
    """Policy = reference at step 1: every pair's loss is -log sigmoid(0) = ln 2 and every reward 0 (fp32, 2
    processes). The reference's digest equals the policy's starting weights (the recipe checks it) and is the
    same at the end; it holds 4 Psi / 2 bytes per rank under ZeRO-3 and FSDP2 (Psi counted here on the model),
    4 Psi as a replica under DDP and ZeRO-1/2."""
    summary, first = dpo_run(engine).summary(), dpo_run(engine).metrics()[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for key in ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy"):
        assert first[key] == pytest.approx(0.0, abs=1e-7), key
    assert summary["reference_digest_start"] == summary["reference_digest_end"] is not None
    sharded = engine in ("zero3", "fsdp2")
    assert summary["reference_state_bytes_expected"] == (4 * bundled_params // 2 if sharded else 4 * bundled_params)
    assert summary["reference_state_bytes"] == pytest.approx(summary["reference_state_bytes_expected"], rel=0.01)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "zero2", "zero3", "fsdp2", "accumulation"])
def test_engines_train_as_one_process_does(dpo_run, engine):
    """DDP, ZeRO-2, ZeRO-3 and FSDP2 at 2 processes x 4 pairs, and one process x 2 micro-steps of 4, against one
    process x 8 pairs: the same loss and reward margin at every step (the SFT tests' tolerances)."""
    from test_zero_math import LOSS_RTOL

    single = dpo_run(None, world=1, batch=8).metrics()
    run = dpo_run(None, world=1, batch=4, accumulation=2) if engine == "accumulation" else dpo_run(engine)
    for key in ("loss", "reward_margin", "logps_chosen"):
        assert [m[key] for m in run.metrics()] == pytest.approx([m[key] for m in single], rel=LOSS_RTOL, abs=1e-6)
    assert single[-1]["reward_margin"] > 0  # trained: the comparison is not of zeros


@pytest.mark.distributed
@pytest.mark.slow
def test_a_dpo_step_syncs_the_host_once(dpo_run):
    """FSDP2, step 3 (tests/scripts/sync_probe.py): the pairs reach the device without blocking and without a mask
    to read; the step's one host sync is ours, and transformers' packed-rows check runs once per forward (the
    policy's and the reference's)."""
    from conftest import assert_one_host_sync

    assert_one_host_sync(dpo_run("fsdp2"), forwards=2)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_resumed_run_rebuilds_the_reference_and_continues_exactly(runs, dpo_run):
    """FSDP2, resumed from the step-2 checkpoint: the reference is built again (never saved) to the same digest,
    and steps 3-4 repeat the uninterrupted run's loss and rewards."""
    whole = dpo_run("fsdp2")
    resumed = runs("dpo-fsdp2-resumed-at-2", *FOUR_STEPS, "--per_device_batch_size", "4", "--resume",
                   str(whole.output_dir / "checkpoints" / "step_2"), recipe=DPO, config="fsdp2",
                   mixed_precision="no").check()
    assert [m["step"] for m in resumed.metrics()] == [3, 4]
    for key in ("loss", "reward_margin", "reward_chosen"):
        assert [m[key] for m in resumed.metrics()] == pytest.approx([m[key] for m in whole.metrics()[2:]], rel=1e-6)
    assert resumed.summary()["reference_digest_start"] == whole.summary()["reference_digest_start"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(PROBED))
def test_fsdp2_gathers_at_most_two_reference_units_at_once(dpo_run, config):
    """The reference is sharded block by block and every unit resharded after its forward, also under
    fsdp2_zero2.yaml (which keeps the policy's units gathered): the most reference parameters held whole at any
    module's forward is at most two of its largest units (the 1024 x 128 embedding or head), not the model."""
    from transformers import AutoConfig

    from zero_utils.assets import BUNDLED_MODEL

    config_ = AutoConfig.from_pretrained(BUNDLED_MODEL)
    largest_unit = config_.vocab_size * config_.hidden_size + config_.hidden_size  # the head with the final norm
    for probe in dpo_run(config).summary()["reference_probe_per_rank"]:
        assert 0 < probe["max_gathered_params"] <= 2 * largest_unit < probe["total_params"] / 1.5, probe


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_as_shipped_starts_at_ln2(dpo_run):
    """zero3.yaml as shipped (bf16): the reference partitioned in bf16 (2 Psi / N), step 1 within 1e-3 of ln 2."""
    run = dpo_run("zero3", mixed_precision=None)
    assert run.metrics()[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)
    summary = run.summary()
    assert summary["mixed_precision"] == "bf16"
    assert summary["reference_state_bytes"] == pytest.approx(summary["reference_state_bytes_expected"], rel=0.01)
    assert summary["reference_state_bytes_expected"] == -(-2 * summary["num_params"] // 2)


@pytest.fixture(scope="module")
def precomputed_run(runs, session_root):
    """`precomputed_run(config, again=False)`: dpo_run's fp32 twin (same flags) with --reference precomputed. FSDP2
    on the session's datasets cache (its relaunch, `again`, too), ZeRO-3 and DDP each on a cache of their own, so
    each computes its log-probs itself; the same probes as the twins."""
    from conftest import isolated_env

    def get(config, again=False):
        root = session_root if config == "fsdp2" else session_root / f"dpo-precomputed-{config}-cache"
        env = {**isolated_env(root), "ZERO_RECIPES_HARNESS_LIVE_TENSORS": "1",
               "ZERO_RECIPES_HARNESS_REFERENCE_PROBE": "1"}
        return runs(f"dpo-precomputed-{config}{'-again' if again else ''}", *FOUR_STEPS, "--per_device_batch_size",
                    "4", "--gradient_accumulation_steps", "1", "--reference", "precomputed", recipe=DPO,
                    config=config, mixed_precision="no", env=env).check()
    return get


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("config", ["fsdp2", "zero3", "ddp"])
def test_a_precomputed_reference_trains_as_the_held_one(dpo_run, precomputed_run, config):
    """fp32, 2 ranks: the reference's log-probs of every pair computed once before the policy exists train the
    same losses, rewards and final weights as the reference held all run (`--reference model`, dpo_run's twin), to
    the engines' reduction-order tolerances; the pass ran (computed, not reused) and its copy was built from the
    same starting weights (the recipe checks the policy's digest against the one stored with the log-probs)."""
    from safetensors.torch import load_file
    from test_zero_math import LOSS_RTOL, WEIGHT_ATOL

    held, precomputed = dpo_run(config), precomputed_run(config)
    if config == "ddp":  # as before the reference became one object (issue 69)
        assert [m["loss"] for m in precomputed.metrics()] == pytest.approx(PINNED["precomputed"], rel=PIN_RTOL)
    for key in ("loss", "logps_chosen", "logps_rejected"):
        assert [m[key] for m in precomputed.metrics()] == pytest.approx([m[key] for m in held.metrics()],
                                                                      rel=LOSS_RTOL, abs=1e-6), key
    # A reward is beta x (policy - reference log-probs): a small difference of two sums of about -60, whose rounding
    # (1e-6 of the sums after two updates on an AVX512 host: 5e-6 of a reward of 0.033) is the log-probs' own,
    # beta x LOSS_RTOL x |log-probs|; a wrong or shifted reference moves a reward by more than a tenth of it.
    beta = held.summary()["beta"]
    for step, (got, want) in enumerate(zip(precomputed.metrics(), held.metrics(), strict=True), start=1):
        tolerance = beta * LOSS_RTOL * max(abs(want["logps_chosen"]), abs(want["logps_rejected"]))
        for key in ("reward_chosen", "reward_margin"):
            assert got[key] == pytest.approx(want[key], abs=tolerance), (key, step)
    assert held.metrics()[-1]["reward_margin"] > 0  # trained: the comparison is not of zeros
    summary = precomputed.summary()
    assert summary["reference"] == "precomputed" and summary["reference_logps"]["reused"] is False
    assert summary["reference_digest_start"] == held.summary()["reference_digest_start"]
    assert "precomputed in" in precomputed.output and "freed before the policy was built" in precomputed.output
    weights = [load_file(run.output_dir / "final" / "model.safetensors") for run in (held, precomputed)]
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("config", ["fsdp2", "zero3"])
def test_the_precomputed_reference_is_freed_before_training(dpo_run, precomputed_run, config):
    """Weak references to every tensor of the reference (its parameters; FSDP2: their local shards; ZeRO-3: their
    `ds_tensor` partitions), taken when it was built: all dead at the end of step 1 with --reference precomputed, all
    alive with --reference model (the probe sees them). What is alive, a gc walk over the tensors' storages at the
    end of step 1: less by the held reference's expected bytes (4 Psi / 2), less the 8 bytes a pair of log-probs
    kept instead, within 1%."""
    held, precomputed = dpo_run(config).summary(), precomputed_run(config).summary()
    for probe in precomputed["reference_probe_per_rank"]:
        assert probe["tensors"] > 0 and probe["alive_after_step_1"] == 0, probe
    for probe in held["reference_probe_per_rank"]:
        assert probe["alive_after_step_1"] == probe["tensors"] > 0, probe
    freed = held["reference_state_bytes_expected"] - precomputed["reference_state_bytes_expected"]
    assert precomputed["reference_state_bytes_expected"] == 8 * 2000  # 1,900 train + 100 eval pairs
    for with_model, without in zip(held["live_tensor_bytes_per_rank"], precomputed["live_tensor_bytes_per_rank"],
                                   strict=True):
        assert with_model - without == pytest.approx(freed, rel=0.01)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_relaunch_reads_the_precomputed_log_probs(precomputed_run):
    """The same flags launched again on the same datasets cache: the file of log-probs is found by its key and read
    (no pass ran: the reference held nothing), and the run trains exactly as the first did."""
    first, again = precomputed_run("fsdp2"), precomputed_run("fsdp2", again=True)
    stored = first.summary()["reference_logps"]
    found = again.summary()["reference_logps"]
    assert found["reused"] is True and found["path"] == stored["path"] and found["pass_state_bytes"] == 0
    assert "precomputed log-probs of 2000 pairs reused from" in again.output
    assert [m["loss"] for m in again.metrics()] == [m["loss"] for m in first.metrics()]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_default_run_learns_to_prefer_the_chosen_answers(runs):
    """No flags but the output (fsdp2.yaml as shipped: bf16, 2 processes, 150 steps on the bundled pairs): step 1
    within 1e-3 of ln 2, and at the end the held-out pairs are told apart (reward accuracy >= 0.9) with a margin
    grown since the first evaluation."""
    run = runs("dpo-default", "--report_to", "none", recipe=DPO, config="fsdp2", timeout=600).check()
    metrics, summary = run.metrics(), run.summary()
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)
    evals = [m for m in metrics if "eval_reward_accuracy" in m]
    assert summary["eval_reward_accuracy"] >= 0.9, [m["eval_reward_accuracy"] for m in evals]
    assert summary["eval_reward_margin"] > evals[0]["eval_reward_margin"] > 0


@pytest.mark.distributed
@pytest.mark.slow
def test_a_set_without_pairs_and_a_loss_without_its_reference_are_one_sentence(runs):
    from test_bad_input import assert_one_sentence

    from zero_utils.assets import BUNDLED_DATASET

    sft = runs("dpo-bad-columns", *FOUR_STEPS, "--dataset", BUNDLED_DATASET, recipe=DPO, config="ddp", timeout=180)
    assert_one_sentence(sft, "has columns ['messages'] but a preference set needs prompt, chosen and rejected")
    assert sft.stderr.count("but a preference set needs") == 2  # every rank
    no_reference = runs("dpo-no-reference", *FOUR_STEPS, "--reference", "none", recipe=DPO, num_processes=1,
                        timeout=120)
    assert_one_sentence(no_reference, "--loss sigmoid compares the policy with a reference model")


# ---------------------------------------------------------------------------------------------- as users run it
def ultrafeedback_like(path):
    """The bundled pairs in UltraFeedback-binarized's shape, as a local parquet file: a prompt string, chosen and
    rejected as [user, assistant] message lists, and columns the recipe ignores (prompt_id, scores)."""
    import json

    import datasets

    from zero_utils.assets import BUNDLED_PREFERENCES

    rows = [json.loads(line) for line in open(BUNDLED_PREFERENCES)]
    datasets.Dataset.from_list([{
        "prompt": r["prompt"], "prompt_id": f"p{i}", "score_chosen": 9.0, "score_rejected": 3.0,
        **{side: [user(r["prompt"]), assistant(r[side])] for side in ("chosen", "rejected")}}
        for i, r in enumerate(rows)]).to_parquet(path)
    return path


def greedy(model_dir, prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zero_utils.data.sft_examples import render_prompt

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    answers = []
    for prompt in prompts:
        ids = tokenizer(render_prompt(tokenizer, [user(prompt)]), add_special_tokens=False,
                        return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.eval().generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                        pad_token_id=tokenizer.pad_token_id)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return answers


@pytest.fixture(scope="module")
def flow(runs, sft_defaults, session_root):
    """The README's flow: SFT with recipes/llama_zero3.py (fsdp2.yaml as shipped, defaults: conftest's
    `sft_defaults`), then recipes/llama_dpo.py --model <its final/> on a local UltraFeedback-shaped parquet file."""
    sft = sft_defaults
    data = ultrafeedback_like(session_root / "ultrafeedback_like.parquet")
    dpo = runs("flow-dpo", "--model", str(sft.output_dir / "final"), "--dataset", str(data), "--lr", "3e-4",
               "--sft_weight", "1.0", "--report_to", "none", "--max_new_tokens", "0", recipe=DPO, config="fsdp2",
               timeout=600).check()
    return sft, dpo, data


@pytest.mark.distributed
@pytest.mark.slow
def test_sft_then_dpo_answers_held_out_prompts_with_the_chosen_answers(flow):
    """The conversational layout trained (prompt string, message lists, ignored score columns); on the held-out
    pairs (the recipe's own split) the reward accuracy is >= 0.9, and greedy answers to the prompts of the tasks a
    1M-parameter model can learn (capitals, colors, number words, spelling) are their chosen answers more often than
    the SFT model's alone and at least 90% of the time, never the rejected ones. Where the CPU runs bf16 natively the
    SFT model alone gave 90% and DPO passed the earlier bound of 95%; where the same launch runs in fp32 (an AVX2
    host, 2026-12-07) they gave 51 and 56 of 61 (this test's `greedy` on that run's final/ folders)."""
    import datasets

    sft, dpo, data = flow
    summary = dpo.summary()
    assert summary["data"]["layout"] == "preference pairs (conversational)" and summary["data"]["train"]["pairs"] > 0
    assert summary["eval_reward_accuracy"] >= 0.9
    held_out = datasets.load_dataset("parquet", data_files={"train": str(data)})["train"].train_test_split(
        test_size=0.05, seed=42)["test"]  # the recipe's split: --eval_fraction 0.05, --seed 42
    lookups = [r for r in held_out if any(w in r["prompt"] for w in ("capital", "color", "in words", "pell"))]
    answers = greedy(dpo.output_dir / "final", [r["prompt"] for r in lookups])
    sft_answers = greedy(sft.output_dir / "final", [r["prompt"] for r in lookups])
    chosen = [r["chosen"][1]["content"] for r in lookups]
    rejected = [r["rejected"][1]["content"] for r in lookups]
    assert len(lookups) >= 40
    right, right_before = (sum(a == c for a, c in zip(got, chosen, strict=True)) for got in (answers, sft_answers))
    assert right > right_before and right >= 0.9 * len(lookups), (right_before, right, answers)
    assert not any(a == r for a, r in zip(answers, rejected, strict=True))


@pytest.mark.distributed
@pytest.mark.slow
def test_a_resume_with_another_model_is_refused(runs, flow):
    _, dpo, data = flow
    from test_bad_input import assert_one_sentence

    from zero_utils.assets import BUNDLED_MODEL

    run = runs("flow-dpo-resume-other-model", "--resume", str(dpo.output_dir / "checkpoints" / "step_150"),
               "--dataset", str(data), "--report_to", "none", recipe=DPO, config="fsdp2", timeout=180)
    assert_one_sentence(run, f"--model {BUNDLED_MODEL!r} is not the checkpoint's --model", "a resume continues")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("reference", ["model", "precomputed"])
def test_compare_runs_the_dpo_recipe_and_shows_the_reference(session_root, reference):
    """`python -m zero_utils.compare --recipe recipes/llama_dpo.py`: each row has the reference's bytes per rank of
    its mode (a held model: under DDP a whole fp32 replica, 4 Psi; precomputed: its log-probs, 2 float32 per pair)
    and the memory chart stacks them."""
    import subprocess
    import sys

    from conftest import REPO, isolated_env

    config = {"model": "ddp", "precomputed": "fsdp2"}[reference]  # one launch each; every engine: the tests above
    out = session_root / f"compare-dpo-{reference}"
    proc = subprocess.run([sys.executable, "-m", "zero_utils.compare", "--recipe", "recipes/llama_dpo.py",
                           "--configs", config, "--num_processes", "2", "--max_steps", "2",
                           "--mixed_precision", "no", "--output_dir", str(out), "--report_to", "none", "--",
                           "--max_new_tokens", "0", "--eval_every", "0", "--reference", reference], cwd=REPO,
                          env=isolated_env(session_root), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (out / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| config"))
    row = next(line for line in report.splitlines() if line.startswith(f"| {config}"))
    cell = [c.strip() for c in row.split("|")][[c.strip() for c in header.split("|")].index("reference / rank, MB")]
    summary = json.loads((out / f"{config}-2x" / "summary.json").read_text())
    if reference == "model":
        assert cell == f"{4 * summary['num_params'] / 1e6:.2f}" == "3.85"
    else:
        pairs = summary["reference_logps"]["pairs"]
        assert pairs > 1000 and cell == f"{8 * pairs / 1e6:.2f}" == "0.02"
    assert (out / "memory.png").stat().st_size > 10_000


@pytest.mark.distributed
@pytest.mark.slow
def test_the_summary_and_the_tracker_config_keep_their_keys(dpo_run):
    """Issue 71: summary.json and the W&B config of a DPO run hold exactly the keys the recipe wrote itself before
    the bookkeeping moved into the tracker (tests/record_keys.py)."""
    from record_keys import assert_record_keys

    assert_record_keys(dpo_run("ddp"), "llama_dpo")
