"""The SFT row maker of the preparation pipeline (zero_utils.data.preparation): each example tokenized with its loss
mask (`sft_examples.tokenize_example`, in the layout its columns say) and packed into rows of exactly `seq_len`
tokens by one sequential `packing.Packer`, or with `packing=False` (the SFT recipes' --no-packing) one example per
row, padded. A mixture's sources may each have their own layout; a document (the text layout) longer than `seq_len`
is split into windows, any other example truncated.

Columns of a split's file, one row each: input_ids, labels, position_ids (int32 lists of `seq_len`; labels already
shifted, IGNORE_INDEX off the answer) and num_loss_tokens (int32). The finished rows are written WRITE_TOKENS tokens
at a time from buffers allocated once (int32, 12 bytes a token), so memory stays flat whatever the corpus. Token ids
are stored as int32 (half of int64 on disk; they become int64 tensors at batching time).
"""

from __future__ import annotations

from array import array
from pathlib import Path

from zero_utils.data.packing import PACKER_VERSION, Packer
from zero_utils.data.preparation import open_prepared
from zero_utils.data.sft_examples import detect_layout, to_messages, tokenize_example
from zero_utils.run.errors import UserError

WRITE_TOKENS = 1 << 20  # tokens of rows per record batch (buffered as int32, 12 bytes a token: ~12.6 MB); every
# rank opening the rows holds a few KB per record batch of the file (pyarrow's table of batches), so fewer is better
ROW_COLUMNS = ("input_ids", "labels", "position_ids")


class SFTRows:
    """Packed SFT rows of `seq_len` tokens padded with `pad_token_id` (`packing=False`: one example per row), for
    `preparation.prepare`. Its info (`open`): the layout, splits, example, row, truncation and split-document
    counts, max_token_id, packing, the folder and each mixture source's share."""

    def __init__(self, seq_len: int, pad_token_id: int, *, packing: bool = True):
        self.seq_len, self.pad_token_id, self.packing = seq_len, pad_token_id, packing

    def key(self) -> dict:
        return {"kind": "sft rows", "seq_len": self.seq_len, "pad_token_id": self.pad_token_id,
                "packing": self.packing, "packer": PACKER_VERSION}

    def layout(self, column_names, first_example, column_map) -> str:
        return detect_layout(column_names, column_map)

    def columns(self, layout, column_map) -> None:
        return None  # every column: an Alpaca example's input column is optional

    def make(self, tokenizer, example: dict, layout: str, column_map) -> tuple:
        tokens = tokenize_example(tokenizer, to_messages(example, layout, column_map))
        return array("i", tokens["input_ids"]), array("i", tokens["labels"])

    def describe(self, layouts: list[str], mixture: bool) -> str:
        return "mixture of " + ", ".join(sorted(set(layouts))) if mixture else layouts[0]

    def empty(self, sources: int) -> dict:
        return {"examples": 0, "rows": 0, "truncated": 0, "split_documents": 0, "max_token_id": 0,
                "tokens_per_source": [0] * sources}

    def check(self, info: dict, named: str) -> None:
        if info["train"]["rows"] == 0:
            raise UserError(f"{named} yields no trainable tokens after formatting; check its columns and contents.")

    def write(self, made, examples: int, name: str, folder: Path, layouts: list[str]) -> dict:
        return pack_rows(((ids.tolist(), labels.tolist(), source) for (ids, labels), source in made), examples,
                         name, self.seq_len, self.pad_token_id, folder, [layout == "text" for layout in layouts],
                         packing=self.packing)

    def open(self, folder: Path):
        return open_rows(folder)


def pack_rows(stream, total: int, name: str, seq_len: int, pad_token_id: int, folder: Path,
              split_long: list[bool], *, packing: bool = True) -> dict:
    """Pack one split's tokenized examples (`stream` of (input_ids, labels, source): `source` indexes `split_long`,
    whether that source's long examples are split into windows, as documents are, instead of truncated) in one
    sequential pass (`packing=False`: one example per row), WRITE_TOKENS tokens of rows at a time; write
    `<folder>/<name>.arrow`. `total`: the examples, for the progress bar. Returns its counts, with
    "tokens_per_source" (per source, its tokens in the rows: after the packer's truncation, without the examples it
    dropped)."""
    import numpy as np
    import pyarrow
    from datasets import Features, Sequence, Value
    from datasets.arrow_writer import ArrowWriter
    from tqdm.auto import tqdm

    features = Features({**{c: Sequence(Value("int32")) for c in ROW_COLUMNS}, "num_loss_tokens": Value("int32")})
    packer, max_token_id = Packer(seq_len, pad_token_id, packing=packing), 0
    pool = pyarrow.default_memory_pool()
    write_rows = max(1, WRITE_TOKENS // seq_len)
    writer = ArrowWriter(features=features, path=str(folder / f"{name}.arrow"), writer_batch_size=write_rows)
    # the rows waiting to be written, in buffers allocated once (int32, 12 bytes a token): nothing grows or is freed
    waiting = {c: np.empty((write_rows, seq_len), dtype=np.int32) for c in ROW_COLUMNS}
    waiting_loss_tokens, count = np.empty(write_rows, dtype=np.int32), 0

    def write(rows, final=False):
        nonlocal count
        for row in rows:
            for column in ROW_COLUMNS:
                waiting[column][count] = row[column]
            waiting_loss_tokens[count] = row["num_loss_tokens"]
            count += 1
            if count == write_rows:
                flush()
        if final and count:
            flush()

    def flush():  # one record batch of `count` rows
        nonlocal count
        offsets = pyarrow.array(np.arange(count + 1, dtype=np.int32) * seq_len)
        writer.write_table(pyarrow.table(
            {**{c: pyarrow.ListArray.from_arrays(offsets, waiting[c][:count].reshape(-1)) for c in ROW_COLUMNS},
             "num_loss_tokens": waiting_loss_tokens[:count]}))
        count = 0
        pool.release_unused()  # Arrow's allocator keeps freed blocks: give them back, or they grow with the corpus

    tokens_per_source = [0] * len(split_long)
    with tqdm(total=total, unit="ex", desc=f"tokenize and {'pack' if packing else 'pad'} {name} to {seq_len}") \
            as progress:
        for input_ids, labels, source in stream:
            max_token_id = max(max_token_id, max(input_ids, default=0))
            placed = packer.tokens
            write(packer.add(input_ids, labels, split_long=split_long[source]))
            tokens_per_source[source] += packer.tokens - placed
            progress.update(1)
    write(packer.finish(), final=True)
    writer.finalize()
    writer.close()
    return {"examples": packer.examples, "rows": packer.rows, "truncated": packer.truncated,
            "split_documents": packer.split_documents, "max_token_id": max_token_id,
            "tokens_per_source": tokens_per_source}


def open_rows(folder: Path):
    """The prepared rows of `folder`, memory-mapped: (train, eval or None, info). `UserError` when this rank does not
    see the folder (another node without the shared `datasets` cache)."""
    train, evald, info = open_prepared(folder, "rows")
    columns = list(ROW_COLUMNS)  # int32 on disk, int64 tensors when read; num_loss_tokens stays in `.data`
    train = train.with_format("torch", columns=columns)
    evald = evald.with_format("torch", columns=columns) if evald is not None else None
    summary = {"layout": info["layout"], "chat_template": info["chat_template"], "folder": str(folder),
               "train_split": info["train_split"], "eval_split": info["eval_split"],
               "train_examples": info["train"]["examples"], "eval_examples": info["eval"]["examples"],
               "train_rows": info["train"]["rows"], "eval_rows": info["eval"]["rows"],
               "truncated_examples": info["train"]["truncated"] + info["eval"]["truncated"],
               "split_documents": info["train"]["split_documents"] + info["eval"]["split_documents"],
               "max_token_id": max(info["train"]["max_token_id"], info["eval"]["max_token_id"]),
               "tokenizing_processes": info.get("tokenizing_processes", 1), "packing": info["depends_on"]["rows"][
                   "packing"]}
    if info.get("sources"):  # a mixture: each source's share
        summary["sources"] = info["sources"]
    return train, evald, summary
