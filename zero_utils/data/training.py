"""A run's training data: load -> format -> tokenize -> mask prompt tokens -> pack -> per-rank batches. One
example's formatting and tokenizing is zero_utils.data.sft_examples, packing zero_utils.data.packing, preparing the rows
once per job (bounded memory, kept in a cache) zero_utils.data.preparation with the SFT row maker
zero_utils.data.sft_rows; here each step's rows are drawn and dealt
to the ranks (`TrainingData`), and the run's data line written.

Accepted inputs: a Hub dataset id, a local file (.json, .jsonl, .parquet, .csv, .txt) or a local folder, in the
layouts users bring, detected from the columns:

    messages                      chat turns [{"role": ..., "content": ...}, ...]; loss on assistant turns
    prompt / completion           loss on the completion
    instruction / input / output  Alpaca style; loss on the output
    text                          plain text (continued pretraining): each document ends with the EOS token, loss
                                  on every token; a document longer than seq_len is split into windows

`column_map` renames the user's columns to these names when detection cannot tell (e.g. {"prompt": "question"}).

The tokenizer's chat template renders conversations when it has one; otherwise `PLAIN_FORMAT` does.
Examples are packed into rows of exactly `seq_len` tokens. Each row carries `position_ids` that restart at 0 at
every example. Under sdpa and eager attention they make transformers build a block-diagonal causal mask per row
(with `use_cache=False`), so no token attends to another example. Flash-attention does not read them at a
micro-batch size above 1 (it attends across the whole row): the example offsets must reach its varlen kernel
explicitly, which `zero_utils.data.attention.packed_kwargs` does.
`labels` are already shifted: `labels[t]` is the target of position t (the next token of the same example), or
-100 where there is no loss (prompt tokens, the last token of each example, padding). The loss is then a plain
`cross_entropy(logits, labels, ignore_index=-100)` and never predicts one example from another.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from zero_utils.data import attention
from zero_utils.data.preparation import prepare
from zero_utils.data.sft_examples import IGNORE_INDEX, parse_column_map
from zero_utils.data.sft_rows import SFTRows
from zero_utils.data.sources import DataSource
from zero_utils.run.engine import sequence_parallel_gradient_factor, sequence_parallel_size
from zero_utils.run.errors import UserError
from zero_utils.run.transfer import to_device


def pad_token_id_within(tokenizer, vocab_size: int) -> int:
    """The id packed rows are padded with: the tokenizer's pad token, else its EOS, else 0, whichever comes first
    inside the model's embedding of `vocab_size` rows. A tokenizer may hold more tokens than the embedding
    (transformers' Qwen2 tokenizer adds `<|endoftext|>` as pad when the saved one has none; users add chat tokens);
    padding carries no loss and attends only to itself, so any id the embedding has is correct."""
    return next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None and t < vocab_size)


def check_token_ids(tokenizer, max_token_id: int, vocab_size: int) -> None:
    """Raise `UserError` when the tokenized data holds a token id the model's embedding (`vocab_size` rows) does
    not have: training would stop mid-step with an IndexError."""
    if max_token_id >= vocab_size:
        token = tokenizer.convert_ids_to_tokens(max_token_id)
        raise UserError(f"the data tokenizes to token id {max_token_id} ({token!r}), outside the model's embedding "
                        f"of {vocab_size} tokens: the tokenizer has tokens the model lacks; use the model's own "
                        "tokenizer, or add them with model.resize_token_embeddings(len(tokenizer)), save the model and "
                        "pass that folder as --model.")


def check_seq_len(seq_len: int, max_position_embeddings: int) -> None:
    """Raise `UserError` when packed rows of `seq_len` tokens are longer than the model's positions."""
    if seq_len > max_position_embeddings:
        raise UserError(f"--seq_len {seq_len} exceeds the model's max_position_embeddings "
                        f"({max_position_embeddings}); lower --seq_len.")


def check_enough_rows(num_rows: int, global_batch_size: int) -> None:
    """Raise `UserError` when one global batch (per-device batch x accumulation x world size) needs more rows."""
    if num_rows < global_batch_size:
        raise UserError(
            f"the training data packs into {num_rows} rows of --seq_len tokens, fewer than one global batch "
            f"({global_batch_size} = per-device batch x accumulation x processes); use more data, a smaller "
            "--seq_len or a smaller batch.")


def check_sequence_parallel(sp: int, seq_len: int, model_config, attn_implementation: str, world_size: int) -> None:
    """Raise `UserError` for a sequence-parallel run DeepSpeed's Ulysses attention cannot train: ranks that are not
    groups of `sp`, a --seq_len that is not a multiple of sp, query heads not divisible by sp or KV heads where
    neither divides the other, an attention other than sdpa (eager is refused by DeepSpeed; flash-attention's varlen
    offsets would be the shard's, not the row's)."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    fix = "choose a parallelism_config_sp_size that divides it"
    if world_size % sp:
        raise UserError(f"parallelism_config_sp_size {sp} does not divide the {world_size} processes; {fix}.")
    if seq_len % sp:
        raise UserError(f"--seq_len {seq_len} is not a multiple of parallelism_config_sp_size {sp}: each rank holds "
                        f"seq_len / sp positions; use a multiple of {sp}.")
    if heads % sp:
        raise UserError(f"the model has {heads} attention heads, not divisible by parallelism_config_sp_size {sp} "
                        f"(each rank attends with heads / sp of them); {fix}.")
    if kv_heads % sp and sp % kv_heads:
        raise UserError(f"the model has {kv_heads} key/value heads: parallelism_config_sp_size {sp} must divide them "
                        "or be a multiple of them; choose another sp size.")
    if (attn_implementation or "sdpa") != "sdpa":
        raise UserError(f"--attn_implementation {attn_implementation} under sequence parallelism: these recipes run "
                        "DeepSpeed's Ulysses attention around sdpa only; pass --attn_implementation sdpa.")


def global_batch_indices(num_rows: int, global_batch_size: int, step: int, seed: int) -> list[int]:
    """Row indices of optimizer step `step` (1-based): the global batch is `global_batch_size` consecutive rows of
    a seeded per-epoch permutation (`epoch_order`); the incomplete tail of an epoch is dropped.

    The position is counted in global rows ((step - 1) x global batch), so any world size that keeps the global
    batch continues the same data stream. A step costs its batch: the epoch's permutation is drawn once.
    """
    batches_per_epoch = num_rows // global_batch_size
    epoch, batch_in_epoch = divmod(step - 1, batches_per_epoch)
    start = batch_in_epoch * global_batch_size
    return epoch_order(num_rows, seed, epoch)[start:start + global_batch_size].tolist()


@functools.lru_cache(maxsize=2)
def epoch_order(num_rows: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the rows in `epoch` (0-based): `torch.randperm(num_rows)` seeded with seed * 1_000_003 + epoch,
    int64 [num_rows]; kept for the epoch (8 bytes per row), so a pure function of (seed, epoch) drawn once."""
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def loss_tokens_per_row(rows) -> torch.Tensor:
    """Answer (loss) tokens in each packed row: int64 [num_rows], from the `num_loss_tokens` column the packer
    wrote (4 bytes a row read, not the rows themselves).

    Every rank holds every row, so with these counts each rank knows a global batch's token count without a
    collective (see `global_batch_loss_tokens`)."""
    return torch.from_numpy(rows.data.column("num_loss_tokens").to_numpy().astype("int64"))


def global_batch_loss_tokens(loss_tokens_per_row: torch.Tensor, indices: list[int]) -> int:
    """Answer tokens of the global batch made of rows `indices` (all ranks' micro-batches together)."""
    return int(loss_tokens_per_row[indices].sum())


def rank_rows(indices: list[int], rank: int, world_size: int, per_device_batch_size: int,
              gradient_accumulation_steps: int) -> list[list[int]]:
    """Row indices of this rank's micro-batches within one global batch: micro-step k on rank r gets
    indices[(k * world_size + r) * b : ... + b]. Returns one list per micro-step."""
    b = per_device_batch_size
    return [indices[(k * world_size + rank) * b:(k * world_size + rank + 1) * b]
            for k in range(gradient_accumulation_steps)]


def describe(info: dict, seq_len: int) -> str:
    """One line about the prepared data, from the `info` of `preparation.prepare` with `sft_rows.SFTRows`."""
    splits = (f" (train: {info['train_split']}, eval: {info.get('eval_split') or 'none'})"
              if info.get("train_split") else "")
    line = (f"data: {info['layout']} layout{splits}, {info['train_examples']} train / {info['eval_examples']} eval "
            f"examples -> {info['train_rows']} / {info['eval_rows']} rows of {seq_len} tokens"
            + ("" if info.get("packing", True) else ", one example each (--no-packing)"))
    counts = [f"{info[key]} {what}" for key, what in (("truncated_examples", "examples truncated"),
                                                      ("split_documents", "documents split into windows"))
              if info.get(key)]
    line += f" ({', '.join(counts)})" if counts else ""
    nodes = info.get("nodes_with_own_rows")
    where = f" (and the same rows by the local main process of {nodes} node(s) with their own datasets cache)" \
        if nodes else ""
    if info.get("sources"):  # a mixture: each source's examples used of available, and share of the tokens
        line += "; " + ", ".join(f"{s['id']} ({s['split']}): {s['examples_used']} of {s['examples_available']} "
                                 f"examples, {s['token_share']:.0%} of the tokens" for s in info["sources"])
    processes = info.get("tokenizing_processes", 1)
    by = f" ({processes} tokenizing processes)" if processes > 1 else ""
    return line + (f"; prepared rows reused from {info['folder']}{where}" if info.get("reused")
                   else f"; rows prepared in {info['folder']}{by}{where}" if info.get("folder") else "")


def eval_micro_batches(rows, rank: int, world_size: int, per_device_batch_size: int):
    """Yield this rank's eval batches (rows strided over ranks), on the host: {input_ids, labels, position_ids}
    [B, S]. Every rank yields the same number of batches, so sharded engines (whose forward is a collective) never
    wait on a rank that has finished; filler rows have no loss tokens."""
    n = len(rows)
    mine = list(range(rank, n, world_size))
    num_batches = math.ceil(math.ceil(n / world_size) / per_device_batch_size)
    for i in range(num_batches):
        idx = mine[i * per_device_batch_size:(i + 1) * per_device_batch_size]
        batch = rows[idx] if idx else rows[[0]]
        batch = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
        if not idx:
            batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
        yield batch


@dataclass
class MicroBatch:
    """One micro-batch of packed rows on this rank's device: `inputs` are the model's keyword arguments
    (input_ids and position_ids [B, S], use_cache=False, and the attention implementation's packing arguments),
    `labels` [B, S] the shifted targets (`IGNORE_INDEX` where there is no loss), `num_loss_tokens` their count."""

    inputs: dict
    labels: torch.Tensor

    @property
    def num_loss_tokens(self) -> torch.Tensor:
        return (self.labels != IGNORE_INDEX).sum()


@dataclass
class StepBatches:
    """What one optimizer step trains on this rank: its micro-batches (one per accumulation step; [SP] sp x as many,
    each of seq_len / sp positions) and the answer tokens of the whole global batch, all ranks together
    (`loss_tokens`: the loss is their mean). `loss_scale`: what each micro-batch's summed token loss is multiplied
    by before backward, so that after accelerate (or DeepSpeed) divides by the micro-steps and the engine averages
    over ranks the gradient is d(sum of token losses)/d(theta) / loss_tokens: processes x accumulation / loss_tokens
    ([SP] x sp under ZeRO-3, whose reduce-scatter averages over every rank: `sequence_parallel_gradient_factor`)."""

    micro_batches: list[MicroBatch]
    loss_tokens: int
    loss_scale: float


class TrainingData:
    """A run's data, prepared once: packed train rows (and held-out rows), sliced per optimizer step into this rank's
    micro-batches. It owns the batch arithmetic (per-device batch x accumulation x processes = global batch), the
    data order (`global_batch_indices`: any world size with the same global batch continues the same stream), the
    attention keyword arguments that keep packed examples apart, and the ignore index of the labels.

        train_data = TrainingData.prepare(accelerator, tokenizer, model_config, dataset=..., seq_len=..., ...)
        for step in ...:
            batches = train_data.step_batches(step)        # this rank's micro-batches + the global loss tokens
        for micro in train_data.eval_batches(): ...

    `prepare` checks what a user can get wrong before any work (an attention implementation that would mix packed
    examples, a --seq_len beyond the model, too few rows for one global batch). Every rank holds every row, so each
    knows a global batch's token count without a collective. Engines: all.
    """

    ignore_index = IGNORE_INDEX

    def __init__(self, train_rows, eval_rows, info: dict, *, seq_len: int, per_device_batch_size: int,
                 gradient_accumulation_steps: int, seed: int, attention_path: str, rank: int, world_size: int,
                 device, sequence_parallel: int = 1, gradient_factor: int = 1):
        self.train_rows, self.eval_rows, self.info = train_rows, eval_rows, info
        # [SP] ranks in groups of `sequence_parallel` (contiguous, as DeepSpeed builds them): a group trains its
        # members' micro-batches one after another, each rank on its 1/sp of every row's positions
        self.sp, self.sp_rank, self.dp, self.dp_rank = (sequence_parallel, rank % sequence_parallel,
                                                        world_size // sequence_parallel, rank // sequence_parallel)
        self.seq_len, self.per_device_batch_size, self.seed = seq_len, per_device_batch_size, seed
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.attention_path, self.rank, self.world_size, self.device = attention_path, rank, world_size, device
        self.global_batch_rows = per_device_batch_size * gradient_accumulation_steps * world_size
        self.gradient_divisor = world_size * gradient_accumulation_steps * gradient_factor  # StepBatches.loss_scale
        self.tokens_per_step = self.global_batch_rows * seq_len
        check_enough_rows(len(train_rows), self.global_batch_rows)
        self._loss_tokens_per_row = loss_tokens_per_row(train_rows)  # each step's token count, with no collective

    @classmethod
    def prepare(cls, accelerator, tokenizer, model_config, *, dataset: DataSource | str, columns: str, seq_len: int,
                eval_fraction: float, seed: int, per_device_batch_size: int, gradient_accumulation_steps: int,
                attn_implementation: str, num_proc: int = 0, packing: bool = True) -> "TrainingData":
        """Check, load, tokenize and pack `dataset` once per job (`preparation.prepare` with `sft_rows.SFTRows`: the
        main process prepares, or reuses rows prepared earlier; the others open them) for a model of `model_config`.
        `dataset`: a `DataSource` (--dataset with its split, configuration and revision), a name, or a YAML file of
        a dataset_mixture. `columns` is the --columns text (`parse_column_map`). `num_proc`: processes that tokenize
        (0 = the main process's CPUs, at most 8; the rows are the same for any value). `packing`: False (--no-packing)
        puts each example in a row of its own, padded to `seq_len`."""
        # Packed rows hold several examples: sdpa/eager keep them apart with per-row block masks, flash-attention
        # with the examples' offsets passed to its varlen kernel; any other implementation is refused here.
        path = attention.packing_path(attn_implementation)
        check_seq_len(seq_len, model_config.max_position_embeddings)  # before tokenizing anything
        pad_token_id = pad_token_id_within(tokenizer, model_config.vocab_size)  # an id inside the embedding
        sp = sequence_parallel_size()
        if sp > 1:  # [SP] sdpa cannot keep packed examples apart once DeepSpeed drops the mask: one example a row
            check_sequence_parallel(sp, seq_len, model_config, attn_implementation, accelerator.num_processes)
            packing = False
        train_rows, eval_rows, info = prepare(accelerator, tokenizer, dataset,
                                              SFTRows(seq_len, pad_token_id, packing=packing),
                                              eval_fraction=eval_fraction, seed=seed,
                                              column_map=parse_column_map(columns), num_proc=num_proc)
        check_token_ids(tokenizer, info["max_token_id"], model_config.vocab_size)
        return cls(train_rows, eval_rows, info, seq_len=seq_len, per_device_batch_size=per_device_batch_size,
                   gradient_accumulation_steps=gradient_accumulation_steps, seed=seed, attention_path=path,
                   rank=accelerator.process_index, world_size=accelerator.num_processes, device=accelerator.device,
                   sequence_parallel=sp, gradient_factor=sequence_parallel_gradient_factor(accelerator, sp))

    def global_batch_record(self) -> dict:
        """The global batch's size as the run's config and summary record it: {"global_batch_rows": rows}."""
        return {"global_batch_rows": self.global_batch_rows}

    def global_batch(self, step: int) -> list[int]:
        """Row indices of optimizer step `step` (1-based), all ranks' micro-batches together."""
        return global_batch_indices(len(self.train_rows), self.global_batch_rows, step, self.seed)

    def rows_of_step(self, indices: list[int]) -> list[list[int]]:
        """This rank's share of a global batch's rows: one list of row indices per micro-step (`rank_rows`); under
        SP its group's share, sp x the micro-steps (every rank of a group gets the same rows)."""
        return rank_rows(indices, self.dp_rank, self.dp, self.per_device_batch_size,
                         self.gradient_accumulation_steps * self.sp)

    def step_batches(self, step: int) -> StepBatches:
        """This rank's micro-batches of optimizer step `step` and the global batch's answer-token count."""
        indices = self.global_batch(step)
        micro = [self._micro_batch(self.train_rows[rows], shard=True) for rows in self.rows_of_step(indices)]
        loss_tokens = global_batch_loss_tokens(self._loss_tokens_per_row, indices)
        return StepBatches(micro, loss_tokens, self.gradient_divisor / loss_tokens)

    @property
    def has_eval(self) -> bool:
        """Whether there are held-out rows to evaluate on."""
        return self.eval_rows is not None

    def eval_batches(self):
        """This rank's held-out micro-batches (none without held-out data): every rank yields as many, so a sharded
        forward never waits on a rank that has finished (`eval_micro_batches`)."""
        if self.eval_rows is None:
            return
        for batch in eval_micro_batches(self.eval_rows, self.rank, self.world_size, self.per_device_batch_size):
            yield self._micro_batch(batch)

    def describe(self) -> str:
        """The batch arithmetic and the packed data, in two lines for the start of a run (three under SP)."""
        sp = (f"sequence parallel {self.sp}: each group of {self.sp} ranks trains its members' micro-batches in turn "
              f"({self.gradient_accumulation_steps * self.sp} micro-steps a step), each rank {self.seq_len // self.sp}"
              f" of every row's {self.seq_len} positions; rows of one example each\n") if self.sp > 1 else ""
        return (f"micro-batch {self.per_device_batch_size} x accumulation {self.gradient_accumulation_steps} x "
                f"{self.world_size} = global batch {self.global_batch_rows} rows = {self.tokens_per_step} tokens\n"
                + sp + describe(self.info, self.seq_len))

    def _micro_batch(self, rows, shard: bool = False) -> MicroBatch:
        """A micro-batch on the device from host rows: the packing arguments are computed from the host position
        ids, then everything is copied without blocking (`transfer.to_device`), so the step's only host sync stays
        the one of `distributed.reduce_step_values`. [SP] `shard`: this rank's seq_len / sp positions of each row
        (labels are already shifted, so a shard's last label is the next shard's first token: DeepSpeed's
        `shift_labels`); the rows hold one example each, so no packing arguments."""
        if shard and self.sp > 1:
            width = self.seq_len // self.sp
            positions = slice(self.sp_rank * width, (self.sp_rank + 1) * width)
            rows = {k: rows[k][:, positions] for k in ("input_ids", "labels", "position_ids")}
        packing = attention.packed_kwargs(rows["position_ids"], self.attention_path, self.device) \
            if self.sp == 1 else {}  # before the copy
        batch = {k: to_device(rows[k].contiguous(), self.device) for k in ("input_ids", "labels", "position_ids")}
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False,
                  **packing}
        return MicroBatch(inputs, batch["labels"])
