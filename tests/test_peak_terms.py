"""The terms real shapes add to the estimate (zero_utils.formulas.peak_terms), in process: each by hand at an 8B Llama-3
shape; the block mask and repeated K/V against what autograd saves for a packed micro-batch beyond an unpacked one
(sdpa); the loss backward against the bytes live during a chunked loss's backward; the CUDA capacity rule on a mocked
`mem_get_info`; and the fit check's line and summary naming each term."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import LlamaConfig, LlamaForCausalLM

from zero_utils.formulas.model_states import architecture_from_sizes
from zero_utils.formulas.peak_terms import LOSS_BACKWARD_BYTES, peak_terms
from zero_utils.run.engine import Engine
from zero_utils.train.measurement import count_saved_activations
from zero_utils.train.token_loss import chunked_cross_entropy

pytestmark = pytest.mark.unit

# Llama-3-8B: h 4096, 32 layers, 32 query heads, 8 K/V heads (head dim 128: K/V width 1024), vocab 128256.
PSI, H, L, V, FFN = 8_000_000_000, 4096, 32, 128_256, 14_336
ARCH = architecture_from_sizes(PSI, hidden_size=H, num_layers=L, vocab_size=V, intermediate_size=FFN, num_heads=32,
                               num_kv_heads=8)
B, S = 4, 4096


def terms(engine: str, **kwargs) -> dict:
    settings = {"seq_len": S, "micro_batch_size": B, "dtype": "bf16", "activation_checkpointing": False,
                "attention": "sdpa", "packed_rows": True, "loss_chunk_tokens": 1024, **kwargs}
    return peak_terms(Engine.parse(engine), ARCH, **settings)


def test_each_term_by_hand_at_8b():
    """micro-batch 4 x 4096 tokens in bf16. Block mask: the bool (4, 1, 4096, 4096) mask, 67 MB, and in each of 32
    layers its bf16 copy (134 MB) and K and V repeated from 1024 to 4096 wide (2 x 2 bytes x 4 x 4096 x 3072 =
    201 MB): 10.8 GB. Loss backward: 12 - (2 + 4) bytes x 1024 tokens x 128256 = 788 MB. FSDP2: the 525M-parameter
    embedding's fp32 reduce-scatter input, 2.1 GB. DDP: bf16 copies of every matmul weight (all but the embedding
    and the 65 norm vectors), 15 GB."""
    mask = B * S * S * 1 + L * (B * S * S * 2 + 2 * 2 * B * S * (H - 1024))
    loss = (12 - 6) * 1024 * V
    assert round(mask / 1e9, 1) == 10.8 and round(loss / 1e6) == 788
    assert terms("zero3") == {"block_mask": mask, "loss_backward": loss, "fp32_reduce_scatter": 0,
                              "autocast_copies": 0, "sp_all_to_all": 0}  # no sequence parallelism
    assert terms("fsdp2")["fp32_reduce_scatter"] == 4 * V * H  # 2.1 GB
    assert terms("ddp")["autocast_copies"] == 2 * (PSI - V * H - (2 * L + 1) * H)
    # one layer's copies with checkpointing (autocast: the trainable weights' cache); fp32: 4-byte copies, 4 bytes of
    # loss backward, nothing to reduce in another dtype and no autocast
    checkpointed = terms("ddp", activation_checkpointing=True, )
    assert checkpointed["block_mask"] == B * S * S * 1 + B * S * S * 2 + 2 * 2 * B * S * (H - 1024)
    assert terms("ddp", activation_checkpointing=True, dtype="bf16")["autocast_copies"] == \
        checkpointed["autocast_copies"] == 2 * (PSI - V * H - (2 * L + 1) * H)
    assert terms("fsdp2", dtype="fp32") == {
        "block_mask": B * S * S + L * (4 * B * S * S + 2 * 4 * B * S * (H - 1024)),
        "loss_backward": (12 - 8) * 1024 * V, "fp32_reduce_scatter": 0, "autocast_copies": 0, "sp_all_to_all": 0}
    # no mask: padded rows (DPO), flash-attention's varlen offsets, eager (its mask exists packed or not)
    for kwargs in ({"packed_rows": False}, {"attention": "flash"}, {"attention": "eager"}):
        assert terms("fsdp2", **kwargs)["block_mask"] == 0, kwargs
    assert terms("ddp", loss_chunk_tokens=0)["loss_backward"] == (12 - 6) * B * S * V  # the whole logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_block_mask_term_is_what_a_packed_micro_batch_saves_beyond_an_unpacked_one(dtype):
    """A grouped-query Llama (4 query heads, 2 K/V heads) under sdpa, 2 rows of 256 tokens: autograd saves more for
    the packed rows (two examples a row) than for the same rows unpacked, by the block-mask term within 20%."""
    torch.manual_seed(0)
    h, layers, s, b = 256, 2, 256, 2
    config = LlamaConfig(vocab_size=1000, hidden_size=h, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(dtype)
    ids = torch.randint(0, 1000, (b, s))
    saved = {}
    for name, positions in (("unpacked", torch.arange(s)), ("packed", torch.arange(s // 2).repeat(2))):
        result = {}
        with count_saved_activations(result):
            model.model(input_ids=ids, position_ids=positions.repeat(b, 1), use_cache=False)
        saved[name] = result["saved"]
    arch = architecture_from_sizes(sum(p.numel() for p in model.parameters()), hidden_size=h, num_layers=layers,
                                   vocab_size=1000, intermediate_size=512, num_heads=4, num_kv_heads=2)
    term = peak_terms(Engine.parse("single"), arch, seq_len=s, micro_batch_size=b,
                      dtype="fp32" if dtype == torch.float32 else "bf16", activation_checkpointing=False,
                      attention="sdpa", packed_rows=True, loss_chunk_tokens=0)["block_mask"]
    assert saved["packed"] - saved["unpacked"] == pytest.approx(term, rel=0.2)


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensors made inside the mode alive at once (each counted from its op's output until the
    tensor is freed)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages: set[int] = set()  # data pointers counted and not yet freed (in-place ops return them again)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor._is_view():
                storage = tensor.untyped_storage()
                if storage.data_ptr() in self.storages:
                    continue
                self.storages.add(storage.data_ptr())
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._free, storage.data_ptr(), storage.nbytes())
        return out

    def _free(self, pointer, nbytes):
        self.storages.discard(pointer)
        self.live -= nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_backward_term_is_what_a_chunks_backward_holds(dtype):
    """The chunked loss's backward (zero_utils.train.token_loss) over 1024 tokens of an 8000-word head, with 128- and
    256-token chunks: the peak of the bytes live in the backward grows with the chunk by the estimate's logits
    (e + 4 bytes per token and vocabulary entry) plus the loss-backward term, within 20%."""
    torch.manual_seed(0)
    hidden_size, vocab, tokens = 64, 8000, 1024
    head = torch.nn.Linear(hidden_size, vocab, bias=False).to(dtype)
    labels = torch.randint(0, vocab, (1, tokens))
    peaks = {}
    for chunk in (128, 256):
        hidden = torch.randn(1, tokens, hidden_size, dtype=dtype, requires_grad=True)
        loss = chunked_cross_entropy(head, hidden, labels, chunk, -100).sum()
        with LiveBytes() as probe:
            loss.backward()
        peaks[chunk] = probe.peak
    arch = architecture_from_sizes(vocab * hidden_size * 3, hidden_size=hidden_size, num_layers=1, vocab_size=vocab)
    e = 4 if dtype == torch.float32 else 2

    def estimated(chunk):  # the activations' logits of one chunk + the term
        return (e + 4) * chunk * vocab + peak_terms(
            Engine.parse("single"), arch, seq_len=tokens, micro_batch_size=1, dtype="fp32" if e == 4 else "bf16",
            activation_checkpointing=False, attention="sdpa", packed_rows=False, loss_chunk_tokens=chunk)[
            "loss_backward"]

    assert estimated(256) - estimated(128) == LOSS_BACKWARD_BYTES * 128 * vocab
    assert peaks[256] - peaks[128] == pytest.approx(estimated(256) - estimated(128), rel=0.2)


def test_on_cuda_the_capacity_is_what_this_process_can_have(monkeypatch):
    """min(total, free + reserved by this process): another process's 30 GB are not free; this process's own 6 GB
    held by its allocator are; never more than the device."""
    from zero_utils.memory import fit_check

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    for free, reserved, want in ((50 * gib, 0, 50 * gib), (44 * gib, 6 * gib, 50 * gib), (79 * gib, 6 * gib, 80 * gib)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, 80 * gib))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None, reserved=reserved: reserved)
        capacity, source = fit_check.device_capacity(torch.device("cuda", 0), 8)
        assert capacity == want and source.startswith("NVIDIA H100: ") and "of 85.90 GB" in source


def test_the_fit_check_prints_each_term_and_keeps_it():
    """The bundled model, one process, fp32, packed rows under sdpa: the line names the block mask and the loss
    backward (no autocast in fp32, no FSDP2); summary.json's fit_check keeps every term; padded rows (the DPO
    recipes) have no block mask."""
    from test_fit_check import check_bundled

    check, printed = check_bundled(device_memory="1TB")
    kept = check.summary()["fit_check"]
    assert kept["block_mask_bytes"] > 0 and kept["loss_backward_bytes"] > 0
    assert kept["fp32_reduce_scatter_bytes"] == kept["autocast_copies_bytes"] == 0
    assert " + block mask " in printed[0] and " + loss backward " in printed[0] and "autocast" not in printed[0]
    padded, printed = check_bundled(device_memory="1TB", packed_rows=False)
    assert padded.summary()["fit_check"]["block_mask_bytes"] == 0 and "block mask" not in printed[0]
    assert padded.verdict.total_bytes == check.verdict.total_bytes - kept["block_mask_bytes"]
