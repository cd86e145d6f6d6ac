"""The bytes a GPU holds at its peak that grow with real shapes, beyond model states, Korthikanti's activations and
the engines' buffers (zero_utils.formulas.model_states): four terms the estimate adds, each printed on its own. Pure
arithmetic, like formulas.model_states (no torch). Units: bytes. s = seq_len, b = rows per micro-batch, h = hidden size,
L = layers, V = vocabulary, e = bytes per compute element (2 in bf16, 4 in fp32).

- Block mask of packed rows under sdpa (`packed_mask_bytes`). transformers builds one bool (b, 1, s, s) mask per
  forward to keep packed examples apart; SDPA turns it into a float copy in the compute dtype (b x s^2 x e) in every
  layer and saves it for backward; and transformers turns GQA-in-SDPA off whenever a mask exists
  (`use_gqa_in_sdpa`), so K and V are repeated to every query head and saved that large: 2 x b x s x (h - h_kv) x e
  more per layer (h_kv = the K/V width, h x kv_heads / heads). With activation checkpointing one layer's copies exist
  at a time. Unpacked rows (the DPO recipes' right-padded pairs: causal, no mask), flash-attention (varlen offsets, no
  mask) and eager (its mask and repeated K/V exist either way: in Korthikanti's terms) add nothing. At 8B (h 4096,
  32 heads, 8 K/V heads, 32 layers), micro-batch 4, seq 4,096, bf16, no checkpointing: 4.4 GB of mask and its
  copies and 6.4 GB of repeated K/V.
- Loss backward (`loss_backward_bytes`). Korthikanti's logits term counts the forward: e + 4 bytes per token and
  vocabulary entry (the logits and their fp32 copy). The backward of the cross-entropy holds more, 12 bytes: the
  saved fp32 log-softmax, the gradient flowing into it and the gradient it gives the logits, all fp32 (with the
  recipes' --loss_chunk_tokens C, for one recomputed chunk of C tokens; else for every token). The term is the
  difference, 12 - (e + 4): 6 bytes in bf16, 4 in fp32, per token and vocabulary entry.
- FSDP2's fp32 reduce-scatter input (`fsdp2_reduce_scatter_bytes`). With bf16 parameters and an fp32 reduce dtype
  (zero_utils.model.wrapping's MixedPrecisionPolicy), each unit's bf16 gradient is copied into an fp32 buffer for its
  reduce-scatter: 4 bytes per trainable parameter of the largest unit (the input embedding at a 128k vocabulary and
  h 4096: 2.1 GB), on top of the bf16 gradient formulas.model_states counts. fp32 training reduces in place: 0.
- Autocast weight copies (`autocast_copies_bytes`). DDP and one process in bf16 run autocast over fp32 weights:
  every matmul weight (all parameters but the input embedding and vectors of <= 10 h elements) gets a bf16 copy
  (2 bytes each), kept for backward, trainable and frozen alike. With activation checkpointing only autocast's cache
  of the trainable weights lives through the forward. FSDP2 and DeepSpeed hold bf16 parameters: 0.

Left to the estimator's SAFETY_MARGIN, because only a GPU shows them: the CUDA context (300-500 MB), NCCL's
communicator buffers, the caching allocator's fragmentation, cuBLAS workspaces.
"""

from __future__ import annotations

from zero_utils.formulas.model_states import Architecture, element_bytes
from zero_utils.run.engine import Engine

TERMS = ("block_mask", "loss_backward", "fp32_reduce_scatter", "autocast_copies",  # their order in every print-out
         "sp_all_to_all")
TERM_NAMES = {"block_mask": "block mask", "loss_backward": "loss backward",  # as the fit check and the CLI print them
              "fp32_reduce_scatter": "fp32 reduce-scatter", "autocast_copies": "autocast copies",
              "sp_all_to_all": "SP all-to-all"}
LOSS_BACKWARD_BYTES = 12  # per token and vocabulary entry: fp32 log-softmax, its gradient in, the logits' gradient


def packed_mask_bytes(arch: Architecture, *, seq_len: int, micro_batch_size: int, dtype: str,
                      activation_checkpointing: bool, attention: str = "sdpa", packed_rows: bool = True) -> int:
    """The bool block mask of packed rows, each layer's float copy of it and the K/V repeated to every query head
    (the module docstring), in bytes per GPU; 0 unless rows are packed and attention is sdpa. Engines: all."""
    if not packed_rows or attention != "sdpa":
        return 0
    s, b, h, e = seq_len, micro_batch_size, arch.hidden_size, element_bytes(dtype)
    kv_width = h * arch.num_kv_heads // arch.num_heads if arch.num_heads and arch.num_kv_heads else h
    layers = 1 if activation_checkpointing else arch.num_layers
    return b * s * s + layers * (e * b * s * s + 2 * e * b * s * (h - kv_width))


def loss_backward_bytes(arch: Architecture, *, seq_len: int, micro_batch_size: int, dtype: str,
                        loss_chunk_tokens: int = 0) -> int:
    """What the cross-entropy's backward holds beyond the forward's logits that the activations count:
    (12 - (e + 4)) bytes per token and vocabulary entry, for one chunk of `loss_chunk_tokens` tokens (0: the whole
    micro-batch). Engines: all."""
    tokens = seq_len * micro_batch_size
    tokens = min(loss_chunk_tokens, tokens) if loss_chunk_tokens else tokens
    return (LOSS_BACKWARD_BYTES - (element_bytes(dtype) + 4)) * tokens * arch.vocab_size


def fsdp2_reduce_scatter_bytes(engine: Engine, arch: Architecture, *, dtype: str,
                               trainable_fraction: float = 1.0) -> int:
    """FSDP2 in bf16: the fp32 reduce-scatter input of the largest unit's trainable gradient, 4 bytes per parameter;
    0 for other engines and in fp32."""
    if not engine.is_fsdp2 or dtype == "fp32":
        return 0
    return 4 * int(max(arch.block_params, arch.embed_params) * trainable_fraction)


def autocast_copies_bytes(engine: Engine, arch: Architecture, *, dtype: str, activation_checkpointing: bool,
                          trainable_fraction: float = 1.0) -> int:
    """DDP and one process in bf16: autocast's bf16 copies of the matmul weights, 2 bytes each (with activation
    checkpointing, of the trainable ones only); 0 for the sharded engines and in fp32."""
    if dtype == "fp32" or not engine.is_data_parallel_only:
        return 0
    matmul_params = arch.num_params - arch.embed_params - arch.persistent_params
    return 2 * int(matmul_params * (trainable_fraction if activation_checkpointing else 1.0))


def ulysses_all_to_all_bytes(arch: Architecture, *, seq_len: int, micro_batch_size: int, dtype: str,
                             sequence_parallel: int) -> int:
    """DeepSpeed Ulysses sequence parallelism of size `sequence_parallel` (`seq_len`: a rank's positions, the row's
    / sp): one layer's attention inputs and output on both sides of the all-to-all, the send and the receive
    buffers: 2 x (queries + output: h each, keys + values: the K/V width each) per token. 0 without SP."""
    if sequence_parallel == 1:
        return 0
    kv_width = arch.hidden_size * (arch.num_kv_heads or arch.num_heads or 1) // (arch.num_heads or 1)
    return 2 * seq_len * micro_batch_size * (2 * arch.hidden_size + 2 * kv_width) * element_bytes(dtype)


def peak_terms(engine: Engine, arch: Architecture, *, seq_len: int, micro_batch_size: int, dtype: str,
               activation_checkpointing: bool, attention: str, packed_rows: bool, loss_chunk_tokens: int,
               trainable_fraction: float = 1.0, sequence_parallel: int = 1) -> dict[str, int]:
    """Every term of the module docstring for one engine and setting: {name in TERMS: bytes per GPU}. Under
    sequence parallelism `seq_len` is a rank's share of the row (seq_len / sp)."""
    return {
        "block_mask": packed_mask_bytes(arch, seq_len=seq_len, micro_batch_size=micro_batch_size, dtype=dtype,
                                        activation_checkpointing=activation_checkpointing, attention=attention,
                                        packed_rows=packed_rows),
        "loss_backward": loss_backward_bytes(arch, seq_len=seq_len, micro_batch_size=micro_batch_size, dtype=dtype,
                                             loss_chunk_tokens=loss_chunk_tokens),
        "fp32_reduce_scatter": fsdp2_reduce_scatter_bytes(engine, arch, dtype=dtype,
                                                          trainable_fraction=trainable_fraction),
        "autocast_copies": autocast_copies_bytes(engine, arch, dtype=dtype,
                                                 activation_checkpointing=activation_checkpointing,
                                                 trainable_fraction=trainable_fraction),
        "sp_all_to_all": ulysses_all_to_all_bytes(arch, seq_len=seq_len, micro_batch_size=micro_batch_size,
                                                  dtype=dtype, sequence_parallel=sequence_parallel),
    }
