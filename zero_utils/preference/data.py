"""A preference run's data: pairs of answers to one prompt, the chosen and the rejected, tokenized with the chat
template as supervised fine-tuning does (zero_utils.preference.examples: layouts, truncation, loss on the answer's
tokens only), prepared once per job and kept (zero_utils.data.preparation with zero_utils.preference.pair_rows:
memory-mapped Arrow, reused by a relaunch), and dealt to the ranks a global batch of pairs at a time.

Any source `--dataset` takes (zero_utils.data.sources); splits as for SFT: the data set's eval split, else
`--eval_fraction` of the pairs held out. Pairs are not packed: a micro-batch of b pairs is 2b rows, the b chosen
sequences then the b rejected ones in the same order, right-padded to the longest without an attention mask, so a
pair's two answers are always in the same micro-batch on the same rank and no token attends to another example.

The loss of a step is the mean over the global batch's pairs, so `StepPairs` carries the global pair count and the
global batch's chosen answer tokens (for `--sft_weight`), known on every rank without a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_utils.data.preparation import prepare
from zero_utils.data.sft_examples import IGNORE_INDEX
from zero_utils.data.sources import DataSource
from zero_utils.data.training import MicroBatch, check_seq_len, global_batch_indices, pad_token_id_within, rank_rows
from zero_utils.preference.examples import parse_pair_columns
from zero_utils.preference.pair_rows import PairRows
from zero_utils.run.engine import sequence_parallel_size
from zero_utils.run.errors import UserError
from zero_utils.run.transfer import to_device


@dataclass
class PairMicroBatch(MicroBatch):
    """A micro-batch of pairs (2b rows: the chosen sequences, then the rejected ones); `reference_logps` (rows,), on
    the device: the reference's summed answer log-probability of each row, when they were precomputed
    (`attach_reference_logps`), else None."""

    reference_logps: torch.Tensor | None = None


@dataclass
class StepPairs:
    """What one optimizer step trains on this rank: its micro-batches of pairs (`MicroBatch` of 2b rows, chosen
    then rejected) and, for the whole global batch, the pair count and the chosen answers' token count."""

    micro_batches: list[PairMicroBatch]
    pairs: int
    chosen_tokens: int


class PreferenceData:
    """A preference run's pairs, prepared once per job (`preparation.prepare` with `pair_rows.PairRows`: the main
    process tokenizes, the other ranks open its memory-mapped files), sliced per optimizer step into this rank's
    micro-batches of `per_device_batch_size` pairs (global batch = pairs per device x accumulation x processes, in
    the data order of `zero_utils.data.training.global_batch_indices`).

        data = PreferenceData.prepare(accelerator, tokenizer, model_config, dataset=..., seq_len=..., ...)
        batches = data.step_batches(step)      # this rank's micro-batches, the global pair and chosen-token counts
        for micro, weights in data.eval_batches(): ...   # weights: 1 per held-out pair, 0 for filler pairs
        for micro, indices in data.strided_batches("train"): ...  # every pair once over the ranks (None: filler)
    `train`, `evaluation`: `datasets.Dataset`s with a row per pair (chosen_ids, chosen_labels, rejected_ids,
    rejected_labels, chosen_tokens, tokens); evaluation may be None. Engines: all."""

    ignore_index = IGNORE_INDEX

    def __init__(self, train, evaluation, info: dict, *, per_device_batch_size: int,
                 gradient_accumulation_steps: int, seed: int, pad_token_id: int, rank: int, world_size: int, device):
        self.train, self.evaluation, self.info = train, evaluation, info
        self.per_device_batch_size = per_device_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.seed, self.pad_token_id, self.rank, self.world_size = seed, pad_token_id, rank, world_size
        self.device = device
        self.reference_logps = {"train": None, "eval": None}  # (pairs, 2) on CPU: attach_reference_logps
        self.global_batch_pairs = per_device_batch_size * gradient_accumulation_steps * world_size
        if len(train) < self.global_batch_pairs:
            raise UserError(f"the training data has {len(train)} pairs, fewer than one global batch "
                            f"({self.global_batch_pairs} = pairs per device x accumulation x processes); use more "
                            "data or a smaller batch.")
        self._chosen_tokens = torch.as_tensor(train.data.column("chosen_tokens").to_numpy(), dtype=torch.long)
        lengths = train.data.column("tokens").to_numpy()
        self.tokens_per_step = round(float(lengths.sum()) / len(lengths) * self.global_batch_pairs)  # mean, unpadded

    @classmethod
    def prepare(cls, accelerator, tokenizer, model_config, *, dataset: DataSource, columns: str, seq_len: int,
                eval_fraction: float, seed: int, per_device_batch_size: int, gradient_accumulation_steps: int,
                num_proc: int = 0) -> PreferenceData:
        """Check the flags, then prepare the pairs once per job (or reuse them: `preparation.prepare` with
        `pair_rows.PairRows`; every other rank waits outside collectives and opens them). `num_proc`: processes that
        tokenize (0 = the main process's CPUs, at most 8; the same pairs for any value)."""
        if sequence_parallel_size() > 1:
            raise UserError("the preference recipes do not run under sequence parallelism yet (a pair's two answers "
                            "share a micro-batch, unsharded): launch them with zero3.yaml or zero2.yaml, without the "
                            "parallelism_config block.")
        check_seq_len(seq_len, model_config.max_position_embeddings)
        column_map = parse_pair_columns(columns)
        train, evaluation, info = prepare(accelerator, tokenizer, dataset, PairRows(seq_len),
                                          eval_fraction=eval_fraction, seed=seed, column_map=column_map,
                                          num_proc=num_proc, what="the preparation of the preference pairs")
        return cls(train, evaluation, info, per_device_batch_size=per_device_batch_size,
                   gradient_accumulation_steps=gradient_accumulation_steps, seed=seed,
                   pad_token_id=pad_token_id_within(tokenizer, model_config.vocab_size),
                   rank=accelerator.process_index, world_size=accelerator.num_processes, device=accelerator.device)

    def global_batch_record(self) -> dict:
        """The global batch's size as the run's config and summary record it: {"global_batch_pairs": pairs}."""
        return {"global_batch_pairs": self.global_batch_pairs}

    @property
    def has_eval(self) -> bool:
        return self.evaluation is not None and len(self.evaluation) > 0

    def step_batches(self, step: int) -> StepPairs:
        """This rank's micro-batches of optimizer step `step` (1-based) and the global batch's counts."""
        indices = global_batch_indices(len(self.train), self.global_batch_pairs, step, self.seed)
        mine = rank_rows(indices, self.rank, self.world_size, self.per_device_batch_size,
                         self.gradient_accumulation_steps)
        return StepPairs([self._micro_batch_of("train", rows) for rows in mine], len(indices),
                         int(self._chosen_tokens[indices].sum()))

    def eval_batches(self):
        """(micro-batch, weights) of this rank's held-out pairs, strided over ranks; every rank yields as many
        (a sharded forward never waits on a finished rank): filler pairs repeat pair 0 with weight 0."""
        for micro, indices in self.strided_batches("eval"):
            yield micro, to_device(torch.tensor([0.0 if i is None else 1.0 for i in indices]), self.device)

    def strided_batches(self, split: str):
        """(micro-batch, pair indices) of this rank's share of `split` ('train' or 'eval'): pairs rank, rank + N,
        ... in micro-batches of `per_device_batch_size`; every rank yields as many, the last ones filled with pair 0
        (index None)."""
        pairs = self.train if split == "train" else self.evaluation
        mine = list(range(self.rank, len(pairs), self.world_size))
        per_rank = -(-len(pairs) // self.world_size)
        for start in range(0, per_rank, self.per_device_batch_size):
            chunk = mine[start:start + self.per_device_batch_size] or [None]
            yield self._micro_batch_of(split, [0 if i is None else i for i in chunk]), chunk

    def attach_reference_logps(self, train: torch.Tensor, evaluation: torch.Tensor | None) -> None:
        """Give every micro-batch from now on the reference's precomputed summed answer log-probs: `train` (train
        pairs, 2) and `evaluation` (eval pairs, 2), float32, column 0 the chosen answer's, 1 the rejected one's."""
        self.reference_logps = {"train": train, "eval": evaluation}

    def _micro_batch_of(self, split: str, indices: list[int]) -> PairMicroBatch:
        micro = self.micro_batch([(self.train if split == "train" else self.evaluation)[i] for i in indices])
        if self.reference_logps[split] is not None:  # chosen rows first, then the rejected ones
            micro.reference_logps = to_device(self.reference_logps[split][indices].T.flatten(), self.device)
        return micro

    def micro_batch(self, pairs: list[dict]) -> PairMicroBatch:
        """2 x len(pairs) rows (chosen sequences, then rejected), right-padded to the longest: built on the host,
        copied without blocking (`transfer.to_device`). No attention mask: under causal attention a token never
        sees the padding after it, and the padding has no labels, so every answer token's log-prob is what a masked
        forward gives (equal bit for bit on CPU sdpa), while the model takes its causal kernel without reading a
        mask's values on the device (transformers' `_ignore_causal_mask_sdpa` would, twice per forward)."""
        sequences = [(p[f"{side}_ids"], p[f"{side}_labels"]) for side in ("chosen", "rejected") for p in pairs]
        length = max(len(ids) for ids, _ in sequences)
        input_ids = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(sequences), length), IGNORE_INDEX, dtype=torch.long)
        for row, (ids, row_labels) in enumerate(sequences):
            input_ids[row, :len(ids)], labels[row, :len(ids)] = torch.tensor(ids), torch.tensor(row_labels)
        inputs = {"input_ids": to_device(input_ids, self.device), "use_cache": False}
        return PairMicroBatch(inputs, to_device(labels, self.device))

    def describe(self) -> str:
        """The batch arithmetic and the pairs, in two lines for the start of a run."""
        info, counts = self.info, self.info["train"]
        line = (f"data: {info['layout']} (train: {info['train_split']}, eval: {info['eval_split'] or 'none'}), "
                f"{counts['pairs']} train / {info['eval']['pairs']} eval pairs, each answer with its prompt cut to "
                f"{info['seq_len']} tokens")
        notes = [f"{counts[k] + info['eval'][k]} pairs {what}" for k, what in
                 (("truncated", "truncated"), ("dropped", "dropped (an answer kept no token)"))
                 if counts[k] + info["eval"][k]]
        line += f" ({', '.join(notes)})" if notes else ""
        if info.get("sources"):  # a mixture: each source's pairs used of available, and share of the tokens
            line += "; " + ", ".join(f"{s['id']} ({s['split']}): {s['examples_used']} of {s['examples_available']} "
                                     f"pairs, {s['token_share']:.0%} of the tokens" for s in info["sources"])
        nodes, processes = info.get("nodes_with_own_rows"), info.get("tokenizing_processes", 1)
        where = f" (and the same pairs by the local main process of {nodes} node(s) with their own datasets cache)" \
            if nodes else ""
        by = f" ({processes} tokenizing processes)" if processes > 1 else ""
        line += (f"; prepared pairs reused from {info['folder']}{where}" if info.get("reused")
                 else f"; pairs prepared in {info['folder']}{by}{where}" if info.get("folder") else "")
        return (f"micro-batch {self.per_device_batch_size} pairs x accumulation {self.gradient_accumulation_steps} x "
                f"{self.world_size} = global batch {self.global_batch_pairs} pairs\n" + line)
