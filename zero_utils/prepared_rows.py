"""Training rows prepared once per job, in bounded memory, and kept: load -> format -> tokenize -> pack -> Arrow.

The main process prepares; every other rank opens the result by its path and never tokenizes (it waits outside
the collective timeout, `distributed.run_on_main_process`). Preparation streams: the raw dataset (memory-mapped
Arrow, as `datasets` loads it) is read in chunks of `CHUNK_EXAMPLES` examples, each example tokenized
(`sft_examples.tokenize_example`) and handed to one sequential `packing.Packer`, whose finished rows are written
`WRITE_TOKENS` tokens at a time into an Arrow file by `datasets`' own `ArrowWriter`. Arrow, through `datasets`, because
`Dataset.from_file` memory-maps it: a rank reading rows holds page cache, not process memory, and the rows are
the same `datasets.Dataset` the rest of the code already slices. Token ids are stored as int32 (half of int64 on
disk; they become int64 tensors at batching time).

Where: `<datasets cache>/zero_recipes_rows/<key>/` (the `datasets` cache is `HF_DATASETS_CACHE`, by default under
`HF_HOME`), holding train.arrow, eval.arrow (when there is held-out data) and info.json, written last: a folder
without it is not used. The key hashes everything the rows depend on: the data (local files by path, size and
modification time; a Hub dataset by id, configuration, revision and the fingerprints `datasets` gave it), the train
and eval splits, --columns, the layout, the tokenizer (its full serialisation) and chat template, seq_len, the pad
id, the eval fraction, the seed and `packing.PACKER_VERSION`. A relaunch with the same key reuses the rows and says
so; any change prepares again. Every node must see the folder: on several nodes, put the `datasets` cache on a
filesystem they share.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from zero_utils import distributed
from zero_utils.data_sources import DataSource, choose_splits, data_fingerprint, load_raw_dataset
from zero_utils.errors import UserError
from zero_utils.packing import PACKER_VERSION, Packer
from zero_utils.sft_examples import detect_layout, to_messages, tokenize_example

CHUNK_EXAMPLES = 100  # raw examples read and tokenized at a time
WRITE_TOKENS = 1 << 18  # packed tokens buffered (3 Python ints each, ~36 bytes apiece: ~28 MB) before writing
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


def prepare_rows(accelerator, tokenizer, dataset: DataSource | str, *, seq_len: int, eval_fraction: float, seed: int,
                 column_map: dict[str, str] | None, pad_token_id: int, cache_root: Path | None = None):
    """Prepare (or reuse) the packed rows of `dataset` (a `DataSource`, or just its name) once per job; return
    (train, eval, info) on every rank.

    train/eval: memory-mapped `datasets.Dataset`s with int32 columns input_ids, labels, position_ids (each `seq_len`
    long) and num_loss_tokens; eval is None without held-out data (the split --dataset_split names, else the data
    set's validation/test split, else `eval_fraction` of the examples, split before packing so no example is in
    both: `data_sources.choose_splits`). info: the splits, layout, example, row,
    truncation and split-document counts, max_token_id, the folder, `reused` (found prepared) and
    `cache_files_written` (row files this rank wrote: 0 off the main process). `cache_root`: where rows are kept
    (default `rows_cache_root()`). Every rank must call it.
    """
    prepared = distributed.run_on_main_process(
        accelerator, lambda: _prepare(tokenizer, dataset, seq_len, eval_fraction, seed, column_map, pad_token_id,
                                      Path(cache_root or rows_cache_root())),
        share_result=True)
    train, evald, info = open_rows(Path(prepared["folder"]))
    written = not prepared["reused"] and accelerator.is_main_process
    return train, evald, {**info, "reused": prepared["reused"],
                          "cache_files_written": (1 + (evald is not None)) if written else 0}


def _prepare(tokenizer, dataset, seq_len, eval_fraction, seed, column_map, pad_token_id, cache_root: Path) -> dict:
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
    folder = cache_root / rows_key(depends_on)
    if (folder / "info.json").is_file():
        return {"folder": str(folder), "reused": True}
    eval_raw = raw[eval_split] if eval_split else None
    if eval_raw is None and eval_fraction > 0:
        if len(train_raw) < 2:
            raise UserError(f"--dataset {source.name!r} has {len(train_raw)} example(s): too few to hold out "
                            "an eval split; add data or pass --eval_fraction 0.")
        split = train_raw.train_test_split(test_size=eval_fraction, seed=seed)
        train_raw, eval_raw = split["train"], split["test"]
        eval_split = f"{eval_fraction:g} of {train_split!r} held out"
    elif eval_split:
        eval_split = repr(eval_split)
    tmp = folder.parent / f".tmp_{folder.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    info = {"layout": layout, "chat_template": bool(tokenizer.chat_template), "depends_on": depends_on,
            "train_split": repr(train_split), "eval_split": eval_split}
    for name, split_raw in (("train", train_raw), ("eval", eval_raw)):
        counts = _pack_split(split_raw, name, tokenizer, layout, column_map, seq_len, pad_token_id, tmp) \
            if split_raw is not None else {"examples": 0, "rows": 0, "truncated": 0, "split_documents": 0,
                                           "max_token_id": 0}
        info[name] = counts
    if info["train"]["rows"] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"--dataset {source.name!r} yields no trainable tokens after formatting; "
                        "check its columns and contents.")
    (tmp / "info.json").write_text(json.dumps(info, indent=1) + "\n")  # last: the folder is complete
    if not (folder / "info.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)  # an incomplete one, left by a killed preparation
    try:
        tmp.rename(folder)
    except OSError:  # another job on this machine finished the same rows first: theirs are the same, keep them
        shutil.rmtree(tmp, ignore_errors=True)
    return {"folder": str(folder), "reused": False}


def _pack_split(split_raw, name, tokenizer, layout, column_map, seq_len, pad_token_id, folder: Path) -> dict:
    """Tokenize and pack one split in one sequential pass: CHUNK_EXAMPLES raw examples, then WRITE_TOKENS tokens of
    rows, at a time; write `<folder>/<name>.arrow`. Returns its counts."""
    import pyarrow
    from datasets import Features, Sequence, Value
    from datasets.arrow_writer import ArrowWriter
    from tqdm.auto import tqdm

    features = Features({**{c: Sequence(Value("int32")) for c in ROW_COLUMNS}, "num_loss_tokens": Value("int32")})
    packer, max_token_id, pending, pool = Packer(seq_len, pad_token_id), 0, [], pyarrow.default_memory_pool()
    write_rows = max(1, WRITE_TOKENS // seq_len)
    writer = ArrowWriter(features=features, path=str(folder / f"{name}.arrow"), writer_batch_size=write_rows)

    def write(rows, final=False):
        pending.extend(rows)
        if pending and (final or len(pending) >= write_rows):
            writer.write_batch({k: [r[k] for r in pending] for k in features})
            pending.clear()
            pool.release_unused()  # Arrow's allocator keeps freed blocks: give them back, or they grow with the corpus

    with tqdm(total=len(split_raw), unit="ex", desc=f"tokenize and pack {name} to {seq_len}") as progress:
        for chunk in split_raw.iter(batch_size=CHUNK_EXAMPLES):
            examples = [dict(zip(chunk, values, strict=True)) for values in zip(*chunk.values(), strict=True)]
            for example in examples:
                tokens = tokenize_example(tokenizer, to_messages(example, layout, column_map))
                max_token_id = max(max_token_id, max(tokens["input_ids"], default=0))
                write(packer.add(tokens["input_ids"], tokens["labels"], split_long=layout == "text"))
            progress.update(len(examples))
    write(packer.finish(), final=True)
    writer.finalize()
    writer.close()
    return {"examples": packer.examples, "rows": packer.rows, "truncated": packer.truncated,
            "split_documents": packer.split_documents, "max_token_id": max_token_id}


def open_rows(folder: Path):
    """The prepared rows of `folder`, memory-mapped: (train, eval or None, info). `UserError` when this rank does not
    see the folder (another node without the shared `datasets` cache)."""
    from datasets import Dataset

    if not (folder / "info.json").is_file():
        raise UserError(f"this rank cannot see the prepared rows in {folder} (the main process wrote them): on "
                        "several nodes, set HF_DATASETS_CACHE to a folder every node shares.")
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
               "max_token_id": max(info["train"]["max_token_id"], info["eval"]["max_token_id"])}
    return train, evald, summary
