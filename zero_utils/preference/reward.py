"""A reward model's loss on preference pairs (for the reward-model recipe of issue 73): the Bradley-Terry model of
which answer is preferred, on the scalar scores a sequence-classification model gives each answer (its score at the
answer's last non-padding token). Pure tensor arithmetic, the same under every engine.

    per pair   -log sigmoid(r_c - r_r - m)  +  c (r_c + r_r)^2

r_c, r_r: the chosen and rejected answers' scores. The first term is the Bradley-Terry negative log-likelihood
(Bradley & Terry 1952; as the InstructGPT reward model trains it: Ouyang et al. 2022, eq. 1); m: a per-pair margin
from the data (Llama 2's reward models: Touvron et al. 2023, eq. 2; trl's `margin` column), 0 without one; c: the
centering coefficient, which pulls each pair's mean score towards 0 so rewards stay comparable across prompts
(Eisenstein et al. 2023, "Helping or Herding?"; trl's `center_rewards_coefficient`). trl's RewardTrainer takes the
mean over the batch of both terms; summed per pair here, the recipe divides by the global batch's pairs, as the DPO
recipe does. Units: nats (scores are logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reward_pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, *, margin: torch.Tensor | None = None,
                       center_coefficient: float = 0.0) -> torch.Tensor:
    """Each pair's loss (module docstring), fp32 [pairs], from the answers' scores `chosen` and `rejected` [pairs]
    (a model's [pairs, 1] output too), `margin` [pairs] or None, `center_coefficient` c >= 0."""
    chosen, rejected = chosen.float().reshape(-1), rejected.float().reshape(-1)
    difference = chosen - rejected - (margin.float().reshape(-1) if margin is not None else 0.0)
    losses = -F.logsigmoid(difference)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return losses


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """1.0 for each pair whose chosen answer scores strictly higher than the rejected one, else 0.0 (a tie is not
    a preference), fp32 [pairs]: their mean is the eval's pairwise accuracy."""
    return (chosen.float().reshape(-1) > rejected.float().reshape(-1)).float()
