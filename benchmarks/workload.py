"""The workload that benchmarks/plain_loop.py and benchmarks/trainer_baseline.py run next to the recipe, defined
once so the candidates cannot drift apart: the flags (the recipe's names and defaults), the loss, and how a run's
step times become its tokens/s."""

import argparse
import statistics

import torch
import torch.nn.functional as F

from zero_utils.data import sft_examples


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=10)
    p.add_argument("--untimed_steps", type=int, default=4, help="first steps left out of the median (setup)")
    p.add_argument("--per_device_batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=42)
    return p


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The recipe's loss before its division by the global answer-token count: labels are already shifted by
    zero_utils.data.sft_examples, so there is no shift here."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=sft_examples.IGNORE_INDEX,
                           reduction="sum")


def tokens_per_s(step_times_s: list[float], tokens_per_step: int, untimed_steps: int) -> float:
    """Global tokens per step / the median step time after the first `untimed_steps` steps."""
    return tokens_per_step / statistics.median(step_times_s[untimed_steps:] or step_times_s)
