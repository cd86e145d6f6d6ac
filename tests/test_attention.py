"""Packed examples stay apart under every attention implementation that runs here, at micro-batch size > 1.

flash_attention_2 cannot load on CPU, so `varlen_probe` (tests/scripts/varlen_probe.py) runs transformers' own
flash-attention path with plain-PyTorch kernels; it reproduces flash-attention's cross-example attention when the
example boundaries do not reach the kernel (`test_probe_reproduces_flash_attention_mixing_examples`)."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from zero_utils.assets import BUNDLED_MODEL
from zero_utils.data import attention, packing, sft_examples
from zero_utils.run.errors import UserError

sys.path.insert(0, str(REPO / "tests" / "scripts"))
import varlen_probe  # noqa: E402

pytestmark = pytest.mark.unit

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France, and Rome is the capital of Italy.",
         "One two three.", "Bread, butter and jam.", "A long sentence about nothing much at all, really.", "Yes."]


@pytest.fixture(scope="module")
def packed_batch():
    """Two packed rows of 64 tokens (several examples each, then padding) and the examples' token ids."""
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    examples = [sft_examples.tokenize_example(tokenizer, text) for text in TEXTS]
    rows, _ = packing.pack_examples(examples, seq_len=64, pad_token_id=tokenizer.pad_token_id)
    assert len(rows) == 2
    batch = {k: torch.tensor([r[k] for r in rows]) for k in ("input_ids", "position_ids")}
    return batch, [ex["input_ids"] for ex in examples], len(tokenizer)


def tiny_llama(vocab_size: int, implementation: str):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM._from_config(config, attn_implementation=implementation).eval()


def logits_of_each_example(model, batch, examples, use_boundaries=True):
    """(packed, alone) logits per example: from the packed micro-batch, and from the example run by itself."""
    path = attention.packing_path(model.config._attn_implementation)
    kwargs = attention.packed_kwargs(batch["position_ids"], path, "cpu") if use_boundaries else {}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                       **kwargs).logits
    out, row, offset = [], 0, 0
    for ids in examples:
        if batch["input_ids"][row, offset:offset + len(ids)].tolist() != ids:  # the example opens the next row
            row, offset = row + 1, 0
        assert batch["input_ids"][row, offset:offset + len(ids)].tolist() == ids
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        out.append((logits[row, offset:offset + len(ids)], alone))
        offset += len(ids)
    return out


@pytest.mark.parametrize("implementation", ["sdpa", "eager", varlen_probe.NAME])
def test_packed_examples_logits_equal_alone_at_batch_two(packed_batch, implementation):
    varlen_probe.install()
    batch, examples, vocab = packed_batch
    model = tiny_llama(vocab, implementation)
    calls_before = dict(varlen_probe.CALLS)
    for packed, alone in logits_of_each_example(model, batch, examples):
        torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
    if implementation == varlen_probe.NAME:  # the packed batch went through the varlen kernel, once per layer
        assert varlen_probe.CALLS["flash_attn_varlen_func"] - calls_before["flash_attn_varlen_func"] >= 2


def test_probe_reproduces_flash_attention_mixing_examples(packed_batch):
    """Without explicit boundaries (position ids alone, as before), flash-attention at batch 2 lets every example
    after the first of a row attend to the examples before it: the probe must show that, or it proves nothing."""
    varlen_probe.install()
    batch, examples, vocab = packed_batch
    model = tiny_llama(vocab, varlen_probe.NAME)
    pairs = logits_of_each_example(model, batch, examples, use_boundaries=False)
    assert torch.allclose(*pairs[0], atol=1e-4)  # the first example of a row sees nothing before it
    assert not torch.allclose(*pairs[1], atol=1e-2)


def test_varlen_boundaries_cover_every_example_and_row():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    kwargs = attention.varlen_kwargs(position_ids)
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 10, 12] and kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 4


def test_a_packed_micro_batch_reaches_the_device_with_no_device_value_read(packed_batch):
    """What a GPU step receives, on the meta device (where reading any value, `nonzero` or `int()`, raises as it
    would make a GPU wait): the varlen offsets are found on the host rows and copied once for queries and keys; the
    micro-batch's tensors all arrive on the device."""
    import datasets

    from zero_utils.data import training as data

    batch, _, _ = packed_batch
    kwargs = attention.packed_kwargs(batch["position_ids"], attention.VARLEN, "meta")
    assert kwargs["cu_seq_lens_q"] is kwargs["cu_seq_lens_k"] and kwargs["cu_seq_lens_q"].device.type == "meta"
    assert kwargs["max_length_q"] == attention.varlen_kwargs(batch["position_ids"])["max_length_q"] > 0
    assert attention.packed_kwargs(batch["position_ids"], attention.BLOCK_MASK, "meta") == {}
    rows = datasets.Dataset.from_dict({**{k: v.tolist() for k, v in batch.items()},
                                       "labels": batch["input_ids"].tolist(), "num_loss_tokens": [64, 64]})
    rows = rows.with_format("torch", columns=["input_ids", "labels", "position_ids"])
    train_data = data.TrainingData(rows, rows, {}, seq_len=64, per_device_batch_size=1, gradient_accumulation_steps=2,
                                   seed=0, attention_path=attention.VARLEN, rank=0, world_size=1,
                                   device=torch.device("meta"))
    for micro in [*train_data.step_batches(1).micro_batches, *train_data.eval_batches()]:
        tensors = [micro.labels, *(v for v in micro.inputs.values() if isinstance(v, torch.Tensor))]
        assert len(tensors) == 5 and {t.device.type for t in tensors} == {"meta"}


def test_unproven_attention_implementation_is_refused():
    assert attention.packing_path("") == attention.packing_path("eager") == attention.BLOCK_MASK
    assert attention.packing_path("flash_attention_2") == attention.VARLEN
    with pytest.raises(UserError, match="--attn_implementation flex_attention is not known to keep packed"):
        attention.packing_path("flex_attention")


def test_cuda_takes_flash_attention_for_packed_rows_when_it_is_installed(monkeypatch):
    """zero_utils.model.loading.choose_attention, with flash-attn's presence mocked (no GPU here): on CUDA in bf16 with
    flash-attn the recipes take flash_attention_2 (its varlen kernel keeps packed examples apart) and say so; without
    it, or in fp32, sdpa stays and one line says packed rows run SDPA's masked kernel; a flag given, or the CPU,
    change nothing and print nothing."""
    import transformers.utils

    from zero_utils.data.attention import VARLEN, packing_path
    from zero_utils.model.loading import FLASH, choose_attention

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    chosen, line = choose_attention("", cuda, "bf16")
    assert chosen == FLASH and packing_path(chosen) == VARLEN
    assert line.startswith("attention: flash_attention_2 (flash-attn is installed, compute in bf16)")
    assert choose_attention("sdpa", cuda, "bf16") == ("sdpa", "") and choose_attention("", cpu, "bf16") == ("", "")
    chosen, line = choose_attention("", cuda, "no")
    assert chosen == "" and "masked kernel" in line and "flash-attn runs in bf16/fp16 only" in line
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    chosen, line = choose_attention("", cuda, "bf16")
    assert chosen == "" and "pip install flash-attn" in line
