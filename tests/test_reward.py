"""The reward model (issue 73, in progress): its Bradley-Terry loss and pairwise accuracy by hand, in process."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("margin, center", [(None, 0.0), ((0.5, -1.0), 0.0), (None, 0.01), ((0.5, -1.0), 0.01)])
def test_the_loss_of_two_pairs_by_hand(margin, center):
    """Scores (1.5, -0.5) chosen and (0.25, 0.75) rejected: per pair -log(1 / (1 + e^-(r_c - r_r - m))) + c (r_c +
    r_r)^2, written out with Python's math, equals the function to 1e-6, with the margin and the centering on and
    off; the accuracy counts the first pair only (1.5 > 0.25, -0.5 < 0.75) and a tie as wrong."""
    import torch

    from zero_utils.preference.reward import pairwise_accuracy, reward_pair_losses

    chosen, rejected = (1.5, -0.5), (0.25, 0.75)
    margins = margin or (0.0, 0.0)
    by_hand = [math.log(1 + math.exp(-(c - r - m))) + center * (c + r) ** 2
               for c, r, m in zip(chosen, rejected, margins, strict=True)]
    got = reward_pair_losses(torch.tensor(chosen).unsqueeze(1), torch.tensor(rejected).unsqueeze(1),
                             margin=torch.tensor(margin) if margin else None, center_coefficient=center)
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx(by_hand, abs=1e-6)
    assert pairwise_accuracy(torch.tensor(chosen), torch.tensor(rejected)).tolist() == [1.0, 0.0]
    assert pairwise_accuracy(torch.tensor([2.0]), torch.tensor([2.0])).tolist() == [0.0]


def test_a_causal_lm_checkpoint_becomes_a_reward_model(tmp_path):
    """A tiny Llama saved with its weights, loaded with `load_causal_lm(..., reward_pad_token_id=...)`: a
    LlamaForSequenceClassification with one output whose every decoder tensor is the checkpoint's own (read back
    from its safetensors file, not from the loader), the output head left out and the score head (hidden x 1) the
    only new tensor; the pad id in its config; a config-only folder draws it from the seed, the same twice."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from zero_utils.model.loading import load_causal_lm

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "lm")
    saved = load_file(tmp_path / "lm" / "model.safetensors")
    reward = load_causal_lm(str(tmp_path / "lm"), reward_pad_token_id=3)
    state = reward.state_dict()
    assert type(reward).__name__ == "LlamaForSequenceClassification" and reward.config.pad_token_id == 3
    loaded = [name for name in saved if name in state and torch.equal(saved[name], state[name])]
    assert len(loaded) == len(saved) - 1 and "lm_head.weight" not in state  # all but the output head
    assert sorted(set(state) - set(saved)) == ["score.weight"] and state["score.weight"].shape == (1, 32)
    config.save_pretrained(tmp_path / "config-only")
    torch.manual_seed(1)
    first = load_causal_lm(str(tmp_path / "config-only"), reward_pad_token_id=3).state_dict()
    torch.manual_seed(1)
    again = load_causal_lm(str(tmp_path / "config-only"), reward_pad_token_id=3).state_dict()
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert "score.weight" in first
