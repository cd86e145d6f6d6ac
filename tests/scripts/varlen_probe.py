"""A flash-attention stand-in for CPU: transformers' own flash-attention path with plain-PyTorch kernels.

`install()` registers the attention implementation `varlen_probe` the way a flash-attention kernel is registered:
transformers' real `flash_attention_forward` through `AttentionInterface`, with `flash_attention_mask` through
`AttentionMaskInterface` (an unregistered name gets no mask at all). Only the two kernels are replaced, by exact
PyTorch equivalents of flash-attn's `flash_attn_func` (causal within each row) and `flash_attn_varlen_func`
(causal within each cu_seqlens segment of the flattened tokens), so a model under `varlen_probe` computes what
it would under flash_attention_2 on a GPU, including attending across examples when no boundaries reach it.
Each kernel call checks what a real varlen kernel requires (int32 offsets from 0 to the token count, the longest
segment as max_seqlen) and is counted in `CALLS` (and appended to the file `ZERO_RECIPES_PROBE_LOG` names).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

NAME = "varlen_probe"
CALLS = {"flash_attn_func": 0, "flash_attn_varlen_func": 0}


def _record(kind: str) -> None:
    CALLS[kind] += 1
    log = os.environ.get("ZERO_RECIPES_PROBE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(kind + "\n")


def _attend(q, k, v, softmax_scale, causal):
    """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D], grouped-query heads repeated as flash-attn does."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=causal, scale=softmax_scale)
    return out.transpose(0, 1)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """[B, S, H, D] in and out: each row is one sequence."""
    assert dropout_p == 0.0 and window_size == (-1, -1)
    _record("flash_attn_func")
    return torch.stack([_attend(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """[T, H, D] in and out: segment i is tokens cu_seqlens[i]:cu_seqlens[i+1]."""
    assert dropout_p == 0.0 and window_size == (-1, -1)
    for cu, max_seqlen, x in ((cu_seqlens_q, max_seqlen_q, q), (cu_seqlens_k, max_seqlen_k, k)):
        assert cu.dtype == torch.int32, f"flash-attn needs int32 cu_seqlens, got {cu.dtype}"
        assert cu.dim() == 1 and int(cu[0]) == 0 and int(cu[-1]) == x.shape[0], (cu, x.shape)
        lengths = cu[1:] - cu[:-1]
        assert bool((lengths > 0).all()) and int(max_seqlen) == int(lengths.max()), (cu, max_seqlen)
    _record("flash_attn_varlen_func")
    bounds = cu_seqlens_q.tolist()
    return torch.cat([_attend(q[s:e], k[s:e], v[s:e], softmax_scale, causal)
                      for s, e in zip(bounds[:-1], bounds[1:], strict=True)])


def install() -> None:
    """Register `varlen_probe` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers import modeling_flash_attention_utils as fa_utils
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, flash_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    # What lazy_import_flash_attention(NAME) would leave behind had it loaded a kernel package named NAME.
    fa_utils._flash_fn, fa_utils._flash_varlen_fn = flash_attn_func, flash_attn_varlen_func
    fa_utils._flash_with_kvcache_fn = None
    fa_utils._pad_fn, fa_utils._unpad_fn = fa_utils._pad_input, fa_utils._unpad_input
    fa_utils._process_flash_kwargs_fn = fa_utils._lazy_define_process_function(flash_attn_varlen_func)
    fa_utils._process_with_kvcache_kwargs_fn = dict
    fa_utils._loaded_implementation = NAME
