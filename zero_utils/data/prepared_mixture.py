"""The rows of a dataset mixture (zero_utils.data.mixture), prepared once per job like one source's rows
(zero_utils.data.prepared_rows: `prepare_once`, `prepared_folder`, `forked_map`, `pack_rows`, the same Arrow files).

Each source is loaded as --dataset loads one (its split, configuration, revision; `columns` keeps or renames its
columns) and keeps its own layout (chat messages, prompt/completion, Alpaca, text). The weights' draw
(`mixture.drawn_indices`, alignment-handbook's count) is made once with the mixture's seed; the drawn examples of
every source are then shuffled together with the same seed, so a packed row mixes sources. The mixture's held-out
part is its first `test_split_size` examples of that order (a fraction or a count), else the first --eval_fraction of
them. The order is two numpy arrays (source, index: 10 bytes an example); the examples are read, tokenized
(--num_proc forked workers) and packed CHUNK_EXAMPLES at a time, in bounded memory. The key covers the mixture
(sources, weights, columns, seed, hold-out), each source's data fingerprint and layout, the tokenizer, seq_len, the
pad id, --eval_fraction (when it applies) and the packer's version. info's "sources": per source its id, split,
examples used (train and eval) of examples available, its tokens in the rows (after the packer's truncation) and
their share of the mixture's tokens. Before any source is read, every source is checked to be reachable
(`sources.check_mixture_reachable`): one sentence naming the first that is not and its position.
"""

from __future__ import annotations

from pathlib import Path

from zero_utils.data.mixture import Mixture, mixture_order, order_chunks, source_report
from zero_utils.data.packing import PACKER_VERSION
from zero_utils.data.prepared_rows import (
    CHUNK_EXAMPLES,
    EMPTY_SPLIT,
    PARALLEL_MIN_EXAMPLES,
    default_num_proc,
    forked_map,
    open_rows,
    pack_rows,
    prepare_once,
    prepared_folder,
    rows_cache_root,
    tokenizer_fingerprint,
    working_processes,
)
from zero_utils.data.sft_examples import detect_layout, to_messages, tokenize_example
from zero_utils.data.sources import check_mixture_reachable, load_mixture_source
from zero_utils.run.errors import UserError

# How a mixture's order, hold-out and report are made; a change prepares every mixture again. 2: the per-source
# tokens are counted in the rows, after the packer's truncation (1: as tokenized).
MIXTURE_VERSION = 2


def prepare_mixture_rows(accelerator, tokenizer, mixture: Mixture, *, seq_len: int, eval_fraction: float,
                         pad_token_id: int, cache_root: Path | None = None, num_proc: int = 0):
    """Prepare (or reuse) the packed rows of `mixture` once per job; return (train, eval, info) on every rank, as
    `prepared_rows.prepare_rows` does for one source (info adds "sources"). Every rank must call it. Engines: all."""
    root = Path(cache_root or rows_cache_root())

    def prepare():
        return _prepare(tokenizer, mixture, seq_len, eval_fraction, pad_token_id, root, num_proc or default_num_proc())

    return prepare_once(accelerator, prepare, open_rows, root, what="the preparation of the dataset mixture")


def _load_sources(mixture: Mixture):
    """Each source's (MixtureSource, train split name, data, layout, data fingerprint), once every source is known to
    be reachable."""
    check_mixture_reachable(mixture)
    loaded = []
    for s in mixture.sources:
        split, data, fingerprint = load_mixture_source(s)
        loaded.append((s, split, data, detect_layout(data.column_names, s.column_map()), fingerprint))
    return loaded


def _prepare(tokenizer, mixture: Mixture, seq_len, eval_fraction, pad_token_id, cache_root: Path,
             num_proc: int) -> dict:
    loaded = _load_sources(mixture)
    depends_on = {"mixture": mixture.describe(), "data": [fingerprint for *_, fingerprint in loaded],
                  "layouts": [layout for _, _, _, layout, _ in loaded], "tokenizer": tokenizer_fingerprint(tokenizer),
                  "seq_len": seq_len, "pad_token_id": pad_token_id,
                  "eval_fraction": eval_fraction if mixture.test_split_size is None else None,
                  "packer": PACKER_VERSION, "mixture_order": MIXTURE_VERSION}

    def write(tmp: Path) -> dict:
        source_of, index_of, held_out = mixture_order(mixture, [len(d) for _, _, d, _, _ in loaded], eval_fraction)
        processes = working_processes(num_proc)
        parts = {"eval": slice(0, held_out), "train": slice(held_out, len(source_of))}
        info = {"layout": "mixture of " + ", ".join(sorted({layout for _, _, _, layout, _ in loaded})),
                "chat_template": bool(tokenizer.chat_template), "train_split": f"{len(mixture.sources)} sources",
                "eval_split": f"{held_out} of the mixture held out" if held_out else None,
                "tokenizing_processes": processes if len(source_of) - held_out >= PARALLEL_MIN_EXAMPLES else 1}
        for name in ("train", "eval"):
            part = parts[name]
            count = part.stop - part.start
            info[name] = pack_rows(_stream(loaded, source_of[part], index_of[part], tokenizer, processes), count,
                                   name, seq_len, pad_token_id, tmp,
                                   split_long=[layout == "text" for _, _, _, layout, _ in loaded]) \
                if count else {**EMPTY_SPLIT, "tokens_per_source": [0] * len(loaded)}
        if info["train"]["rows"] == 0:
            raise UserError(f"the mixture in {mixture.where} yields no trainable tokens; check its sources.")
        tokens = [a + b for a, b in zip(info["train"]["tokens_per_source"], info["eval"]["tokens_per_source"],
                                        strict=True)]
        report = source_report(mixture, [split for _, split, _, _, _ in loaded], [len(d) for _, _, d, _, _ in loaded],
                               source_of, tokens)
        info["sources"] = [{**line, "layout": layout} for line, (*_, layout, _) in zip(report, loaded, strict=True)]
        return info

    return prepared_folder(cache_root, depends_on, write, tokenizer_name=tokenizer.name_or_path)


def _stream(loaded, sources, indices, tokenizer, num_proc: int):
    """(input_ids, labels, source) of each example of the order (`sources`, `indices`: numpy arrays), read and
    tokenized CHUNK_EXAMPLES at a time (`forked_map`)."""
    from array import array

    processes = num_proc if len(indices) >= PARALLEL_MIN_EXAMPLES else 1

    def work(chunk):  # int32 arrays only to send back from a worker
        out = []
        for source, index in zip(*chunk, strict=True):
            s, _, data, layout, _ = loaded[source]
            example = tokenize_example(tokenizer, to_messages(data[int(index)], layout, s.column_map()))
            ids, labels = example["input_ids"], example["labels"]
            out.append((ids, labels, int(source)) if processes == 1 else (array("i", ids), array("i", labels),
                                                                           int(source)))
        return out

    for done in forked_map(order_chunks(sources, indices, CHUNK_EXAMPLES), work, processes):
        for ids, labels, source in done:
            yield (ids, labels, source) if processes == 1 else (ids.tolist(), labels.tolist(), source)
