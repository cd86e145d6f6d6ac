"""A preference run's data: pairs of answers to one prompt, the chosen and the rejected, tokenized with the chat
template as supervised fine-tuning does (zero_utils.sft_examples: loss on the answer's tokens only) and dealt to
the ranks a global batch of pairs at a time.

Layouts, detected from the columns and their values (`--columns prompt=question,chosen=good,rejected=bad` renames a
data set's; other columns, such as scores, are ignored):

    pairs                        prompt, chosen, rejected: strings
    conversational               chosen, rejected: lists of chat messages; prompt: a string or messages, and the
                                 lists may start with it (UltraFeedback-binarized stores [user, assistant])
    conversational, shared turns chosen, rejected: lists of messages, no prompt column: the prompt is their shared
                                 leading turns (as Anthropic HH stores them)

Any source `--dataset` takes (zero_utils.data_sources); splits as for SFT: the data set's eval split, else
`--eval_fraction` of the pairs held out.

Truncation, one rule: each of a pair's two sequences (prompt + answer) is cut to its first `--seq_len` tokens, so a
long answer loses its tail and a long prompt its answer; a pair in which either answer keeps no token (or has no
turn of its own) is dropped.
The data line counts both. Pairs are not packed: a micro-batch of b pairs is 2b rows, the b chosen sequences then
the b rejected ones in the same order, right-padded to the longest with an attention mask, so a pair's two answers
are always in the same micro-batch on the same rank and no token attends to another example.

The loss of a step is the mean over the global batch's pairs, so `StepPairs` carries the global pair count and the
global batch's chosen answer tokens (for `--sft_weight`), known on every rank without a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from zero_utils.data import MicroBatch, check_seq_len, global_batch_indices, pad_token_id_within, rank_rows
from zero_utils.data_sources import DataSource, choose_splits, load_raw_dataset
from zero_utils.errors import UserError
from zero_utils.sft_examples import IGNORE_INDEX, parse_column_map, tokenize_example

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
BUNDLED_PREFERENCES = str(Path(__file__).resolve().parent / "assets" / "dpo_tiny.jsonl")  # tools/make_assets.py


def parse_pair_columns(spec: str) -> dict[str, str]:
    """`--columns` ("prompt=question,chosen=good") -> {"prompt": "question", "chosen": "good"}."""
    return parse_column_map(spec, PAIR_COLUMNS, "prompt=question,chosen=good,rejected=bad")


LAYOUTS = ("pairs", "conversational", "conversational, shared turns")


def pair_layout(column_names: list[str], first_row: dict, column_map: dict[str, str]) -> str:
    """The layout (module docstring) of a preference set from its columns and first row; a `UserError` naming the
    columns found when it has none of them."""
    col = {c: column_map.get(c, c) for c in PAIR_COLUMNS}
    has = {c: col[c] in column_names for c in PAIR_COLUMNS}
    if has["chosen"] and has["rejected"]:
        conversational = isinstance(first_row[col["chosen"]], list)
        if has["prompt"]:
            return "conversational" if conversational else "pairs"
        if conversational:
            return "conversational, shared turns"
    missing = [c for c in PAIR_COLUMNS if not has[c]]
    raise UserError(f"the dataset has columns {sorted(column_names)} but a preference set needs prompt, chosen and "
                    f"rejected (missing: {', '.join(missing)}; chosen and rejected as chat messages may leave the "
                    "prompt out); name yours with --columns, e.g. --columns prompt=question,chosen=good,rejected=bad.")


def _messages(value, role: str) -> list[dict]:
    return [{"role": role, "content": value}] if isinstance(value, str) else \
        [{"role": m["role"], "content": m["content"]} for m in value]


def split_pair(prompt, chosen, rejected) -> tuple[list[dict], list[dict], list[dict]] | None:
    """(prompt messages, chosen answer messages, rejected answer messages) of one pair in any layout. A string
    prompt is one user turn and a string answer one assistant turn; answers that start with the prompt's messages
    have them removed; without a prompt (None) the prompt is the turns both answers start with. None when an answer
    has no turn of its own."""
    chosen, rejected = _messages(chosen, "assistant"), _messages(rejected, "assistant")
    if prompt is None:
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt_messages = chosen[:shared]
    else:
        prompt_messages = _messages(prompt, "user")
    answers = [answer[len(prompt_messages):] if answer[:len(prompt_messages)] == prompt_messages else answer
               for answer in (chosen, rejected)]
    if not prompt_messages or not all(answers):
        return None
    return prompt_messages, *answers


def tokenize_pair(tokenizer, prompt, chosen, rejected, seq_len: int) -> dict | None:
    """One pair (strings or chat messages, `split_pair`) as two token sequences with shifted labels (IGNORE_INDEX
    off the answer), each cut to `seq_len` tokens; None when an answer keeps no token. Keys: chosen_ids,
    chosen_labels, rejected_ids, rejected_labels (lists of ints) and truncated (bool)."""
    split = split_pair(prompt, chosen, rejected)
    if split is None:
        return None
    prompt_messages, *answers = split
    pair, truncated = {}, False
    for name, answer in zip(("chosen", "rejected"), answers, strict=True):
        example = tokenize_example(tokenizer, prompt_messages + answer, train_from=len(prompt_messages))
        ids, labels = example["input_ids"], example["labels"]
        if len(ids) > seq_len:
            truncated = True
            ids, labels = ids[:seq_len], labels[:seq_len - 1] + [IGNORE_INDEX]  # the last target lies beyond
        if all(label == IGNORE_INDEX for label in labels):
            return None
        pair[f"{name}_ids"], pair[f"{name}_labels"] = ids, labels
    return {**pair, "truncated": truncated}


def tokenize_pairs(tokenizer, raw, column_map: dict[str, str], seq_len: int, layout: str) -> tuple[list[dict], dict]:
    """Every pair of `raw` (a `datasets.Dataset` of `layout`) tokenized: (pairs, {"pairs", "truncated",
    "dropped"})."""
    pairs, truncated, dropped = [], 0, 0
    names = PAIR_COLUMNS if layout != "conversational, shared turns" else PAIR_COLUMNS[1:]
    columns = [column_map.get(c, c) for c in names]
    for row in raw.select_columns(columns):
        values = [row[c] for c in columns]
        pair = tokenize_pair(tokenizer, *([None] if len(values) == 2 else []), *values, seq_len)
        if pair is None:
            dropped += 1
            continue
        truncated += pair.pop("truncated")
        pairs.append(pair)
    return pairs, {"pairs": len(pairs), "truncated": truncated, "dropped": dropped}


@dataclass
class StepPairs:
    """What one optimizer step trains on this rank: its micro-batches of pairs (`MicroBatch` of 2b rows, chosen
    then rejected) and, for the whole global batch, the pair count and the chosen answers' token count."""

    micro_batches: list[MicroBatch]
    pairs: int
    chosen_tokens: int


class PreferenceData:
    """A preference run's pairs, tokenized once, sliced per optimizer step into this rank's micro-batches of
    `per_device_batch_size` pairs (global batch = pairs per device x accumulation x processes, in the data order of
    `data.global_batch_indices`). Every rank tokenizes every pair (the main process loads the files first).

        data = PreferenceData.prepare(accelerator, tokenizer, model_config, dataset=..., seq_len=..., ...)
        batches = data.step_batches(step)      # this rank's micro-batches, the global pair and chosen-token counts
        for micro, weights in data.eval_batches(): ...   # weights: 1 per held-out pair, 0 for filler pairs
    Engines: all."""

    ignore_index = IGNORE_INDEX

    def __init__(self, train: list[dict], evaluation: list[dict], info: dict, *, per_device_batch_size: int,
                 gradient_accumulation_steps: int, seed: int, pad_token_id: int, rank: int, world_size: int, device):
        self.train, self.evaluation, self.info = train, evaluation, info
        self.per_device_batch_size = per_device_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.seed, self.pad_token_id, self.rank, self.world_size = seed, pad_token_id, rank, world_size
        self.device = device
        self.global_batch_pairs = per_device_batch_size * gradient_accumulation_steps * world_size
        if len(train) < self.global_batch_pairs:
            raise UserError(f"the training data has {len(train)} pairs, fewer than one global batch "
                            f"({self.global_batch_pairs} = pairs per device x accumulation x processes); use more "
                            "data or a smaller batch.")
        self._chosen_tokens = torch.tensor([sum(label != IGNORE_INDEX for label in p["chosen_labels"]) for p in train])
        lengths = [len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in train]
        self.tokens_per_step = round(sum(lengths) / len(lengths) * self.global_batch_pairs)  # mean, unpadded

    @classmethod
    def prepare(cls, accelerator, tokenizer, model_config, *, dataset: DataSource, columns: str, seq_len: int,
                eval_fraction: float, seed: int, per_device_batch_size: int,
                gradient_accumulation_steps: int) -> PreferenceData:
        """Load `dataset` (the main process first: it converts the files once), check its columns, hold out the
        eval pairs and tokenize both splits on every rank."""
        check_seq_len(seq_len, model_config.max_position_embeddings)
        column_map = parse_pair_columns(columns)
        with accelerator.main_process_first():
            raw = load_raw_dataset(dataset)
        train_split, eval_split = choose_splits(raw, dataset)
        train_raw, eval_raw = raw[train_split], raw[eval_split] if eval_split else None
        if len(train_raw) == 0:
            raise UserError(f"--dataset {dataset.name!r} has no rows in its {train_split!r} split.")
        layout = pair_layout(train_raw.column_names, train_raw[0], column_map)
        if eval_raw is None and eval_fraction > 0:
            held_out = train_raw.train_test_split(test_size=eval_fraction, seed=seed)
            train_raw, eval_raw = held_out["train"], held_out["test"]
            eval_split = f"{eval_fraction:g} of {train_split!r} held out"
        elif eval_split:
            eval_split = repr(eval_split)
        train, train_counts = tokenize_pairs(tokenizer, train_raw, column_map, seq_len, layout)
        evaluation, eval_counts = tokenize_pairs(tokenizer, eval_raw, column_map, seq_len, layout) \
            if eval_raw is not None else ([], {"pairs": 0, "truncated": 0, "dropped": 0})
        info = {"layout": f"preference pairs ({layout})", "train_split": repr(train_split), "eval_split": eval_split,
                "train": train_counts, "eval": eval_counts, "seq_len": seq_len}
        return cls(train, evaluation, info, per_device_batch_size=per_device_batch_size,
                   gradient_accumulation_steps=gradient_accumulation_steps, seed=seed,
                   pad_token_id=pad_token_id_within(tokenizer, model_config.vocab_size),
                   rank=accelerator.process_index, world_size=accelerator.num_processes, device=accelerator.device)

    @property
    def has_eval(self) -> bool:
        return bool(self.evaluation)

    def step_batches(self, step: int) -> StepPairs:
        """This rank's micro-batches of optimizer step `step` (1-based) and the global batch's counts."""
        indices = global_batch_indices(len(self.train), self.global_batch_pairs, step, self.seed)
        mine = rank_rows(indices, self.rank, self.world_size, self.per_device_batch_size,
                         self.gradient_accumulation_steps)
        return StepPairs([self.micro_batch([self.train[i] for i in rows]) for rows in mine], len(indices),
                         int(self._chosen_tokens[indices].sum()))

    def eval_batches(self):
        """(micro-batch, weights) of this rank's held-out pairs, strided over ranks; every rank yields as many
        (a sharded forward never waits on a finished rank): filler pairs repeat pair 0 with weight 0."""
        mine = list(range(self.rank, len(self.evaluation), self.world_size))
        per_rank = -(-len(self.evaluation) // self.world_size)
        for start in range(0, per_rank, self.per_device_batch_size):
            chunk = mine[start:start + self.per_device_batch_size] or [None]
            weights = torch.tensor([0.0 if i is None else 1.0 for i in chunk], device=self.device)
            yield self.micro_batch([self.evaluation[0 if i is None else i] for i in chunk]), weights

    def micro_batch(self, pairs: list[dict]) -> MicroBatch:
        """2 x len(pairs) rows (chosen sequences, then rejected), right-padded to the longest, with their mask."""
        sequences = [(p[f"{side}_ids"], p[f"{side}_labels"]) for side in ("chosen", "rejected") for p in pairs]
        length = max(len(ids) for ids, _ in sequences)
        input_ids = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(sequences), length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, (ids, row_labels) in enumerate(sequences):
            input_ids[row, :len(ids)], labels[row, :len(ids)], mask[row, :len(ids)] = (
                torch.tensor(ids), torch.tensor(row_labels), 1)
        inputs = {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device), "use_cache": False}
        return MicroBatch(inputs, labels.to(self.device))

    def describe(self) -> str:
        """The batch arithmetic and the pairs, in two lines for the start of a run."""
        info, counts = self.info, self.info["train"]
        line = (f"data: {info['layout']} (train: {info['train_split']}, eval: {info['eval_split'] or 'none'}), "
                f"{counts['pairs']} train / {info['eval']['pairs']} eval pairs, each answer with its prompt cut to "
                f"{info['seq_len']} tokens")
        notes = [f"{counts[k] + info['eval'][k]} pairs {what}" for k, what in
                 (("truncated", "truncated"), ("dropped", "dropped (an answer kept no token)"))
                 if counts[k] + info["eval"][k]]
        return (f"micro-batch {self.per_device_batch_size} pairs x accumulation {self.gradient_accumulation_steps} x "
                f"{self.world_size} = global batch {self.global_batch_pairs} pairs\n"
                + line + (f" ({', '.join(notes)})" if notes else ""))
