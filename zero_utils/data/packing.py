"""Packing tokenized examples into rows of exactly `seq_len` tokens, in one sequential pass of bounded memory.

`Packer` takes examples one at a time, in order, and hands back each row as soon as it is full: the open row is
carried from one chunk of examples to the next, so a corpus of any size is packed holding one row and one example
at a time. The rule is the greedy one rows were always packed with (an example that does not fit in the open row
starts a new one; examples without a loss token are dropped), so the rows of a dataset do not depend on how it was
chunked.

Two kinds of long inputs:
- an SFT example longer than `seq_len` is truncated to its first `seq_len` tokens (its last label becomes
  IGNORE_INDEX) and counted in `truncated`;
- a document (the `text` layout, `split_long=True`) longer than `seq_len` is split into windows of `seq_len`
  tokens that cover it exactly (concatenated, the windows' input_ids and labels are the document's), each
  with positions restarting at 0, and counted in `split_documents`. Labels are already shifted, so the last
  position of a window still predicts the first token of the next one: no target of the document is lost.

Without packing (`packing=False`, the SFT recipes' --no-packing), every example starts a row of its own, padded to
`seq_len` the same way (the rows a sequence-parallel run or a per-example comparison needs); the long inputs are cut
or split as above, each window its own row.

A row: input_ids, labels, position_ids (restarting at 0 at every example; the padding tail is its own "example"
with no loss), each `seq_len` long, and num_loss_tokens. Pure Python: no torch, no process group.
"""

from __future__ import annotations

from zero_utils.data.sft_examples import IGNORE_INDEX

# Bumped whenever the rows a packer writes change: prepared rows of another version are prepared again.
PACKER_VERSION = 2


class Packer:
    """Greedy sequential packing with the open row carried between calls (see the module docstring).

        packer = Packer(seq_len=2048, pad_token_id=0)
        for example in examples:                                   # any number, in any chunks
            for row in packer.add(example["input_ids"], example["labels"]):
                write(row)
        for row in packer.finish():
            write(row)

    `packing=False`: one example (or document window) per row, padded.
    Counters: `truncated` (SFT examples cut to seq_len), `split_documents` (documents split into windows),
    `examples` (examples added), `rows` (rows handed back), `tokens` (example tokens placed in rows: after
    truncation, without dropped examples and padding)."""

    def __init__(self, seq_len: int, pad_token_id: int, *, packing: bool = True):
        self.seq_len, self.pad_token_id, self.packing = seq_len, pad_token_id, packing
        self.truncated = self.split_documents = self.examples = self.rows = self.tokens = 0
        self._ids: list[int] = []
        self._labels: list[int] = []
        self._positions: list[int] = []

    def add(self, input_ids: list[int], labels: list[int], *, split_long: bool = False) -> list[dict]:
        """Add one example (labels already shifted, as `sft_examples.tokenize_example` makes them); returns the rows
        it completed (usually none or one). `split_long`: a document, split into windows instead of truncated."""
        self.examples += 1
        seq_len, done = self.seq_len, []
        if len(input_ids) > seq_len and split_long:
            self.split_documents += 1
            for start in range(0, len(input_ids), seq_len):
                done += self._place(input_ids[start:start + seq_len], labels[start:start + seq_len])
            return done
        if len(input_ids) > seq_len:
            self.truncated += 1
            input_ids, labels = input_ids[:seq_len], labels[:seq_len - 1] + [IGNORE_INDEX]
        if not any(label != IGNORE_INDEX for label in labels):
            return done
        return self._place(input_ids, labels)

    def finish(self) -> list[dict]:
        """The last, partly filled row (padded), if there is one."""
        return [self._flush()] if self._ids else []

    def _place(self, input_ids: list[int], labels: list[int]) -> list[dict]:
        overflows = len(self._ids) + len(input_ids) > self.seq_len
        done = [self._flush()] if self._ids and (overflows or not self.packing) else []
        self.tokens += len(input_ids)
        self._ids += input_ids
        self._labels += labels
        self._positions += range(len(input_ids))
        if len(self._ids) == self.seq_len:  # a full row goes out now: the open row never holds a finished one
            done.append(self._flush())
        return done

    def _flush(self) -> dict:
        pad = self.seq_len - len(self._ids)
        row = {"input_ids": self._ids + [self.pad_token_id] * pad, "labels": self._labels + [IGNORE_INDEX] * pad,
               "position_ids": self._positions + list(range(pad)),
               "num_loss_tokens": len(self._labels) - self._labels.count(IGNORE_INDEX)}
        self._ids, self._labels, self._positions = [], [], []
        self.rows += 1
        return row


def pack_examples(examples: list[dict], seq_len: int, pad_token_id: int, *, split_long: bool = False
                  ) -> tuple[list[dict], int]:
    """Pack a list of tokenized examples ({"input_ids", "labels"}) with a `Packer`; returns (rows, number of
    truncated examples). For examples already in memory (tests, small probes); preparation streams instead."""
    packer = Packer(seq_len, pad_token_id)
    rows = [row for ex in examples for row in packer.add(ex["input_ids"], ex["labels"], split_long=split_long)]
    return rows + packer.finish(), packer.truncated
