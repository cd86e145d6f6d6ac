"""Per-token cross-entropy of a causal LM with the output head computed over chunks of tokens, so that the
full-vocabulary logits of a micro-batch never exist at once, in forward or in backward.

At a 128k vocabulary the loss is the largest activation once ZeRO has sharded the model states: unchunked, a
4,096-token row holds its bf16 logits, their fp32 copy and the fp32 log-softmax (10 bytes x 4,096 x 128,256 = 5.3 GB),
and backward adds their gradient. Chunked, the head and the loss run on `chunk_tokens` tokens at a time, each chunk
under non-reentrant activation checkpointing: forward keeps only the chunk's hidden states and its token losses;
backward recomputes one chunk's logits at a time (the head's matmul runs twice: about 1/3 more head FLOPs).

One mechanism for every engine: the chunk loop runs inside the output head's own forward (its `forward` is
replaced on the instance; the module and its engine hooks stay). DeepSpeed ZeRO-3 gathers the head's weight for
that forward and again before its backward (where the chunks are recomputed), and partitions it in between; FSDP2
keeps the output-head group gathered from forward to backward (zero_utils.model.wrapping), so it is gathered once per
micro-batch either way; DDP has nothing to gather. The model is still called as a whole (FSDP2 allows one root),
and its `.logits` output carries the token losses instead of logits. That is exact only when the model's logits
are the head's output unchanged (no soft-capping, scaling or bias after it): `logits_are_head_output` checks it
once, at start, with a probe; a model that fails takes the unchunked path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from zero_utils.model.wrapping import reshard_after_inference


class TokenLosses:
    """`token_losses(model, micro)` -> the cross-entropy of each token of a micro-batch, fp32, shape (rows, seq_len),
    0 where the label is `ignore_index` (the negative log-probability of each label token: a preference loss sums
    its negation per answer).

    Args:
        model: the prepared model (any engine; a PEFT model too); its output head is
            `get_output_embeddings()` of the unwrapped model.
        chunk_tokens: tokens per chunk of the head and the loss; 0 = the whole micro-batch's logits at once.
        ignore_index: the label of tokens without loss.
        accelerator: for the device of the start-up check and `print` (one line on the main process when the
            model cannot be chunked).
    Every rank must construct it (the start-up check is a forward of the whole model). Engines: all.
    """

    def __init__(self, model, chunk_tokens: int, ignore_index: int, accelerator):
        self.ignore_index = ignore_index
        self._labels = None
        self.chunk_tokens = chunk_tokens
        if not chunk_tokens:
            return
        head = accelerator.unwrap_model(model).get_output_embeddings()
        if head is None or not logits_are_head_output(model, head, accelerator.device):
            accelerator.print(f"--loss_chunk_tokens {chunk_tokens}: this model's logits are not its output head's "
                              "output (a soft-cap, scale or bias follows it); the loss uses the whole logits instead.")
            self.chunk_tokens = 0
            return
        unchunked = head.forward

        def forward(hidden):  # the head's forward: token losses while a micro-batch's labels are set, else logits
            if self._labels is None:
                return unchunked(hidden)
            return chunked_cross_entropy(unchunked, hidden, self._labels, self.chunk_tokens, self.ignore_index)

        head.forward = forward

    def __call__(self, model, micro) -> torch.Tensor:
        """Token losses of `micro` (`data.training.MicroBatch`: `inputs` for the model, `labels` of shape (rows,
        seq_len))."""
        if not self.chunk_tokens:
            logits = model(**micro.inputs).logits
            return F.cross_entropy(logits.float().flatten(0, 1), micro.labels.flatten(), ignore_index=self.ignore_index,
                                   reduction="none").view_as(micro.labels)
        self._labels = micro.labels
        try:
            return model(**micro.inputs).logits.view_as(micro.labels)
        finally:
            self._labels = None


def chunked_cross_entropy(head_forward, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                          ignore_index: int) -> torch.Tensor:
    """fp32 token losses (rows, seq_len) of `labels` under `head_forward(hidden)`'s logits, `chunk_tokens` tokens
    at a time: with gradients, each chunk is checkpointed (its logits recomputed in backward), so at most one chunk's
    logits, their fp32 copy, log-softmax and gradient exist at once. `hidden`: (rows, seq_len, hidden_size)."""
    flat_hidden, flat_labels = hidden.flatten(0, 1), labels.flatten()
    losses = []
    for start in range(0, flat_labels.numel(), chunk_tokens):
        chunk = (flat_hidden[start:start + chunk_tokens], flat_labels[start:start + chunk_tokens])
        if torch.is_grad_enabled():
            losses.append(checkpoint(_chunk_losses, head_forward, *chunk, ignore_index, use_reentrant=False))
        else:
            losses.append(_chunk_losses(head_forward, *chunk, ignore_index))
    # a new tensor, not a view of the concatenation: FSDP2 hooks the head's output for backward, and an in-place op
    # on a returned view would drop that hook (torch warns "returned a view tensor" for every step)
    return torch.cat(losses).view_as(labels).clone()


def _chunk_losses(head_forward, hidden, labels, ignore_index):
    return F.cross_entropy(head_forward(hidden).float(), labels, ignore_index=ignore_index, reduction="none")


PROBE_VALUE = 50.0


def logits_are_head_output(model, head: torch.nn.Module, device) -> bool:
    """Whether `model(...).logits` is exactly what `head` returns. A forward hook replaces the head's output with a
    probe of random signs times PROBE_VALUE; anything the model adds after the head (Gemma 2's soft-capping, a
    scale, a bias) changes the probe, while a numerical comparison of chunked and full logits could miss it at bf16
    tolerance. One no-grad forward of 8 tokens; every rank must call it (sharded engines gather in forward)."""
    generator = torch.Generator().manual_seed(0)
    probes = []

    def replace(module, args, output):
        signs = torch.randint(0, 2, output.shape, generator=generator) * 2 - 1
        probes.append((signs * PROBE_VALUE).to(device=output.device, dtype=output.dtype))
        return probes[-1]

    handle, training = head.register_forward_hook(replace), model.training
    model.eval()  # [SP] Ulysses attention runs a batch of the training micro-batch's shape only; off in eval mode
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.arange(8, device=device).unsqueeze(0), use_cache=False).logits
    finally:
        handle.remove()
        model.train(training)
        reshard_after_inference(model)
    return len(probes) == 1 and logits.shape == probes[0].shape and torch.equal(logits.float(), probes[0].float())
