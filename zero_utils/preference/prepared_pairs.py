"""Preference pairs prepared once per job, in bounded memory, and kept: load -> split -> tokenize -> Arrow, as
zero_utils.data.prepared_rows does for SFT rows (and with its machinery: `prepare_once`, `prepared_folder`,
`forked_map`).

The main process prepares (or each node's local main process, on a node that does not see the main process's
`datasets` cache) while every other rank waits outside collectives; the others open the result by its path and never
tokenize. The raw pairs are read CHUNK_EXAMPLES at a time, each pair tokenized (`examples.tokenize_pair`;
with --num_proc N by N forked workers) and written, WRITE_PAIR_TOKENS tokens at a time, into an Arrow file by
`datasets`' own `ArrowWriter`, which every rank memory-maps (`Dataset.from_file`: page cache, not process memory).

Where: `<datasets cache>/zero_recipes_rows/<key>/` (beside the SFT rows), holding train.arrow, eval.arrow (when there
are held-out pairs) and info.json, written last. The key hashes what the pairs depend on: the data (as for the SFT
rows), the splits, --columns, the layout, the tokenizer (its full serialisation) and chat template, seq_len and the
truncation rule, the eval fraction, the seed, and PAIRS_VERSION. A relaunch with the same key reuses the pairs and
says so in the data line.

Columns of a split's file, one row per pair in the data's order (dropped pairs left out): chosen_ids,
chosen_labels, rejected_ids, rejected_labels (int32 lists: each sequence and its shifted labels, IGNORE_INDEX off
the answer), chosen_tokens (the chosen answer's loss tokens) and tokens (both sequences' lengths), int32. A value
per pair computed later (a reference model's log-probabilities) belongs in a file of its own beside these, one row
per pair in the same order, keyed by what it depends on; `open_pairs` would join it column-wise.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path

from zero_utils.data.cache import hold
from zero_utils.data.mixture import mixture_in_file, mixture_order, order_chunks, source_report
from zero_utils.data.prepared_rows import (
    CHUNK_EXAMPLES,
    PARALLEL_MIN_EXAMPLES,
    WRITE_TOKENS,
    default_num_proc,
    forked_map,
    prepare_once,
    prepared_folder,
    rows_cache_root,
    tokenizer_fingerprint,
    working_processes,
)
from zero_utils.data.sources import (
    DataSource,
    check_mixture_reachable,
    choose_splits,
    data_fingerprint,
    load_mixture_source,
    load_raw_dataset,
)
from zero_utils.preference.examples import TRUNCATION, pair_columns, pair_layout, tokenize_pair
from zero_utils.run.errors import UserError

PAIRS_VERSION = 1  # what a file of pairs holds and how it is made; a change prepares every data set again
# Tokens (both answers' sequences) of pairs written per record batch: held as int32 arrays (ids and labels: 8 bytes a
# token) until written, then copied once into Arrow, ~6 MB at most; a reader holds a few KB per record batch.
WRITE_PAIR_TOKENS = WRITE_TOKENS // 4
SEQUENCE_COLUMNS = ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels")
COUNT_COLUMNS = ("chosen_tokens", "tokens")


def prepare_pairs(accelerator, tokenizer, dataset: DataSource | str, *, seq_len: int, eval_fraction: float,
                  seed: int, column_map: dict[str, str], cache_root: Path | None = None, num_proc: int = 0):
    """Prepare (or reuse) the tokenized pairs of `dataset` once per job; return (train, eval, info) on every rank.

    train/eval: memory-mapped `datasets.Dataset`s of the columns above; eval is None without held-out pairs (the
    split --dataset_split names, else the data set's validation/test split, else `eval_fraction` of the pairs,
    split before tokenizing with `seed`). info: the layout, splits, seq_len, per split {"pairs", "truncated",
    "dropped"}, the folder, `reused`, `prepared_on` ("main" or "node"), `nodes_with_own_rows`,
    `tokenizing_processes` and `cache_files_written` (pair files this rank wrote: 0 off the preparing process and
    on reuse). `num_proc`: processes that tokenize (0 = `prepared_rows.default_num_proc()`); the pairs are the same
    for any value. Every rank must call it. Engines: all."""
    root = Path(cache_root or rows_cache_root())

    mixture = mixture_in_file(dataset.name if isinstance(dataset, DataSource) else dataset)

    def prepare():
        if mixture is not None:  # several weighted pair sets (zero_utils.data.mixture)
            return _prepare_mixture(tokenizer, mixture, seq_len, eval_fraction, root, num_proc or default_num_proc())
        return _prepare(tokenizer, dataset, seq_len, eval_fraction, seed, column_map, root,
                        num_proc or default_num_proc())

    return prepare_once(accelerator, prepare, open_pairs, root, what="the preparation of the preference pairs")


def open_pairs(folder: Path):
    """The prepared pairs of `folder`, memory-mapped: (train, eval or None, info)."""
    from datasets import Dataset

    if not (folder / "info.json").is_file():
        raise UserError(f"this rank cannot see the prepared pairs in {folder} (the main process wrote them): on "
                        "several nodes, set HF_DATASETS_CACHE to a folder every node shares.")
    hold(folder)  # never pruned while this job runs
    info = json.loads((folder / "info.json").read_text())
    train = Dataset.from_file(str(folder / "train.arrow"))
    evaluation = Dataset.from_file(str(folder / "eval.arrow")) if info["eval"]["pairs"] else None
    keys = ("layout", "train_split", "eval_split", "seq_len", "train", "eval", "tokenizing_processes")
    return train, evaluation, {**{k: info[k] for k in keys}, "folder": str(folder),
                               **({"sources": info["sources"]} if "sources" in info else {})}


def _prepare_mixture(tokenizer, mixture, seq_len, eval_fraction, cache_root: Path, num_proc: int) -> dict:
    """A mixture of pair sets, as zero_utils.data.prepared_mixture prepares SFT rows: each source with its own pair
    layout and columns, the weights' draw and one shuffle with the mixture's seed, the held-out pairs first; every
    source is checked to be reachable before any is read."""
    check_mixture_reachable(mixture)
    loaded = []
    for s in mixture.sources:
        split, data, fingerprint = load_mixture_source(s)
        layout = pair_layout(data.column_names, data[0], s.column_map())
        loaded.append((s, split, data, pair_columns(layout, s.column_map()), fingerprint))
    depends_on = {"mixture": mixture.describe(), "data": [f for *_, f in loaded],
                  "columns": [c for _, _, _, c, _ in loaded], "tokenizer": tokenizer_fingerprint(tokenizer),
                  "seq_len": seq_len, "truncation": TRUNCATION, "pairs": PAIRS_VERSION,
                  "eval_fraction": eval_fraction if mixture.test_split_size is None else None}

    def write(tmp: Path) -> dict:
        source_of, index_of, held_out = mixture_order(mixture, [len(d) for _, _, d, _, _ in loaded], eval_fraction)
        processes = working_processes(num_proc)

        def work(chunk):
            out = []
            for source, index in zip(*chunk, strict=True):
                columns = loaded[source][3]
                row = loaded[source][2][int(index)]
                pair = tokenize_pair(tokenizer, *([None] if len(columns) == 2 else []), *(row[c] for c in columns),
                                     seq_len)
                out.append(None if pair is None else (pair["truncated"], *(array("i", pair[c])
                                                                           for c in SEQUENCE_COLUMNS), int(source)))
            return out

        info = {"layout": "preference pairs (a mixture)", "train_split": f"{len(loaded)} sources",
                "eval_split": f"{held_out} of the mixture held out" if held_out else None, "seq_len": seq_len,
                "tokenizing_processes": processes if len(source_of) - held_out >= PARALLEL_MIN_EXAMPLES else 1}
        for name, part in (("eval", slice(0, held_out)), ("train", slice(held_out, len(source_of)))):
            sources, indices = source_of[part], index_of[part]
            chunks = order_chunks(sources, indices, CHUNK_EXAMPLES)
            info[name] = _write_split(forked_map(chunks, work, processes if len(indices) >= PARALLEL_MIN_EXAMPLES
                                                 else 1), len(indices), name, seq_len, tmp, sources=len(loaded))
        tokens = [info["train"]["per_source"][i]["tokens"] + info["eval"]["per_source"][i]["tokens"]
                  for i in range(len(loaded))]
        info["sources"] = source_report(mixture, [split for _, split, _, _, _ in loaded],
                                        [len(d) for _, _, d, _, _ in loaded], source_of, tokens)
        return info

    return prepared_folder(cache_root, depends_on, write, tokenizer_name=tokenizer.name_or_path)


def _prepare(tokenizer, dataset, seq_len, eval_fraction, seed, column_map, cache_root: Path, num_proc: int) -> dict:
    """Main process (or a node's local main process): {"folder", "reused"}."""
    source = DataSource(dataset) if isinstance(dataset, str) else dataset
    raw = load_raw_dataset(source)
    train_split, eval_split = choose_splits(raw, source)
    train_raw = raw[train_split]
    if len(train_raw) == 0:
        raise UserError(f"--dataset {source.name!r} has no rows in its {train_split!r} split.")
    layout = pair_layout(train_raw.column_names, train_raw[0], column_map)
    depends_on = {"data": data_fingerprint(source, raw), "splits": [train_split, eval_split],
                  "columns": column_map or {}, "layout": layout, "tokenizer": tokenizer_fingerprint(tokenizer),
                  "seq_len": seq_len, "truncation": TRUNCATION, "eval_fraction": eval_fraction, "seed": seed,
                  "pairs": PAIRS_VERSION}

    def write(tmp: Path) -> dict:
        nonlocal train_raw
        eval_raw, eval_text = raw[eval_split] if eval_split else None, repr(eval_split) if eval_split else None
        if eval_raw is None and eval_fraction > 0:
            held_out = train_raw.train_test_split(test_size=eval_fraction, seed=seed)
            train_raw, eval_raw = held_out["train"], held_out["test"]
            eval_text = f"{eval_fraction:g} of {train_split!r} held out"
        processes = working_processes(num_proc)
        info = {"layout": f"preference pairs ({layout})", "train_split": repr(train_split), "eval_split": eval_text,
                "seq_len": seq_len,
                "tokenizing_processes": processes if len(train_raw) >= PARALLEL_MIN_EXAMPLES else 1}
        columns = pair_columns(layout, column_map)
        for name, split_raw in (("train", train_raw), ("eval", eval_raw)):
            if split_raw is None:
                info[name] = {"pairs": 0, "truncated": 0, "dropped": 0}
                continue
            chunks = split_raw.select_columns(columns).iter(batch_size=CHUNK_EXAMPLES)
            tokenized = forked_map(chunks, lambda chunk: _tokenize_chunk(chunk, tokenizer, columns, seq_len),
                                   processes if len(split_raw) >= PARALLEL_MIN_EXAMPLES else 1)
            info[name] = _write_split(tokenized, len(split_raw), name, seq_len, tmp)
        return info

    return prepared_folder(cache_root, depends_on, write, tokenizer_name=tokenizer.name_or_path)


def _tokenize_chunk(chunk: dict, tokenizer, columns: list[str], seq_len: int) -> list:
    """A chunk of raw pairs (column -> values) -> per pair None (dropped) or (truncated, chosen_ids, chosen_labels,
    rejected_ids, rejected_labels) with int32 arrays: 4 bytes a token to send back from a worker and to hold."""
    out = []
    for values in zip(*(chunk[c] for c in columns), strict=True):
        pair = tokenize_pair(tokenizer, *([None] if len(values) == 2 else []), *values, seq_len)
        out.append(None if pair is None else (pair["truncated"], *(array("i", pair[c]) for c in SEQUENCE_COLUMNS)))
    return out


def _write_split(tokenized, total: int, name: str, seq_len: int, folder: Path, sources: int = 0) -> dict:
    """Write one split's tokenized pairs (`tokenized`: lists of `_tokenize_chunk`'s results, from `forked_map`) into
    `<folder>/<name>.arrow`, WRITE_PAIR_TOKENS tokens of pairs at a time. Returns its counts (with `sources`, a
    mixture's count of sources, the pairs and tokens of each: a result's last item is then its source)."""
    import numpy as np
    import pyarrow
    from datasets import Features, Sequence, Value
    from datasets.arrow_writer import ArrowWriter
    from tqdm.auto import tqdm

    from zero_utils.data.sft_examples import IGNORE_INDEX

    features = Features({**{c: Sequence(Value("int32")) for c in SEQUENCE_COLUMNS},
                         **{c: Value("int32") for c in COUNT_COLUMNS}})
    writer = ArrowWriter(features=features, path=str(folder / f"{name}.arrow"))
    pool = pyarrow.default_memory_pool()
    waiting, waiting_tokens = [], 0
    counts = {"pairs": 0, "truncated": 0, "dropped": 0}
    per_source = [{"pairs": 0, "tokens": 0} for _ in range(sources)]

    def flush():  # one record batch of the waiting pairs
        nonlocal waiting, waiting_tokens
        table = {}
        for i, column in enumerate(SEQUENCE_COLUMNS):
            sequences = [pair[i] for pair in waiting]
            offsets = np.zeros(len(sequences) + 1, dtype=np.int32)
            np.cumsum([len(s) for s in sequences], out=offsets[1:])
            values = np.frombuffer(b"".join(s.tobytes() for s in sequences), dtype=np.int32)
            table[column] = pyarrow.ListArray.from_arrays(pyarrow.array(offsets), pyarrow.array(values))
        table["chosen_tokens"] = pyarrow.array([sum(label != IGNORE_INDEX for label in pair[1]) for pair in waiting],
                                               type=pyarrow.int32())
        table["tokens"] = pyarrow.array([len(pair[0]) + len(pair[2]) for pair in waiting], type=pyarrow.int32())
        writer.write_table(pyarrow.table(table))
        waiting, waiting_tokens = [], 0
        pool.release_unused()  # Arrow's allocator keeps freed blocks: give them back, or they grow with the data

    with tqdm(total=total, unit="pair", desc=f"tokenize {name} pairs to {seq_len}") as progress:
        for done in tokenized:
            for pair in done:
                progress.update(1)
                if pair is None:
                    counts["dropped"] += 1
                    continue
                counts["pairs"] += 1
                counts["truncated"] += pair[0]
                waiting.append(pair[1:5])
                waiting_tokens += len(pair[1]) + len(pair[3])
                if sources:
                    per_source[pair[5]]["pairs"] += 1
                    per_source[pair[5]]["tokens"] += len(pair[1]) + len(pair[3])
                if waiting_tokens >= WRITE_PAIR_TOKENS:
                    flush()
    if waiting:
        flush()
    writer.finalize()
    writer.close()
    return {**counts, "per_source": per_source} if sources else counts
