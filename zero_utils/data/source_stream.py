"""Where a preparation's examples come from, in a fixed order: one data set (--dataset with its split, configuration,
revision and --columns) or a weighted mixture (zero_utils.data.mixture), as a train part and an eval part read in
chunks, with what the prepared rows' key needs and, for a mixture, each source's report.

One data set: its train split (`sources.choose_splits`), held-out data from its validation/test split (or the one
--dataset_split names), else `eval_fraction` of its examples split off with `seed` before anything is tokenized (so
no example is in both). A mixture: every source checked to be reachable before any is read
(`sources.check_mixture_reachable`), each loaded as --dataset loads one with its own columns, the weights' draw and
one shuffle with the mixture's seed (`mixture.mixture_order`), its first `test_split_size` examples (else
--eval_fraction of them) held out. Each source keeps its own layout, which the row maker reads from its columns.

A chunk is what a tokenizing worker receives: a dict of columns (one data set: `Dataset.iter`) or two numpy arrays
(a mixture: source and index, 10 bytes an example; the worker reads the rows from the data sets it inherited by
fork). `examples(chunk)` turns either into (source, example) pairs. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero_utils.data.mixture import (
    MIXTURE_VERSION,
    Mixture,
    mixture_in_file,
    mixture_order,
    order_chunks,
    source_report,
)
from zero_utils.data.sources import (
    DataSource,
    check_mixture_reachable,
    choose_splits,
    data_fingerprint,
    load_mixture_source,
    load_raw_dataset,
)
from zero_utils.run.errors import UserError

CHUNK_EXAMPLES = 100  # raw examples read and tokenized at a time


@dataclass
class Source:
    """One loaded source: its name (a --dataset or a mixture's id), train split name, the train split itself, the
    column renames its examples are read with, and its data fingerprint."""

    name: str
    split: str
    data: object  # datasets.Dataset
    column_map: dict
    fingerprint: dict

    def first_example(self) -> dict:
        return self.data[0]


@dataclass
class Part:
    """One split of the stream: how many examples, and a function giving its chunks in order (each read once)."""

    examples: int
    chunks: object  # () -> iterator of chunks


class SourceStream:
    """The examples of one data set or of a mixture, in the order they are prepared (module docstring).

        stream = SourceStream.open(dataset, column_map, eval_fraction=0.05, seed=42)
        stream.key()                      # what the examples depend on (part of the prepared rows' key)
        parts = stream.parts()            # {"train": Part, "eval": Part or None}
        for source, example in stream.examples(chunk): ...

    `sources`: the loaded `Source`s (one for a data set); `mixture`: the `Mixture` or None; `named`: how the
    user named the data, for sentences ("--dataset 'x'" or "the mixture in x.yaml")."""

    def __init__(self, sources: list[Source], *, mixture: Mixture | None, eval_fraction: float, seed: int,
                 raw=None, eval_split: str | None = None):
        self.sources, self.mixture, self.eval_fraction, self.seed = sources, mixture, eval_fraction, seed
        self._raw, self._eval_split = raw, eval_split
        self.named = f"the mixture in {mixture.where}" if mixture else f"--dataset {sources[0].name!r}"
        self.train_split_text = f"{len(sources)} sources" if mixture else repr(sources[0].split)
        self.eval_split_text: str | None = None  # set by parts()
        self._order = None

    @classmethod
    def open(cls, dataset: DataSource | Mixture | str, column_map: dict | None, *, eval_fraction: float,
             seed: int) -> SourceStream:
        """Load `dataset`: a `Mixture`, a `DataSource` or a name (a YAML file holding a dataset_mixture is a
        mixture). `column_map`: --columns, for one data set (a mixture's sources carry their own). `UserError` for a
        source that cannot be reached or loaded, or a data set without examples."""
        if not isinstance(dataset, Mixture):
            name = dataset.name if isinstance(dataset, DataSource) else dataset
            dataset = mixture_in_file(name) or dataset
        if isinstance(dataset, Mixture):
            check_mixture_reachable(dataset)
            loaded = []
            for s in dataset.sources:
                split, data, fingerprint = load_mixture_source(s)
                loaded.append(Source(s.id, split, data, s.column_map(), fingerprint))
            return cls(loaded, mixture=dataset, eval_fraction=eval_fraction, seed=seed)
        source = DataSource(dataset) if isinstance(dataset, str) else dataset
        raw = load_raw_dataset(source)
        train_split, eval_split = choose_splits(raw, source)
        train = raw[train_split]
        if len(train) == 0:
            raise UserError(f"--dataset {source.name!r} has no rows in its {train_split!r} split.")
        one = Source(source.name, train_split, train, column_map or {}, data_fingerprint(source, raw))
        return cls([one], mixture=None, eval_fraction=eval_fraction, seed=seed, raw=raw, eval_split=eval_split)

    def key(self) -> dict:
        """What the examples depend on, JSON-able: the data (fingerprints), the splits or the mixture, the columns,
        the hold-out (fraction, seed) and the mixture order's version."""
        if self.mixture:
            return {"mixture": self.mixture.describe(), "data": [s.fingerprint for s in self.sources],
                    "eval_fraction": self.eval_fraction if self.mixture.test_split_size is None else None,
                    "mixture_order": MIXTURE_VERSION}
        one = self.sources[0]
        return {"data": one.fingerprint, "splits": [one.split, self._eval_split], "columns": one.column_map,
                "eval_fraction": self.eval_fraction, "seed": self.seed}

    def parts(self, columns: list[str] | None = None) -> dict:
        """{"train": Part, "eval": Part or None}, the hold-out made (the main process, once the key is known).
        `columns`: the only columns one data set's chunks read (None: all); a mixture's chunks are indices."""
        if self.mixture:
            source_of, index_of, held_out = mixture_order(self.mixture, [len(s.data) for s in self.sources],
                                                          self.eval_fraction)
            self._order = source_of
            self.eval_split_text = f"{held_out} of the mixture held out" if held_out else None

            def part(start, stop):
                return Part(stop - start, lambda: order_chunks(source_of[start:stop], index_of[start:stop],
                                                               CHUNK_EXAMPLES)) if stop > start else None
            return {"train": part(held_out, len(source_of)), "eval": part(0, held_out)}
        one = self.sources[0]
        train, evaluation = one.data, self._raw[self._eval_split] if self._eval_split else None
        self.eval_split_text = repr(self._eval_split) if self._eval_split else None
        if evaluation is None and self.eval_fraction > 0:
            if len(train) < 2:
                raise UserError(f"{self.named} has {len(train)} example(s): too few to hold out an eval split; add "
                                "data or pass --eval_fraction 0.")
            split = train.train_test_split(test_size=self.eval_fraction, seed=self.seed)
            train, evaluation = split["train"], split["test"]
            self.eval_split_text = f"{self.eval_fraction:g} of {one.split!r} held out"

        def part(data):
            if data is None:
                return None
            return Part(len(data), lambda: (data.select_columns(columns) if columns else data).iter(
                batch_size=CHUNK_EXAMPLES))
        return {"train": part(train), "eval": part(evaluation)}

    def examples(self, chunk):
        """(source index, example dict) of each example in `chunk`, in order (in a worker process, by fork)."""
        if self.mixture:
            for source, index in zip(*chunk, strict=True):
                yield int(source), self.sources[source].data[int(index)]
        else:
            for values in zip(*chunk.values(), strict=True):
                yield 0, dict(zip(chunk, values, strict=True))

    def report(self, tokens: list[int], layouts: list[str]) -> list[dict] | None:
        """A mixture's per-source lines (`mixture.source_report`: examples used of available, `tokens` in the
        prepared rows, their share) with each source's layout; None for one data set."""
        if not self.mixture:
            return None
        lines = source_report(self.mixture, [s.split for s in self.sources], [len(s.data) for s in self.sources],
                              self._order, tokens)
        return [{**line, "layout": layout} for line, layout in zip(lines, layouts, strict=True)]

