"""Inference on a model that may be sharded: every rank runs the same forward passes, so FSDP2 and ZeRO-3 can
gather each layer's parameters from all ranks. Engines: all."""

from __future__ import annotations

import torch

from zero_utils import data, wrapping


def _prompt_ids(tokenizer, prompt: str, device) -> torch.Tensor:
    text = data.render_prompt(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)


@torch.no_grad()
def greedy_answer(model, tokenizer, prompt: str, max_new_tokens: int, device) -> str:
    """The model's greedy answer to one user `prompt`, formatted as in training. Runs exactly `max_new_tokens`
    forward passes on every rank (no early stop), so ranks of a sharded model never wait on each other; the
    answer is cut at the first EOS. Every rank must call it."""
    ids = _prompt_ids(tokenizer, prompt, device)
    prompt_len = ids.shape[1]
    model.eval()
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    wrapping.reshard_after_inference(model)  # [FSDP2] free what generation left gathered
    model.train()
    new = ids[0, prompt_len:].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new, skip_special_tokens=True).strip()


@torch.no_grad()
def last_position_logits(model, tokenizer, prompt: str, device) -> torch.Tensor:
    """fp32 logits [vocab] at the last position of `prompt` (exports are checked against them). Every rank must
    call it."""
    model.eval()
    logits = model(input_ids=_prompt_ids(tokenizer, prompt, device), use_cache=False).logits[0, -1].float().cpu()
    wrapping.reshard_after_inference(model)  # [FSDP2]
    model.train()
    return logits
