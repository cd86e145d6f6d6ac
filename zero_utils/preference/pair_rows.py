"""The preference-pair row maker of the preparation pipeline (zero_utils.data.preparation): each pair, in the layout
its columns say (`examples.pair_layout`), tokenized as two sequences with the loss on the answers
(`examples.tokenize_pair`, cut to `seq_len` by one rule, `examples.TRUNCATION`), one row per pair in the data's
order (dropped pairs left out). A mixture's sources may each have their own pair layout.

Columns of a split's file: chosen_ids, chosen_labels, rejected_ids, rejected_labels (int32 lists: each sequence and
its shifted labels, IGNORE_INDEX off the answer), chosen_tokens (the chosen answer's loss tokens) and tokens (both
sequences' lengths), int32. They are written WRITE_PAIR_TOKENS tokens at a time. A value per pair computed later (a
reference model's log-probabilities: zero_utils.preference.reference_logps) belongs in a file of its own beside
these, one row per pair in the same order, keyed by what it depends on.
"""

from __future__ import annotations

from array import array
from pathlib import Path

from zero_utils.data.preparation import int32_lists, open_prepared, write_record_batches
from zero_utils.data.sft_examples import IGNORE_INDEX
from zero_utils.preference.examples import TRUNCATION, pair_columns, pair_layout, tokenize_pair

PAIRS_VERSION = 1  # what a file of pairs holds and how it is made; a change prepares every data set again
# Tokens (both answers' sequences) of pairs written per record batch: held as int32 arrays (ids and labels: 8 bytes a
# token) until written, then copied once into Arrow, ~6 MB at most; a reader holds a few KB per record batch.
WRITE_PAIR_TOKENS = 1 << 18
SEQUENCE_COLUMNS = ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels")
COUNT_COLUMNS = ("chosen_tokens", "tokens")


class PairRows:
    """Tokenized preference pairs of at most `seq_len` tokens a sequence, for `preparation.prepare`. Its info
    (`open`): the layout, splits, seq_len, per split {"pairs", "truncated", "dropped"}, the folder and each mixture
    source's share."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def key(self) -> dict:
        return {"kind": "pairs", "seq_len": self.seq_len, "truncation": TRUNCATION, "pairs": PAIRS_VERSION}

    def layout(self, column_names, first_example, column_map) -> str:
        return pair_layout(column_names, first_example, column_map)

    def columns(self, layout, column_map) -> list[str]:
        return pair_columns(layout, column_map)

    def make(self, tokenizer, example: dict, layout: str, column_map):
        """None (a dropped pair) or (truncated, chosen_ids, chosen_labels, rejected_ids, rejected_labels) with int32
        arrays: 4 bytes a token to send back from a worker and to hold."""
        values = [example[c] for c in pair_columns(layout, column_map)]
        pair = tokenize_pair(tokenizer, *([None] if len(values) == 2 else []), *values, self.seq_len)
        return None if pair is None else (pair["truncated"], *(array("i", pair[c]) for c in SEQUENCE_COLUMNS))

    def describe(self, layouts: list[str], mixture: bool) -> str:
        return "preference pairs (a mixture)" if mixture else f"preference pairs ({layouts[0]})"

    def empty(self, sources: int) -> dict:
        return {"pairs": 0, "truncated": 0, "dropped": 0, "tokens_per_source": [0] * sources}

    def check(self, info: dict, named: str) -> None:
        pass  # a preference set without a pair left is refused by PreferenceData (fewer pairs than one batch)

    def write(self, made, examples: int, name: str, folder: Path, layouts: list[str]) -> dict:
        return write_pairs(made, examples, name, self.seq_len, folder, len(layouts))

    def open(self, folder: Path):
        return open_pairs(folder)


def write_pairs(made, total: int, name: str, seq_len: int, folder: Path, sources: int) -> dict:
    """Write one split's tokenized pairs (`made`: (pair or None, source) in order) into `<folder>/<name>.arrow`,
    WRITE_PAIR_TOKENS tokens of pairs at a time. Returns its counts, with "tokens_per_source" (both sequences'
    tokens of each source's pairs)."""
    import pyarrow
    from datasets import Features, Sequence, Value
    from tqdm.auto import tqdm

    features = Features({**{c: Sequence(Value("int32")) for c in SEQUENCE_COLUMNS},
                         **{c: Value("int32") for c in COUNT_COLUMNS}})
    counts = {"pairs": 0, "truncated": 0, "dropped": 0, "tokens_per_source": [0] * sources}

    def table_of(pairs):  # one record batch
        return pyarrow.table({
            **{column: int32_lists([pair[i] for pair in pairs]) for i, column in enumerate(SEQUENCE_COLUMNS)},
            "chosen_tokens": pyarrow.array([sum(label != IGNORE_INDEX for label in pair[1]) for pair in pairs],
                                           type=pyarrow.int32()),
            "tokens": pyarrow.array([len(pair[0]) + len(pair[2]) for pair in pairs], type=pyarrow.int32())})

    def kept():  # the pairs to write, counted
        with tqdm(total=total, unit="pair", desc=f"tokenize {name} pairs to {seq_len}") as progress:
            for pair, source in made:
                progress.update(1)
                if pair is None:
                    counts["dropped"] += 1
                    continue
                tokens = len(pair[1]) + len(pair[3])
                counts["pairs"] += 1
                counts["truncated"] += pair[0]
                counts["tokens_per_source"][source] += tokens
                yield pair[1:], tokens

    write_record_batches(folder / f"{name}.arrow", features, kept(), table_of, WRITE_PAIR_TOKENS)
    return counts


def open_pairs(folder: Path):
    """The prepared pairs of `folder`, memory-mapped: (train, eval or None, info)."""
    train, evaluation, info = open_prepared(folder, "pairs")
    counts = ("pairs", "truncated", "dropped")
    return train, evaluation, {
        **{k: info[k] for k in ("layout", "train_split", "eval_split", "tokenizing_processes")},
        "seq_len": info["depends_on"]["rows"]["seq_len"], "folder": str(folder),
        **{split: {k: info[split][k] for k in counts} for split in ("train", "eval")},
        **({"sources": info["sources"]} if "sources" in info else {})}
