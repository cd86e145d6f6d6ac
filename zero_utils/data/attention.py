"""How packed rows keep their examples apart under each attention implementation.

A packed row holds several examples; its `position_ids` restart at 0 at each one (`data.packing`). The
attention implementations need that told to them in different ways (checked against transformers 5.24):

- sdpa, eager: transformers builds a block-diagonal causal mask per row from `position_ids`
  (`masking_utils.find_packed_sequence_indices`), at any micro-batch size. Nothing more to pass; flattening the
  micro-batch would build a (B*S)^2 mask and do B times the attention work.
- flash-attention (flash_attention_2/3/4, and any implementation registered with transformers'
  `flash_attention_mask`): the mask builder returns None and the varlen kernel is taken from `position_ids` only
  when the batch size is 1 (`_is_packed_sequence` in `modeling_flash_attention_utils.py`); at batch > 1 every row
  attends causally across all its examples. `varlen_kwargs` passes the example boundaries explicitly
  (`cu_seq_lens_q/k`, `max_length_q/k`, transformers' `FlashAttentionKwargs`), which transformers honours at any
  batch size by flattening the micro-batch into one sequence of B*S tokens for the varlen kernel.
- anything else (flex_attention, paged and hub kernels with masks of their own): not proven to keep examples
  apart, so `packing_path` refuses it rather than train on mixed examples.

Engines: all (the kwargs pass through DDP, DeepSpeed and FSDP2 wrappers and PEFT models to every attention layer).
"""

from __future__ import annotations

import torch

from zero_utils.run.errors import UserError
from zero_utils.run.transfer import to_device

BLOCK_MASK = "block_mask"  # transformers builds per-row block-diagonal masks from position_ids
VARLEN = "varlen"  # example boundaries passed to the varlen kernel as cumulative sequence lengths
_BLOCK_MASK_IMPLEMENTATIONS = ("sdpa", "eager")


def packing_path(attn_implementation: str | None) -> str:
    """How packed examples are kept apart under `attn_implementation` (the `--attn_implementation` flag; empty or
    None is transformers' default, sdpa or eager): `BLOCK_MASK` for sdpa and eager, `VARLEN` for implementations
    registered with transformers' `flash_attention_mask` (flash_attention_2/3/4). Raises `UserError` for any other
    implementation. Cheap: call it before data preparation, so a refused flag costs nothing."""
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    if not attn_implementation or attn_implementation in _BLOCK_MASK_IMPLEMENTATIONS:
        return BLOCK_MASK
    if AttentionMaskInterface._global_mapping.get(attn_implementation) is flash_attention_mask:
        return VARLEN
    raise UserError(f"--attn_implementation {attn_implementation} is not known to keep packed examples apart (only "
                    "sdpa, eager and flash-attention are); pass --attn_implementation sdpa or flash_attention_2.")


def varlen_kwargs(position_ids: torch.Tensor) -> dict:
    """Example boundaries of a packed micro-batch for a varlen (flash-attention) kernel.

    `position_ids`: LongTensor [B, S] restarting at 0 at each example, on the host (the CPU rows before they are
    copied: finding the boundaries needs `nonzero` and the longest example an `int`, which on a GPU tensor would
    each make the host wait for the device). Returns {"cu_seq_lens_q", "cu_seq_lens_k": int32 [num_examples + 1]
    cumulative token offsets into the flattened B*S tokens (0 first, B*S last; a new example starts wherever a
    position does not follow its predecessor by 1, and at every row), on the device of `position_ids` (copy them
    with the batch), "max_length_q", "max_length_k": the longest example in tokens (int)}.
    """
    batch_size, seq_len = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    start_offsets = starts.flatten().nonzero().flatten()
    cu_seq_lens = torch.cat([start_offsets, start_offsets.new_full((1,), batch_size * seq_len)]).to(torch.int32)
    max_length = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max())
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": max_length, "max_length_k": max_length}


def packed_kwargs(position_ids: torch.Tensor, path: str, device) -> dict:
    """Extra model-call kwargs for a packed micro-batch on `path` (from `packing_path`): none for `BLOCK_MASK`;
    for `VARLEN`, `varlen_kwargs` of the host `position_ids` [B, S], its offsets copied to `device` once, without
    blocking (`transfer.to_device`), and used for both queries and keys."""
    if path != VARLEN:
        return {}
    kwargs = varlen_kwargs(position_ids)
    kwargs["cu_seq_lens_q"] = kwargs["cu_seq_lens_k"] = to_device(kwargs["cu_seq_lens_q"], device)
    return kwargs
