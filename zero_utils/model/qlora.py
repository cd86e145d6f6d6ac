"""QLoRA's 4-bit quantization: the bitsandbytes config `load_causal_lm` loads the base model with, or a one-line
`UserError` where QLoRA cannot run (no CUDA GPU, no bitsandbytes). Engines: all (each rank loads its own 4-bit copy).
"""

from __future__ import annotations

import torch

from zero_utils.run.errors import UserError


def quantization_config(qlora: bool):
    """The 4-bit (NF4) bitsandbytes config of QLoRA, or None. QLoRA needs a CUDA GPU and the bitsandbytes package:
    anything else is a `UserError`. The 4-bit weights are stored as bf16 elements so FSDP2 and ZeRO-3 can shard
    them. Not tested in CI (no GPU there)."""
    if not qlora:
        return None

    if not torch.cuda.is_available():
        raise UserError("--qlora needs a CUDA GPU (bitsandbytes 4-bit kernels); drop --qlora to train LoRA on this "
                        "machine, or run on a GPU node.")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise UserError("--qlora needs the bitsandbytes package: pip install bitsandbytes.") from exc
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
