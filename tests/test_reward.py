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
