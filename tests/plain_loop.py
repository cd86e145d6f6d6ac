"""An independent reference for the recipes' training: a plain PyTorch loop, written here, over the same packed rows.

transformers' model called as a user would (`input_ids`, `position_ids`, whole logits), torch's AdamW with the
recipe's two groups (matrices decayed, vectors not), mean token cross-entropy over the global batch, clipping by
the gradient norm (summed in fp64), and the README's schedule written out again: linear warmup, then cosine down to
10% of the peak.
Only the rows and their order are read through zero_utils, so a bug every engine shares shows against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace


@dataclass(frozen=True)
class Hyper:
    """The run's settings; `flags()` gives them as the recipe's command line."""
    steps: int
    global_batch: int
    lr: float = 2e-3
    warmup: int = 1
    clip: float = 0.5
    weight_decay: float = 0.1
    seq_len: int = 64
    seed: int = 42

    def flags(self) -> tuple[str, ...]:
        return ("--max_steps", str(self.steps), "--lr", str(self.lr), "--warmup_steps", str(self.warmup),
                "--max_grad_norm", str(self.clip), "--weight_decay", str(self.weight_decay), "--seq_len",
                str(self.seq_len), "--seed", str(self.seed), "--eval_fraction", "0", "--max_new_tokens", "0",
                "--report_to", "none")

    def lr_at_step(self, step: int) -> float:
        if step <= self.warmup:
            return self.lr * step / self.warmup
        progress = (step - self.warmup) / (self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def bundled_rows(model_dir: str, model, seq_len: int, seed: int, eval_fraction: float, cache_root: Path):
    """(train, eval) packed rows of the bundled SFT data as a recipe prepares them for `model` with `model_dir`'s
    tokenizer (eval None when `eval_fraction` is 0)."""
    from transformers import AutoTokenizer

    from zero_utils.assets import BUNDLED_DATASET
    from zero_utils.data import training as data
    from zero_utils.data.preparation import prepare
    from zero_utils.data.sft_rows import SFTRows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_token_id = data.pad_token_id_within(tokenizer, model.get_input_embeddings().num_embeddings)
    train_rows, eval_rows, _ = prepare(SimpleNamespace(is_main_process=True, num_processes=1), tokenizer,
                                       BUNDLED_DATASET, SFTRows(seq_len, pad_token_id), eval_fraction=eval_fraction,
                                       seed=seed, cache_root=cache_root)
    return train_rows, eval_rows


def mean_token_loss(model, rows, batch_rows: int = 16) -> float:
    """The mean cross-entropy over every answer token of `rows` (a recipe's eval loss), whole logits, fp32."""
    import torch
    import torch.nn.functional as F

    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(rows), batch_rows):
            batch = rows[start:start + batch_rows]
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            labels = batch["labels"].flatten()
            total += F.cross_entropy(logits.flatten(0, 1).float(), labels, ignore_index=-100, reduction="sum").item()
            tokens += int((labels != -100).sum())
    return total / tokens


def train(model_dir: str, hyper: Hyper, cache_root: Path):
    """Train the fp32 model in `model_dir` for `hyper.steps` steps of the bundled data; returns (losses, gradient
    norms before clipping, the trained model). A folder with only a config starts from random weights drawn right
    after seeding with `hyper.seed`, as the recipes document for it (zero_utils.model.loading.load_causal_lm)."""
    import torch
    import torch.nn.functional as F
    from accelerate.utils import set_seed
    from transformers import AutoConfig, AutoModelForCausalLM

    from zero_utils.data import training as data

    if list(Path(model_dir).glob("*.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        set_seed(hyper.seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model.train()
    rows, _ = bundled_rows(model_dir, model, hyper.seq_len, hyper.seed, 0.0, cache_root)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": hyper.weight_decay},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=hyper.lr, betas=(0.9, 0.95), eps=1e-8)
    losses, grad_norms = [], []
    for step in range(1, hyper.steps + 1):
        batch = rows[data.global_batch_indices(len(rows), hyper.global_batch, step, hyper.seed)]
        for group in optimizer.param_groups:
            group["lr"] = hyper.lr_at_step(step)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        # torch's clip_grad_norm_, with the norm summed in fp64: in fp32 a 2M-element embedding's is 1e-5 off
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in params]))
        for p in params:
            p.grad.mul_(torch.clamp(hyper.clip / (norm + 1e-6), max=1.0).float())
        grad_norms.append(norm.item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grad_norms, model


def assert_trains_as(run, plain, weights: str = "final/model.safetensors") -> None:
    """A recipe run (`conftest.Run`, fp32) trained as the plain loop did (`train`'s result): losses, gradient norms
    and final weights within 1e-4 (another reduction order across ranks: tests/test_zero_math.py's tolerances), the
    step-1 gradient norm, from the same weights, within 1e-6. A lost or double-counted chunk, block or rank moves
    them by percents."""
    import pytest
    import torch
    from safetensors.torch import load_file

    losses, grad_norms, model = plain
    metrics = run.metrics()
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-4)
    assert metrics[0]["grad_norm"] == pytest.approx(grad_norms[0], rel=1e-6)
    assert [m["grad_norm"] for m in metrics] == pytest.approx(grad_norms, rel=1e-4)
    exported = load_file(run.output_dir / weights)
    for name, param in model.named_parameters():
        torch.testing.assert_close(exported[name], param.detach(), rtol=0, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
