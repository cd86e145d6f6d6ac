"""The one preparation pipeline: a source stream (one data set or a mixture: zero_utils.data.source_stream) times a row
maker (SFT rows, packed or one example each: zero_utils.data.sft_rows; prompts for generation:
zero_utils.data.prompt_rows; preference pairs: zero_utils.preference.pair_rows), prepared once per job, in bounded
memory, and kept.

    train, evaluation, info = prepare(accelerator, tokenizer, dataset, SFTRows(seq_len=2048, pad_token_id=0),
                                      eval_fraction=0.05, seed=42, column_map={})

The main process prepares; every other rank opens the result by its path and never tokenizes (it waits outside the
collective timeout, `distributed.run_on_main_process`). Preparation streams: the examples are read CHUNK_EXAMPLES at
a time, each made into its tokens by the row maker (with --num_proc N by N forked worker processes, chunk by chunk,
while the main process writes the chunks already done, in order; the workers inherit the tokenizer and the data, so
nothing but the chunks and the tokens, as int32 arrays, is pickled), and the row maker writes them into an Arrow file
with `datasets`' own `ArrowWriter`, a record batch at a time. Arrow, through `datasets`, because `Dataset.from_file`
memory-maps it: a rank reading rows holds page cache, not process memory.

Where: `<datasets cache>/zero_recipes_rows/<key>/` (the `datasets` cache is `HF_DATASETS_CACHE`, by default under
`HF_HOME`), holding train.arrow, eval.arrow (when there is held-out data) and info.json, written last: a folder
without it is not used. The key hashes everything the rows depend on: the stream's (the data: local files by path,
size and modification time, a Hub data set by id, configuration, revision and the fingerprints `datasets` gave it;
the splits or the mixture; --columns; the hold-out), each source's layout, the tokenizer (its full serialisation)
and chat template, the row maker's settings and version, and PREPARATION_VERSION. A relaunch with the same key
reuses the rows and says so; any change prepares again. On several nodes, a node whose `datasets` cache folder is not
the main process's (each node with its own cache, as without a shared file system) prepares the same rows itself, on
its local main process, while its other ranks wait: the rows are a pure function of the key, so every node trains on
the same rows. With one cache folder on a shared file system the job prepares once.

A row maker (duck-typed; the three above are the examples) has:
    key() -> dict                                   its settings in the key (lengths, pad id, its version)
    layout(column_names, first_example, column_map) one source's layout; a UserError naming its columns if none
    columns(layout, column_map) -> list | None      the columns it reads (None: all), one data set only
    make(tokenizer, example, layout, column_map)    one example's tokens, compact (int32 arrays): a worker sends it
    write(made, examples, name, folder, layouts)    made: (made, source) in order -> `<folder>/<name>.arrow`; its
                                                    counts, with "tokens_per_source"
    empty(sources) -> dict                          the counts of a split without examples (no file)
    describe(layouts, mixture) -> str               the layout in the data line
    check(info, named)                              a UserError when nothing was made to train on
    open(folder) -> (train, eval or None, info)     the folder's rows, memory-mapped, and its summary
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from zero_utils.data.cache import hold
from zero_utils.data.source_stream import SourceStream
from zero_utils.run import distributed
from zero_utils.run.errors import UserError

# What the key of every prepared folder holds and how the pipeline makes it; a change prepares all data again.
# 3: one pipeline for every row maker (issue 70; the rows themselves are the ones version 2 made).
PREPARATION_VERSION = 3
MAX_NUM_PROC = 8  # --num_proc 0 takes this machine's CPUs, at most this many
PARALLEL_MIN_EXAMPLES = 1000  # a split smaller than this is tokenized in the main process (workers cost seconds)


def prepare(accelerator, tokenizer, dataset, maker, *, eval_fraction: float, seed: int,
            column_map: dict | None = None, cache_root: Path | None = None, num_proc: int = 0,
            what: str = "the data preparation"):
    """Prepare (or reuse) the rows `maker` makes of `dataset` (a `DataSource`, a name, a YAML file of a
    dataset_mixture, or a `Mixture`) once per job; return (train, eval or None, info) on every rank.

    train/eval: memory-mapped `datasets.Dataset`s (the maker's columns); eval is None without held-out data (the
    split --dataset_split names, else the data set's validation/test split, else `eval_fraction` of the examples
    split off with `seed` before anything is tokenized; a mixture's test_split_size). info: the maker's summary
    (`maker.open`) with "reused" (found prepared), "prepared_on" ("main", or "node" on a node that prepared its
    own), "nodes_with_own_rows" and "cache_files_written" (split files this rank wrote: 0 off the preparing process
    and on reuse). `column_map`: --columns for one data set. `cache_root`: where rows are kept (default
    `rows_cache_root()`). `num_proc`: processes that tokenize (0 = `default_num_proc()`); the rows are the same for
    any value (a split under PARALLEL_MIN_EXAMPLES examples, or a platform that cannot fork, tokenizes in one
    process). Every rank must call it. Engines: all."""
    root = Path(cache_root or rows_cache_root())

    def run():
        stream = SourceStream.open(dataset, column_map, eval_fraction=eval_fraction, seed=seed)
        return _prepare(tokenizer, stream, maker, root, num_proc or default_num_proc())

    return prepare_once(accelerator, run, maker.open, root, what=what)


def _prepare(tokenizer, stream: SourceStream, maker, cache_root: Path, num_proc: int) -> dict:
    """The main process (or a node's local main process): {"folder", "reused"}."""
    layouts = [maker.layout(s.data.column_names, s.first_example(), s.column_map) for s in stream.sources]
    depends_on = {**stream.key(), "layouts": layouts, "tokenizer": tokenizer_fingerprint(tokenizer),
                  "rows": maker.key(), "preparation": PREPARATION_VERSION}

    def write(tmp: Path) -> dict:
        parts = stream.parts(None if stream.mixture else maker.columns(layouts[0], stream.sources[0].column_map))
        processes = working_processes(num_proc)
        info = {"layout": maker.describe(layouts, stream.mixture is not None),
                "chat_template": bool(tokenizer.chat_template), "train_split": stream.train_split_text,
                "eval_split": stream.eval_split_text,
                "tokenizing_processes": tokenizing_processes(parts["train"].examples, processes)}
        for name in ("train", "eval"):
            part = parts[name]
            info[name] = maker.write(made(stream, part, maker, tokenizer, layouts, processes), part.examples, name,
                                     tmp, layouts) if part else maker.empty(len(layouts))
        maker.check(info, stream.named)
        report = stream.report([a + b for a, b in zip(info["train"]["tokens_per_source"],
                                                      info["eval"]["tokens_per_source"], strict=True)], layouts)
        return {**info, **({"sources": report} if report else {})}

    return prepared_folder(cache_root, depends_on, write, tokenizer_name=tokenizer.name_or_path)


def made(stream: SourceStream, part, maker, tokenizer, layouts: list[str], num_proc: int):
    """(made, source) of each example of `part`, in order: `maker.make` of every example, CHUNK_EXAMPLES at a time
    (`forked_map`: by num_proc forked processes for a part of PARALLEL_MIN_EXAMPLES examples or more, which pays
    for the workers, while this one writes)."""
    def work(chunk):
        return [(maker.make(tokenizer, example, layouts[source], stream.sources[source].column_map), source)
                for source, example in stream.examples(chunk)]

    for done in forked_map(part.chunks(), work, tokenizing_processes(part.examples, num_proc)):
        yield from done


def tokenizing_processes(examples: int, num_proc: int) -> int:
    """Processes that tokenize a split of `examples`: num_proc, or 1 under PARALLEL_MIN_EXAMPLES (too small to pay
    for starting workers)."""
    return num_proc if examples >= PARALLEL_MIN_EXAMPLES else 1


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything the tokenizer turns text into ids with: its class, its full serialisation (a fast
    tokenizer's `backend_tokenizer.to_str()`: vocabulary, merges, normalizer, added tokens; else its vocabulary and
    init arguments), the special token ids and the chat template. Needs no pickling: any tokenizer can be hashed."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    serialised = backend.to_str() if backend is not None else json.dumps(
        [sorted(tokenizer.get_vocab().items()), tokenizer.init_kwargs], sort_keys=True, default=str)
    parts = [type(tokenizer).__name__, serialised, tokenizer.bos_token_id, tokenizer.eos_token_id,
             tokenizer.pad_token_id, tokenizer.chat_template]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def rows_key(depends_on: dict) -> str:
    """The cache key of prepared rows: a hash of what they depend on (a JSON-able dict)."""
    return hashlib.sha256(json.dumps(depends_on, sort_keys=True, default=str).encode()).hexdigest()[:24]


def rows_cache_root() -> Path:
    """`<datasets cache>/zero_recipes_rows`: where prepared rows are kept."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "zero_recipes_rows"


def default_num_proc() -> int:
    """Tokenizing processes for `--num_proc 0` (the default): the CPUs this process may run on, at most MAX_NUM_PROC.
    The node's other ranks wait while its main process prepares, so their CPUs are free. The main process's one
    sequential pass (reading, packing, writing) bounds the throughput of any number: it kept up with about 3.6
    tokenizing workers on the plain-text corpus of docs/BENCHMARKS.md (section 7); data that costs more to
    tokenize (a chat template renders each example first) keeps more busy, hence up to 8, about 18 MB of RAM each."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_NUM_PROC, cpus))


def can_fork() -> bool:
    """Whether this platform starts worker processes by forking (Linux, macOS): the workers inherit the tokenizer,
    so any tokenizer works there, picklable or not, and nothing but the raw examples and their tokens is sent."""
    return "fork" in multiprocessing.get_all_start_methods()


def working_processes(num_proc: int) -> int:
    """`num_proc`, or 1 (with a line saying so) on a platform that cannot fork workers."""
    if num_proc > 1 and not can_fork():
        print(f"--num_proc {num_proc}: this platform cannot fork worker processes (they inherit the tokenizer); "
              "tokenizing in this process alone (--num_proc 1).")
        return 1
    return num_proc


def prepare_once(accelerator, prepare, open_folder, cache_root: Path, *, what: str):
    """Run `prepare()` (-> {"folder": a prepared folder under `cache_root`, "reused": bool}, JSON-able) once per job
    on the main process while every other rank waits outside collectives, then on the local main process of each
    node that does not see that folder (`sees_rows_of_main_process`: no shared file system, or a `datasets` cache of
    the node's own), which prepares the same folder (the same key) while every rank waits again; then every rank
    opens its node's folder: `open_folder(folder)` -> (train, eval or None, info). Returns that, with info's
    "reused", "prepared_on" ("main" or "node"), "nodes_with_own_rows" (how many nodes prepared their own) and
    "cache_files_written" (the split files this rank wrote: 0 off the preparing process and on reuse). Every rank
    must call it. Engines: all."""
    prepared = distributed.run_on_main_process(accelerator, prepare, share_result=True,
                                               what=f"{what} (the main process)")

    def on_this_node():  # a node without the main process's folder (no shared file system) makes its own
        if sees_rows_of_main_process(cache_root, Path(prepared["folder"])):
            return {**prepared, "where": "main"}
        return {**prepare(), "where": "node"}  # the same key: the same rows, or the ones this node kept

    here = distributed.run_on_main_process(accelerator, on_this_node, share_result=True, per_node=True,
                                           what=f"{what} (nodes without the main process's folder)")
    wrote = not here["reused"] and (accelerator.is_main_process if here["where"] == "main"
                                    else accelerator.is_local_main_process)
    other_nodes = distributed.count_over_ranks(accelerator, here["where"] == "node" and
                                               accelerator.is_local_main_process)
    train, evaluation, info = open_folder(Path(here["folder"]))
    return train, evaluation, {**info, "reused": here["reused"], "prepared_on": here["where"],
                               "nodes_with_own_rows": other_nodes,
                               "cache_files_written": (1 + (evaluation is not None)) if wrote else 0}


def sees_rows_of_main_process(cache_root: Path, main_folder: Path) -> bool:
    """Whether a node opens the rows the main process prepared in `main_folder`: its own rows cache (`cache_root`)
    is the same path and the folder is complete there (a shared file system). A node with a cache of its own, or
    whose same path is a local disk the main process never wrote, prepares the same rows itself."""
    return cache_root / main_folder.name == main_folder and (main_folder / "info.json").is_file()


def prepared_folder(cache_root: Path, depends_on: dict, write, *, tokenizer_name: str = "") -> dict:
    """The folder `cache_root/rows_key(depends_on)`: reused when complete (its info.json exists), else made:
    `write(tmp)` fills a temporary folder beside it and returns the info, written last to info.json (with
    `depends_on` and `tokenizer_name`, for `python -m zero_utils.data cache`), then the folder is renamed into place.
    An error or Ctrl-C leaves no half-written folder; an incomplete one left by a killed preparation is replaced;
    another job on this machine that finished the same folder first keeps its own (the same). The folder is held
    for this process (`cache.hold`: never pruned while it runs). Returns {"folder", "reused"}."""
    folder = cache_root / rows_key(depends_on)
    if (folder / "info.json").is_file():
        hold(folder)
        if (folder / "info.json").is_file():  # not pruned before the hold
            return {"folder": str(folder), "reused": True}
    tmp = folder.parent / f".tmp_{folder.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        info = write(tmp)
    except BaseException:  # an error, or Ctrl-C: no half-written folder stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / "info.json").write_text(json.dumps({**info, "depends_on": depends_on, "tokenizer_name": tokenizer_name},
                                              indent=1) + "\n")  # last
    if not (folder / "info.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)  # an incomplete one, left by a killed preparation
    try:
        tmp.rename(folder)
    except OSError:  # another job on this machine finished the same rows first: theirs are the same, keep them
        shutil.rmtree(tmp, ignore_errors=True)
    hold(folder)
    return {"folder": str(folder), "reused": False}


def open_prepared(folder: Path, what: str):
    """A prepared `folder`'s splits, memory-mapped, and its info.json: (train, eval or None, info), the folder held
    for this process (never pruned while it runs). `what`: the rows' name ("rows", "pairs", "prompts"), in the
    `UserError` of a rank that does not see the folder (another node without the shared `datasets` cache)."""
    from datasets import Dataset

    if not (folder / "info.json").is_file():
        raise UserError(f"this rank cannot see the prepared {what} in {folder} (the main process wrote them): on "
                        "several nodes, set HF_DATASETS_CACHE to a folder every node shares.")
    hold(folder)
    info = json.loads((folder / "info.json").read_text())
    evaluation = Dataset.from_file(str(folder / "eval.arrow")) if (folder / "eval.arrow").is_file() else None
    return Dataset.from_file(str(folder / "train.arrow")), evaluation, info


def write_record_batches(path: Path, features, rows, table_of, batch_tokens: int) -> None:
    """Write `rows` ((row, its tokens), in order) into the Arrow file `path` with `datasets`' `ArrowWriter`, one record
    batch (`table_of(rows)`: a pyarrow table of `features`) each time `batch_tokens` tokens are waiting, so memory
    holds one batch whatever the data; Arrow's freed blocks are given back after each (its allocator keeps them, and
    they would grow with the data). A row maker's writer feeds it from a generator that counts what it passes."""
    import pyarrow
    from datasets.arrow_writer import ArrowWriter

    writer = ArrowWriter(features=features, path=str(path))
    waiting, waiting_tokens = [], 0
    for row, tokens in rows:
        waiting.append(row)
        waiting_tokens += tokens
        if waiting_tokens >= batch_tokens:
            writer.write_table(table_of(waiting))
            waiting, waiting_tokens = [], 0
            pyarrow.default_memory_pool().release_unused()
    if waiting:
        writer.write_table(table_of(waiting))
    writer.finalize()
    writer.close()


def int32_lists(sequences):
    """A pyarrow list<int32> array of `sequences` (int32 `array.array`s), built from one buffer: no Python ints."""
    import numpy as np
    import pyarrow

    offsets = np.zeros(len(sequences) + 1, dtype=np.int32)
    np.cumsum([len(s) for s in sequences], out=offsets[1:])
    values = np.frombuffer(b"".join(s.tobytes() for s in sequences), dtype=np.int32)
    return pyarrow.ListArray.from_arrays(pyarrow.array(offsets), pyarrow.array(values))


_worker_work = None  # a worker process's work, inherited from its parent (fork): any closure, never pickled


def _start_worker(work) -> None:
    global _worker_work
    _worker_work = work


def _work_in_worker(chunk):
    return _worker_work(chunk)


def forked_map(chunks, work, num_proc: int):
    """`work(chunk)` of each chunk, in order: in this process (num_proc 1), or by num_proc forked worker processes
    while this process consumes the results already done; at most 2 x num_proc chunks are in flight, so memory stays
    bounded whatever the number of chunks. The workers inherit `work` (a closure over the tokenizer: nothing but the
    chunks and the results, which should be compact, such as int32 arrays, is pickled). A worker that dies (killed
    for memory) stops the preparation with a `UserError` naming --num_proc rather than hanging the job."""
    if num_proc <= 1:
        for chunk in chunks:
            yield work(chunk)
        return
    pool = ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context("fork"),
                               initializer=_start_worker, initargs=(work,))
    in_flight = deque()
    try:
        for chunk in chunks:
            in_flight.append(pool.submit(_work_in_worker, chunk))
            if len(in_flight) == 2 * num_proc:
                yield in_flight.popleft().result()
        while in_flight:
            yield in_flight.popleft().result()
    except BrokenProcessPool:
        raise UserError(f"a --num_proc {num_proc} worker process died while tokenizing (killed for lack of memory?); "
                        "pass a lower --num_proc, or 1.") from None
    finally:
        pool.shutdown(cancel_futures=True)
