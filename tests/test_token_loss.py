"""The chunked output head and loss in process (zero_utils.train.token_loss): equal to the whole logits' cross-entropy,
in value and gradient, with tied and untied heads; a model whose logits are not its head's output (Gemma 2's
soft-capping) takes the unchunked path with one line. The engines' launches:
tests/test_zero_math.py, tests/test_wrapping.py and tests/test_lora.py (test_*chunked*)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

from zero_utils.train.token_loss import TokenLosses, logits_are_head_output

IGNORE = -100
ROWS, SEQ = 2, 33  # 66 tokens: chunks of 40 leave a remainder


def _accelerator(printed: list[str]):
    return SimpleNamespace(unwrap_model=lambda m: m, device=torch.device("cpu"), print=printed.append)


def _llama(tied: bool):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _micro(vocab: int):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (ROWS, SEQ), generator=generator)
    labels = torch.randint(0, vocab, (ROWS, SEQ), generator=generator)
    labels[:, :5] = IGNORE  # prompt tokens
    return SimpleNamespace(inputs={"input_ids": input_ids, "use_cache": False}, labels=labels)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_losses_and_gradients_equal_the_whole_logits(tied):
    micro = _micro(300)
    reference = _llama(tied)
    logits = reference(**micro.inputs).logits
    expected = F.cross_entropy(logits.float().flatten(0, 1), micro.labels.flatten(), ignore_index=IGNORE,
                               reduction="none").view_as(micro.labels)
    expected.sum().backward()

    model, printed = _llama(tied), []
    token_losses = TokenLosses(model, 40, IGNORE, _accelerator(printed))
    assert token_losses.chunk_tokens == 40 and printed == []
    losses = token_losses(model, micro)
    assert losses.dtype == torch.float32 and losses.shape == (ROWS, SEQ)
    assert torch.all(losses[:, :5] == 0)
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-7)
    losses.sum().backward()
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():  # the head's gradient sums its tokens in two matmuls: 1e-5
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # without labels the head is the head again: generation gets logits
    assert model(**micro.inputs).logits.shape == (ROWS, SEQ, 300)
    with torch.no_grad():  # eval: the same chunks, no checkpointing
        torch.testing.assert_close(token_losses(model, micro), expected.detach(), rtol=1e-6, atol=1e-7)


def test_a_soft_capped_model_takes_the_unchunked_path_with_one_line():
    torch.manual_seed(0)
    gemma = AutoModelForCausalLM.from_config(Gemma2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, final_logit_softcapping=30.0), dtype=torch.float32)
    assert not logits_are_head_output(gemma, gemma.get_output_embeddings(), torch.device("cpu"))
    printed = []
    token_losses = TokenLosses(gemma, 40, IGNORE, _accelerator(printed))
    assert token_losses.chunk_tokens == 0
    assert len(printed) == 1 and "--loss_chunk_tokens 40" in printed[0] and "whole logits" in printed[0]
    micro = _micro(300)
    expected = F.cross_entropy(gemma(**micro.inputs).logits.float().flatten(0, 1), micro.labels.flatten(),
                               ignore_index=IGNORE, reduction="none").view_as(micro.labels)
    torch.testing.assert_close(token_losses(gemma, micro), expected)
    # a Llama passes the same check, and chunk 0 means the whole logits without asking
    llama = _llama(tied=False)
    assert logits_are_head_output(llama, llama.get_output_embeddings(), torch.device("cpu"))
    assert TokenLosses(llama, 0, IGNORE, _accelerator(printed)).chunk_tokens == 0 and len(printed) == 1
