"""A dataset mixture: several sources, each weighted, in alignment-handbook's `dataset_mixture` format, read as it is.

    dataset_mixture:                 # a key of a --config file, or of a YAML file given as --dataset (it may be a
      datasets:                      # whole alignment-handbook recipe: its other keys are named as ignored)
        - id: HuggingFaceH4/ultrachat_200k   # a Hub id or any local path --dataset takes
          config: default                    # optional, as --dataset_config
          split: train_sft                   # optional (default train), as --dataset_split's TRAIN
          revision: main                     # optional, as --dataset_revision
          columns: [messages]                # optional: the columns kept, or a rename map {ours: theirs}
          weight: 0.5                        # the fraction of this source's examples used (default 1.0)
      seed: 42                               # the draw of the weights' subsample (default 0)
      test_split_size: 0.1                   # optional: a fraction or a count of the mixture held out

A weight counts as alignment-handbook computes it: `int(weight x available)` examples, the first ones of a seeded
shuffle (`ds.shuffle(seed).select(range(int(len(ds) * weight)))`: numpy's `default_rng(seed).permutation`, as
`datasets` shuffles). Above 1 (our extension; upstream fails there) every example is used floor(weight) times and
int(fraction x available) more are drawn the same way. The draw is made once, before packing, and the mixture's
examples are shuffled together (with the same seed), so a packed row mixes sources.

Checked where the flags are parsed (`check_mixture`), on every rank before any collective: an unknown key (the
closest named), a weight that is not positive, an empty `datasets` list, and single-source flags given with a mixture.
Imports only zero_utils.run.errors.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from zero_utils.run.errors import UserError

MIXTURE_KEYS = ("datasets", "seed", "test_split_size")
SOURCE_KEYS = ("id", "config", "split", "revision", "columns", "weight")
SINGLE_SOURCE_FLAGS = ("dataset_config", "dataset_split", "dataset_revision", "columns")
# How a mixture's order, hold-out and report are made; a change prepares every mixture again. 2: the per-source
# tokens are counted in the rows, after the packer's truncation (1: as tokenized).
MIXTURE_VERSION = 2


@dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture: `id` (a Hub id or a local path), its `config`, `split` (default train), `revision`,
    `columns` (None, the kept columns as a tuple, or a rename map as (ours, theirs) pairs) and `weight`."""

    id: str
    config: str = ""
    split: str = "train"
    revision: str = ""
    columns: tuple | None = None
    weight: float = 1.0

    def column_map(self) -> dict[str, str]:
        """The rename map {ours: theirs} of a `columns` mapping (empty for a list of kept columns or none)."""
        return dict(self.columns) if self.columns and isinstance(self.columns[0], tuple) else {}

    def kept_columns(self) -> list[str] | None:
        """The columns a `columns` list keeps (None: all of them)."""
        return list(self.columns) if self.columns and not isinstance(self.columns[0], tuple) else None


@dataclass(frozen=True)
class Mixture:
    """A parsed `dataset_mixture`: its sources, the draw's `seed` and `test_split_size` (a fraction, a count, or
    None: no mixture-level hold-out, --eval_fraction then applies)."""

    sources: tuple[MixtureSource, ...]
    seed: int = 0
    test_split_size: float | int | None = None
    where: str = ""

    def describe(self) -> dict:
        """A JSON-able description: part of the prepared rows' key and of the tracker's config."""
        return {"datasets": [{"id": s.id, "config": s.config, "split": s.split, "revision": s.revision,
                              "columns": [list(c) if isinstance(c, tuple) else c for c in s.columns or ()],
                              "weight": s.weight} for s in self.sources],
                "seed": self.seed, "test_split_size": self.test_split_size}


def _unknown(key, known, where: str) -> UserError:
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return UserError(f"{where}: {key!r} is not a key of a dataset mixture{hint}; the keys are "
                     f"{', '.join(known)}.")


def parse_mixture(value, where: str) -> Mixture:
    """The `dataset_mixture` mapping `value` (from the file `where`) as a `Mixture`; `UserError` naming the problem:
    an unknown key (the closest named), no `datasets` or an empty list, a source without `id`, a weight that is not
    a positive number, `columns` that are neither a list nor a mapping, a `test_split_size` that is not a positive
    fraction below 1 or a count."""
    if not isinstance(value, dict):
        raise UserError(f"{where}: dataset_mixture must be a mapping with a `datasets` list, not a "
                        f"{type(value).__name__}.")
    for key in value:
        if key not in MIXTURE_KEYS:
            raise _unknown(key, MIXTURE_KEYS, where)
    entries = value.get("datasets")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{where}: dataset_mixture has no datasets; list at least one under `datasets:` "
                        "(each with an `id`).")
    sources = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "id" not in entry:
            raise UserError(f"{where}: dataset_mixture's source {i + 1} has no `id`; give each source `id: <Hub id "
                            "or path>`.")
        for key in entry:
            if key not in SOURCE_KEYS:
                raise _unknown(key, SOURCE_KEYS, f"{where}, source {entry['id']!r}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise UserError(f"{where}: source {entry['id']!r} has weight {weight!r}; a weight is a positive number "
                            "(the fraction of its examples used; above 1, each example repeated).")
        columns = entry.get("columns")
        if isinstance(columns, dict):
            columns = tuple((str(ours), str(theirs)) for ours, theirs in columns.items())
        elif isinstance(columns, list) and columns:
            columns = tuple(str(c) for c in columns)
        elif columns is not None:
            raise UserError(f"{where}: source {entry['id']!r} has columns {columns!r}; give a list of the columns "
                            "to keep, or a mapping of our names to the data's (prompt: question).")
        sources.append(MixtureSource(id=str(entry["id"]), config=str(entry.get("config") or ""),
                                     split=str(entry.get("split") or "train"),
                                     revision=str(entry.get("revision") or ""), columns=columns,
                                     weight=float(weight)))
    size = value.get("test_split_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0
                             or (isinstance(size, float) and size >= 1)):
        raise UserError(f"{where}: test_split_size {size!r} is neither a fraction in (0, 1) nor a count of "
                        "examples; write e.g. 0.1 or 2000.")
    seed = value.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UserError(f"{where}: seed {seed!r} is not an integer.")
    return Mixture(tuple(sources), seed, size, where)


def mixture_in_file(path: str, *, announce: bool = False) -> Mixture | None:
    """The mixture of a YAML file given as --dataset (a `dataset_mixture` key, as in an alignment-handbook recipe),
    or None for a file that is not YAML or has no such key. `announce`: print that its other keys are ignored (where
    the flags are parsed, once; not for the --config file itself, whose other keys are recipe flags)."""
    import yaml

    file = Path(path).expanduser()
    if file.suffix not in (".yaml", ".yml") or not file.is_file():
        return None
    try:
        values = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as error:
        raise UserError(f"--dataset {path} is not valid YAML ({str(error).splitlines()[0]}); fix the file.") from None
    if not isinstance(values, dict) or "dataset_mixture" not in values:
        return None
    ignored = sorted(str(k) for k in values if k != "dataset_mixture")
    if ignored and announce:
        print(f"--dataset {path}: its dataset_mixture is read; {', '.join(ignored)} ignored (recipe flags set "
              "the run).")
    return parse_mixture(values["dataset_mixture"], path)


def check_mixture(dataset: str, given_flags: set[str], eval_fraction_given: bool, *,
                  from_config: bool = False) -> Mixture | None:
    """Where the flags are parsed: the mixture `--dataset` names (None for one source), checked (`parse_mixture`)
    and refused with single-source flags given on the command line or in --config (`given_flags`: their names),
    and with --eval_fraction when the mixture holds out its own `test_split_size`. `from_config`: the mixture is
    the --config file's own (its other keys are flags, not ignored)."""
    mixture = mixture_in_file(dataset, announce=not from_config)
    if mixture is None:
        return None
    clashing = [f"--{name}" for name in SINGLE_SOURCE_FLAGS if name in given_flags]
    if clashing:
        raise UserError(f"{' and '.join(clashing)} name one data set, but --dataset {dataset} is a mixture; set them "
                        "per source in its dataset_mixture (config, split, revision, columns) instead.")
    if eval_fraction_given and mixture.test_split_size is not None:
        raise UserError(f"--eval_fraction and the mixture's test_split_size both say what to hold out; drop one "
                        f"(the mixture in {dataset} holds out {mixture.test_split_size}).")
    return mixture


def drawn_indices(available: int, weight: float, seed: int) -> list[int]:
    """The examples (indices into `available`) a source of `weight` contributes, as alignment-handbook draws them:
    weight <= 1: the first int(weight x available) of `numpy.random.default_rng(seed).permutation(available)`;
    above 1: every example floor(weight) times, then the first int(fraction x available) of that permutation."""
    import numpy as np

    whole, fraction = (int(weight), weight - int(weight)) if weight > 1 else (0, weight)
    permutation = np.random.default_rng(seed).permutation(available)
    return list(range(available)) * whole + permutation[:int(fraction * available)].tolist()


def mixture_order(mixture: Mixture, available: list[int], eval_fraction: float):
    """The examples of `mixture` in training order, given each source's `available` count: (source, index), two
    numpy arrays (int16, int64: 10 bytes an example), every source's `drawn_indices` shuffled together with the
    mixture's seed; and how many of the first are held out (`test_split_size`: a count, or a fraction of them; else
    `eval_fraction`). `UserError` when nothing would be left to train on."""
    import numpy as np

    drawn = [np.asarray(drawn_indices(n, s.weight, mixture.seed), dtype=np.int64)
             for s, n in zip(mixture.sources, available, strict=True)]
    source_of = np.concatenate([np.full(len(d), i, dtype=np.int16) for i, d in enumerate(drawn)])
    order = np.random.default_rng(mixture.seed).permutation(len(source_of))
    size = mixture.test_split_size
    held_out = size if isinstance(size, int) else int(len(order) * (size if size else eval_fraction))
    if held_out >= len(order):
        raise UserError(f"the mixture in {mixture.where} has {len(order)} examples, not more than the {held_out} it "
                        "would hold out; lower test_split_size or --eval_fraction.")
    return source_of[order], np.concatenate(drawn)[order], held_out


def order_chunks(sources, indices, size: int):
    """The (sources, indices) slices of `size` examples of a `mixture_order` part, in order: the chunks a
    preparation tokenizes at a time."""
    return ((sources[i:i + size], indices[i:i + size]) for i in range(0, len(indices), size))


def source_report(mixture: Mixture, splits: list[str], available: list[int], source_of, tokens: list[int]) -> list:
    """Each source's line of a prepared mixture's info: its id, split, weight, examples used (in `source_of`, the
    whole order) of `available`, its `tokens` (in the rows or pairs, after truncation) and share of the mixture's."""
    import numpy as np

    used = np.bincount(source_of, minlength=len(mixture.sources))
    return [{"id": s.id, "split": split, "weight": s.weight, "examples_used": int(used[i]),
             "examples_available": available[i], "tokens": tokens[i], "token_share": tokens[i] / max(1, sum(tokens))}
            for i, (s, split) in enumerate(zip(mixture.sources, splits, strict=True))]
