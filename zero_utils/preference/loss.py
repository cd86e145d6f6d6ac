"""Preference losses of a batch of (chosen, rejected) answer pairs, from each answer's log-probabilities: per pair
a loss, the implicit rewards, and what is logged. Pure tensor arithmetic, the same under every engine.

    loss     log-probs of an answer                     per-pair loss (r = reference, p = policy)
    sigmoid  summed over its tokens                     -log sigmoid(beta * ((p_c - r_c) - (p_r - r_r)))
             (DPO: Rafailov et al. 2023, "Direct Preference Optimization", eq. 7)
    ipo      averaged over its tokens (as trl does;     ((p_c - r_c) - (p_r - r_r) - 1 / (2 beta))^2
             Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences",
             eq. 17, sums them)
    simpo    averaged over its tokens, no reference     -log sigmoid(beta * (p_c - p_r) - gamma)
             (Meng et al. 2024, "SimPO", eq. 6; its preprint uses beta 2.0 or 2.5 and the target margin gamma
             = 0.5 beta for the base models: princeton-nlp/SimPO's training configs, so beta 2.0, gamma 1.0)

Rewards: beta * (p - r) of each answer (beta * p for simpo, whose reward is the length-normalised log-prob).
`--sft_weight w` adds w x the chosen answers' negative log-likelihood per token (as RPO, Pang et al. 2024, and
trl's `rpo_alpha`), averaged over the chosen answer tokens of the whole global batch. Units: nats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zero_utils.run.errors import UserError

LOSSES = ("sigmoid", "ipo", "simpo")
REFERENCE_FREE = ("simpo",)
DEFAULT_BETA = {"sigmoid": 0.1, "ipo": 0.1, "simpo": 2.0}
SIMPO_GAMMA = 1.0


def resolve(loss: str, beta: float, reference: str, *, lora: bool = False) -> tuple[float, str]:
    """(beta, the reference: 'model', 'precomputed' or 'none') from the flags: `beta` 0 takes the loss's default
    (DEFAULT_BETA); `reference` '' takes the loss's own ('model' for sigmoid and ipo, 'none' for simpo). A
    reference-based loss without a reference, simpo with one, or a precomputed reference for a LoRA policy (whose
    reference, the base with its adapters off, holds nothing: `lora`) is a `UserError`."""
    if reference not in ("", "model", "precomputed", "none"):
        raise UserError(f"--reference {reference!r} is unknown; use model, precomputed or none.")
    wants = loss not in REFERENCE_FREE
    if reference == "none" and wants:
        raise UserError(f"--loss {loss} compares the policy with a reference model: drop --reference none, or use "
                        "the reference-free --loss simpo.")
    if reference in ("model", "precomputed") and not wants:
        raise UserError(f"--loss {loss} is reference-free: drop --reference {reference}, or use --loss sigmoid or "
                        "ipo.")
    if reference == "precomputed" and lora:
        raise UserError("--reference precomputed frees a frozen copy of the model, but this recipe's reference is the "
                        "base with its adapters off and holds no memory: drop --reference precomputed.")
    return (beta or DEFAULT_BETA[loss]), (reference or "model") if wants else "none"


# --lr when it is not given: the bundled model learns its preferences from random weights at this rate; pretrained
# weights it destroys within a few steps (alignment-handbook's zephyr DPO: 5e-7; trl's DPOTrainer default: 1e-6).
CONFIG_ONLY_LR = 1e-3


def learning_rate(lr: float | None, model: str) -> float:
    """--lr as given; when it is not (None): CONFIG_ONLY_LR for a model with only a config, such as the bundled one,
    and a `UserError` for pretrained weights, whose rate must be chosen (DPO of a pretrained model takes 1e-7 to 1e-6,
    about 1000x less)."""
    from zero_utils.model.loading import has_pretrained_weights

    if lr is not None:
        return lr
    if has_pretrained_weights(model):
        raise UserError(f"--lr is not given, and its default {CONFIG_ONLY_LR:g} (for the bundled model's random "
                        f"weights) would destroy the pretrained weights of --model {model} within a few steps: pass "
                        "--lr, e.g. 5e-7 as presets/zephyr-7b-dpo-full.yaml does.")
    return CONFIG_ONLY_LR


def averages_log_probs(loss: str) -> bool:
    """Whether `loss` scores an answer by its mean token log-prob (ipo, simpo) rather than the sum (sigmoid)."""
    return loss in ("ipo", "simpo")


@dataclass
class PairScores:
    """Per-pair results, each of shape (pairs,): `losses` (nats), `chosen_rewards`, `rejected_rewards`,
    `chosen_logps`, `rejected_logps` (the policy's answer log-probs as the loss scores them)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor

    def sums(self, weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Sums over the pairs (detached; each pair times its weight if given: 0 for eval filler pairs), to be
        reduced over ranks and divided by the pair count: loss, reward_chosen, reward_rejected, reward_margin,
        reward_accuracy (the share of pairs whose chosen reward is higher), logps_chosen, logps_rejected."""
        margin = self.chosen_rewards - self.rejected_rewards
        weights = torch.ones_like(margin) if weights is None else weights
        return {k: (v.detach() * weights).sum() for k, v in (
            ("loss", self.losses), ("reward_chosen", self.chosen_rewards), ("reward_rejected", self.rejected_rewards),
            ("reward_margin", margin), ("reward_accuracy", (margin > 0).float()),
            ("logps_chosen", self.chosen_logps), ("logps_rejected", self.rejected_logps))}


def answer_log_probs(token_log_probs: torch.Tensor, answer_mask: torch.Tensor, average: bool) -> torch.Tensor:
    """Each row's answer log-probability: the sum of `token_log_probs` (rows, seq_len) where `answer_mask` is true,
    or with `average` their mean over the row's answer tokens. Returns (rows,)."""
    summed = (token_log_probs * answer_mask).sum(-1)
    return summed / answer_mask.sum(-1).clamp(min=1) if average else summed


def pair_scores(loss: str, beta: float, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                reference_chosen: torch.Tensor | None = None, reference_rejected: torch.Tensor | None = None,
                simpo_gamma: float = SIMPO_GAMMA) -> PairScores:
    """The per-pair loss and rewards of `loss` (module table) from answer log-probs of shape (pairs,), summed or
    averaged as `averages_log_probs(loss)` says. Reference log-probs are required except for simpo."""
    if loss not in LOSSES:
        raise ValueError(f"unknown preference loss {loss!r}")
    if loss == "simpo":
        chosen_rewards, rejected_rewards = beta * policy_chosen, beta * policy_rejected
        losses = -F.logsigmoid(beta * (policy_chosen - policy_rejected) - simpo_gamma)
    else:
        chosen_ratio, rejected_ratio = policy_chosen - reference_chosen, policy_rejected - reference_rejected
        chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
        difference = chosen_ratio - rejected_ratio
        losses = -F.logsigmoid(beta * difference) if loss == "sigmoid" else (difference - 1 / (2 * beta)) ** 2
    return PairScores(losses, chosen_rewards.detach(), rejected_rewards.detach(), policy_chosen.detach(),
                      policy_rejected.detach())


def objective_sum(scores: PairScores, chosen_nll: torch.Tensor, *, sft_weight: float, global_pairs: int,
                  global_chosen_tokens: int) -> torch.Tensor:
    """This micro-batch's share of the step's objective, as a sum whose total over the global batch divided by
    `global_pairs` is the step's loss: the mean pair loss, plus `sft_weight` x the chosen answers' NLL per chosen
    answer token of the whole global batch (`chosen_nll`: this micro-batch's summed chosen-token NLL)."""
    return scores.losses.sum() + sft_weight * chosen_nll * global_pairs / max(global_chosen_tokens, 1)
