"""Training rows prepared once per job, in bounded memory, and kept: load -> format -> tokenize -> pack -> Arrow.
(zero_utils.preference.prepared_pairs prepares preference pairs with the same machinery: `prepare_once`,
`prepared_folder`, `forked_map`.)

The main process prepares; every other rank opens the result by its path and never tokenizes (it waits outside
the collective timeout, `distributed.run_on_main_process`). Preparation streams: the raw dataset (memory-mapped
Arrow, as `datasets` loads it) is read in chunks of `CHUNK_EXAMPLES` examples, each example tokenized
(`sft_examples.tokenize_example`; with --num_proc N by N forked worker processes, chunk by chunk, while the main
process packs the chunks already done, in order) and handed to one sequential `packing.Packer`, whose finished rows
are written `WRITE_TOKENS` tokens at a time into an Arrow file by `datasets`' own `ArrowWriter`. Arrow, through
`datasets`, because `Dataset.from_file` memory-maps it: a rank reading rows holds page cache, not process memory,
and the rows are the same `datasets.Dataset` the rest of the code already slices. Token ids are stored as int32
(half of int64 on disk; they become int64 tensors at batching time).

Where: `<datasets cache>/zero_recipes_rows/<key>/` (the `datasets` cache is `HF_DATASETS_CACHE`, by default under
`HF_HOME`), holding train.arrow, eval.arrow (when there is held-out data) and info.json, written last: a folder
without it is not used. The key hashes everything the rows depend on: the data (local files by path, size and
modification time; a Hub dataset by id, configuration, revision and the fingerprints `datasets` gave it), the train
and eval splits, --columns, the layout, the tokenizer (its full serialisation) and chat template, seq_len, the pad
id, the eval fraction, the seed and `packing.PACKER_VERSION`. A relaunch with the same key reuses the rows and says
so; any change prepares again. On several nodes, a node whose `datasets` cache folder is not the main process's
(each node with its own cache, as without a shared file system) prepares the same rows itself, on its local main
process, while its other ranks wait: the rows are a pure function of the key, so every node trains on the same
rows. With one cache folder on a shared file system the job prepares once.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from array import array
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from zero_utils.data.cache import hold
from zero_utils.data.packing import PACKER_VERSION, Packer
from zero_utils.data.sft_examples import detect_layout, to_messages, tokenize_example
from zero_utils.data.sources import DataSource, choose_splits, data_fingerprint, load_raw_dataset
from zero_utils.run import distributed
from zero_utils.run.errors import UserError

CHUNK_EXAMPLES = 100  # raw examples read and tokenized at a time
MAX_NUM_PROC = 8  # --num_proc 0 takes this machine's CPUs, at most this many
PARALLEL_MIN_EXAMPLES = 1000  # a split smaller than this is tokenized in the main process (workers cost seconds)
WRITE_TOKENS = 1 << 20  # tokens of rows per record batch (buffered as int32, 12 bytes a token: ~12.6 MB); every
# rank opening the rows holds a few KB per record batch of the file (pyarrow's table of batches), so fewer is better
ROW_COLUMNS = ("input_ids", "labels", "position_ids")
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


def prepare_rows(accelerator, tokenizer, dataset: DataSource | str, *, seq_len: int, eval_fraction: float, seed: int,
                 column_map: dict[str, str] | None, pad_token_id: int, cache_root: Path | None = None,
                 num_proc: int = 0):
    """Prepare (or reuse) the packed rows of `dataset` (a `DataSource`, or just its name) once per job; return
    (train, eval, info) on every rank.

    train/eval: memory-mapped `datasets.Dataset`s with int32 columns input_ids, labels, position_ids (each `seq_len`
    long) and num_loss_tokens; eval is None without held-out data (the split --dataset_split names, else the data
    set's validation/test split, else `eval_fraction` of the examples, split before packing so no example is in
    both: `sources.choose_splits`). info: the splits, layout, example, row,
    truncation and split-document counts, max_token_id, the folder, `reused` (found prepared) and
    `cache_files_written` (row files this rank wrote: 0 off the main process). `cache_root`: where rows are kept
    (default `rows_cache_root()`, on each node); a node that does not see the main process's rows in its own cache
    (`sees_rows_of_main_process`: no shared file system, or each node its own `datasets` cache) prepares the same
    rows (the key is the same) on its local main process:
    `prepared_on` says "node" there, else "main", and `nodes_with_own_rows` counts such nodes. `num_proc`:
    processes that tokenize (0 = `default_num_proc()`); the packing is one sequential pass over the tokenized
    examples in their order, so the rows are the same for any value; a split under PARALLEL_MIN_EXAMPLES examples,
    or a platform that cannot fork (the line says so), tokenizes in one process; info's
    `tokenizing_processes` says how many tokenized the train split (every rank gets the preparing process's count).
    Every rank must call it.
    """
    root = Path(cache_root or rows_cache_root())

    def prepare():
        return _prepare(tokenizer, dataset, seq_len, eval_fraction, seed, column_map, pad_token_id, root,
                        num_proc or default_num_proc())

    return prepare_once(accelerator, prepare, open_rows, root, what="the data preparation")


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


def _prepare(tokenizer, dataset, seq_len, eval_fraction, seed, column_map, pad_token_id, cache_root: Path,
             num_proc: int = 1) -> dict:
    """Main process: {"folder": the prepared rows, "reused": whether a complete folder with the same key was there}."""
    source = DataSource(dataset) if isinstance(dataset, str) else dataset
    raw = load_raw_dataset(source)
    train_split, eval_split = choose_splits(raw, source)
    train_raw = raw[train_split]
    layout = detect_layout(train_raw.column_names, column_map)
    depends_on = {"data": data_fingerprint(source, raw), "splits": [train_split, eval_split],
                  "columns": column_map or {}, "layout": layout,
                  "tokenizer": tokenizer_fingerprint(tokenizer), "seq_len": seq_len, "pad_token_id": pad_token_id,
                  "eval_fraction": eval_fraction, "seed": seed, "packer": PACKER_VERSION}

    def write(tmp: Path) -> dict:
        nonlocal train_raw
        eval_raw, eval_split_text = raw[eval_split] if eval_split else None, repr(eval_split) if eval_split else None
        if eval_raw is None and eval_fraction > 0:
            if len(train_raw) < 2:
                raise UserError(f"--dataset {source.name!r} has {len(train_raw)} example(s): too few to hold out "
                                "an eval split; add data or pass --eval_fraction 0.")
            split = train_raw.train_test_split(test_size=eval_fraction, seed=seed)
            train_raw, eval_raw = split["train"], split["test"]
            eval_split_text = f"{eval_fraction:g} of {train_split!r} held out"
        processes = working_processes(num_proc)
        info = {"layout": layout, "chat_template": bool(tokenizer.chat_template), "train_split": repr(train_split),
                "eval_split": eval_split_text, "tokenizing_processes": _tokenizing_processes(train_raw, processes)}
        for name, split_raw in (("train", train_raw), ("eval", eval_raw)):
            info[name] = pack_rows(
                ((ids, labels, 0) for ids, labels in _token_stream(split_raw, tokenizer, layout, column_map,
                                                                    processes)),
                len(split_raw), name, seq_len, pad_token_id, tmp, split_long=[layout == "text"]) \
                if split_raw is not None else EMPTY_SPLIT
        if info["train"]["rows"] == 0:
            raise UserError(f"--dataset {source.name!r} yields no trainable tokens after formatting; "
                            "check its columns and contents.")
        return info

    return prepared_folder(cache_root, depends_on, write, tokenizer_name=tokenizer.name_or_path)


def working_processes(num_proc: int) -> int:
    """`num_proc`, or 1 (with a line saying so) on a platform that cannot fork workers."""
    if num_proc > 1 and not can_fork():
        print(f"--num_proc {num_proc}: this platform cannot fork worker processes (they inherit the tokenizer); "
              "tokenizing in this process alone (--num_proc 1).")
        return 1
    return num_proc


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


def _tokenizing_processes(split_raw, num_proc: int) -> int:
    """Processes that tokenize `split_raw`: num_proc, or 1 for a split under PARALLEL_MIN_EXAMPLES examples (too small
    to pay for starting workers)."""
    return num_proc if len(split_raw) >= PARALLEL_MIN_EXAMPLES else 1


def _tokenize_chunk(chunk: dict, tokenizer, layout: str, column_map) -> list[tuple[list[int], list[int]]]:
    """A chunk of raw examples (column -> values, as `Dataset.iter` gives them) -> each example's (input_ids,
    labels), labels shifted (`sft_examples.tokenize_example`)."""
    tokens = [tokenize_example(tokenizer, to_messages(dict(zip(chunk, values, strict=True)), layout, column_map))
              for values in zip(*chunk.values(), strict=True)]
    return [(t["input_ids"], t["labels"]) for t in tokens]


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


def _token_stream(split_raw, tokenizer, layout, column_map, num_proc: int):
    """Each example's (input_ids, labels), in the split's order, tokenized CHUNK_EXAMPLES examples at a time
    (`forked_map`: with num_proc > 1 and a split of PARALLEL_MIN_EXAMPLES or more, which pays for the workers, by
    num_proc forked processes while this one packs). A worker sends its chunk's tokens back as int32 arrays: 4 bytes
    a token to send and to hold while waiting to be packed (a Python int list costs about 36)."""
    processes = _tokenizing_processes(split_raw, num_proc)

    def work(chunk):
        tokens = _tokenize_chunk(chunk, tokenizer, layout, column_map)
        return tokens if processes == 1 else [(array("i", ids), array("i", labels)) for ids, labels in tokens]

    for done in forked_map(split_raw.iter(batch_size=CHUNK_EXAMPLES), work, processes):
        if processes == 1:
            yield from done
        else:
            yield from ((ids.tolist(), labels.tolist()) for ids, labels in done)


EMPTY_SPLIT = {"examples": 0, "rows": 0, "truncated": 0, "split_documents": 0, "max_token_id": 0}


def pack_rows(stream, total: int, name: str, seq_len: int, pad_token_id: int, folder: Path,
              split_long: list[bool]) -> dict:
    """Pack one split's tokenized examples (`stream` of (input_ids, labels, source): `source` indexes `split_long`,
    whether that source's long examples are split into windows, as documents are, instead of truncated) in one
    sequential pass, WRITE_TOKENS tokens of rows at a time; write `<folder>/<name>.arrow`. `total`: the examples,
    for the progress bar. Returns its counts, with "tokens_per_source" (per source, its tokens in the rows: after the
    packer's truncation, without the examples it dropped)."""
    import numpy as np
    import pyarrow
    from datasets import Features, Sequence, Value
    from datasets.arrow_writer import ArrowWriter
    from tqdm.auto import tqdm

    features = Features({**{c: Sequence(Value("int32")) for c in ROW_COLUMNS}, "num_loss_tokens": Value("int32")})
    packer, max_token_id, pool = Packer(seq_len, pad_token_id), 0, pyarrow.default_memory_pool()
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
    with tqdm(total=total, unit="ex", desc=f"tokenize and pack {name} to {seq_len}") as progress:
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
    from datasets import Dataset

    if not (folder / "info.json").is_file():
        raise UserError(f"this rank cannot see the prepared rows in {folder} (the main process wrote them): on "
                        "several nodes, set HF_DATASETS_CACHE to a folder every node shares.")
    hold(folder)  # never pruned while this job runs
    info = json.loads((folder / "info.json").read_text())
    columns = list(ROW_COLUMNS)  # int32 on disk, int64 tensors when read; num_loss_tokens stays in `.data`
    train = Dataset.from_file(str(folder / "train.arrow")).with_format("torch", columns=columns)
    evald = (Dataset.from_file(str(folder / "eval.arrow")).with_format("torch", columns=columns)
             if info["eval"]["examples"] else None)
    summary = {"layout": info["layout"], "chat_template": info["chat_template"], "folder": str(folder),
               "train_split": info["train_split"], "eval_split": info["eval_split"],
               "train_examples": info["train"]["examples"], "eval_examples": info["eval"]["examples"],
               "train_rows": info["train"]["rows"], "eval_rows": info["eval"]["rows"],
               "truncated_examples": info["train"]["truncated"] + info["eval"]["truncated"],
               "split_documents": info["train"]["split_documents"] + info["eval"]["split_documents"],
               "max_token_id": max(info["train"]["max_token_id"], info["eval"]["max_token_id"]),
               "tokenizing_processes": info.get("tokenizing_processes", 1)}
    if info.get("sources"):  # a mixture (zero_utils.data.prepared_mixture): each source's share
        summary["sources"] = info["sources"]
    return train, evald, summary
