"""Where a run's data comes from, and every failure to reach it as one sentence: the layouts users keep, Hub data
sets with their configuration and revision, and which split trains and which evaluates.

    DataSource("/data/sft")                                    a folder of jsonl / parquet / arrow / csv / txt shards
    DataSource("sft.jsonl.gz")                                 one file, gzip/bz2/xz/zstd-compressed or not
    DataSource("/data/saved")                                  a `save_to_disk` folder (a Dataset or a DatasetDict)
    DataSource("HuggingFaceH4/ultrachat_200k", split="train_sft,test_sft", config="", revision="main")

Splits: `split` is "TRAIN[,EVAL]"; without it the train split is "train" (else the first), and the eval split the
data set's "validation" or "test" (else a fraction of the train split is held out by the caller). A name the data set
does not have is a `UserError` listing those it has; so are an empty file, a folder with no data file of a known
kind, an unknown configuration, and any failure to reach the Hub (zero_utils.run.hub).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zero_utils.run.errors import UserError
from zero_utils.run.hub import failure_sentence, reaching

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text",
            ".arrow": "arrow"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
# `datasets` converts local json and text files to Arrow a block at a time (10 MiB by default): 1 MiB blocks keep the
# conversion's memory small next to the tokenizer's.
_BLOCKS = {"json": {"chunksize": 1 << 20}, "text": {"chunksize": 1 << 20}}
_SAVED = ("dataset_dict.json", "state.json")  # what `save_to_disk` writes (a DatasetDict, a Dataset)


@dataclass(frozen=True)
class DataSource:
    """A data set as the recipe flags name it: --dataset, --dataset_split TRAIN[,EVAL], --dataset_config and
    --dataset_revision (the last two for Hub data sets)."""

    name: str
    split: str = ""
    config: str = ""
    revision: str = ""

    @property
    def is_local(self) -> bool:
        path = Path(self.name).expanduser()
        return (file_kind(path) is not None or self.name.startswith((".", "/", "~")) or path.exists()
                or path.suffix in COMPRESSIONS)

    def splits(self) -> tuple[str | None, str | None]:
        """(TRAIN, EVAL) as --dataset_split names them, None where it names none."""
        train, _, evaluate = self.split.partition(",")
        return train.strip() or None, evaluate.strip() or None


def file_kind(path: Path) -> str | None:
    """The `datasets` builder of a data file by its extension, looking through a compression suffix
    (`x.jsonl.gz` -> json; parquet and arrow are never compressed this way), or None."""
    if path.suffix in COMPRESSIONS:
        inner = BUILDERS.get(Path(path.stem).suffix)
        return inner if inner in ("json", "csv", "text") else None
    return BUILDERS.get(path.suffix)


def load_raw_dataset(source: DataSource | str):
    """The data set as a `datasets.DatasetDict` (memory-mapped Arrow), from any layout of the module docstring."""
    import datasets

    source = DataSource(source) if isinstance(source, str) else source
    if not source.is_local:
        return _load_from_hub(source)
    path, name = Path(source.name).expanduser(), source.name
    if not path.exists():
        raise UserError(f"--dataset {name!r} does not exist; pass an existing local file or folder, or a Hub data "
                        "set id.")
    for flag, value in (("--dataset_config", source.config), ("--dataset_revision", source.revision)):
        if value:
            raise UserError(f"{flag} {value!r} applies to Hub data sets; --dataset {name!r} is local: drop it.")
    if path.is_file():
        builder = file_kind(path)
        if builder is None:
            raise UserError(f"--dataset {name!r} has an unsupported extension; use one of "
                            f"{', '.join(sorted(BUILDERS))} (json, csv and txt may be compressed: "
                            f"{', '.join(COMPRESSIONS)}).")
        _check_not_empty([path], name)
        return datasets.load_dataset(builder, data_files={"train": str(path)}, **_BLOCKS.get(builder, {}))
    if any((path / marker).is_file() for marker in _SAVED):  # a save_to_disk folder
        saved = datasets.load_from_disk(str(path))
        return saved if isinstance(saved, datasets.DatasetDict) else datasets.DatasetDict({"train": saved})
    files = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in
                                                                        p.relative_to(path).parts))
    known = [p for p in files if file_kind(p)]
    if not known:
        held = ", ".join(p.name for p in files[:5]) + (", ..." if len(files) > 5 else "") if files else "nothing"
        raise UserError(f"--dataset {name!r} holds no data file of a known kind ({', '.join(sorted(BUILDERS))}, "
                        f"or a save_to_disk folder); it holds: {held}.")
    _check_not_empty(known, name)
    kinds = {file_kind(p) for p in known}
    return datasets.load_dataset(str(path), **(_BLOCKS.get(kinds.pop(), {}) if len(kinds) == 1 else {}))


def _check_not_empty(files: list[Path], name: str) -> None:
    empty = [p for p in files if p.stat().st_size == 0]
    if empty:
        what = f"--dataset {name!r}" + ("" if empty[0] == Path(name).expanduser() else f": {empty[0].name}")
        raise UserError(f"{what} is empty (0 bytes); remove it or write its data again.")


def _load_from_hub(source: DataSource):
    import datasets

    with reaching("--dataset", source.name, revision=source.revision or None, revision_flag="--dataset_revision",
                  repo_type="dataset"):
        try:
            return datasets.load_dataset(source.name, source.config or None, revision=source.revision or None)
        except ValueError as error:  # an unknown or missing configuration: datasets names the ones it has
            text = str(error)
            if "BuilderConfig" in text and "not found" in text:
                raise UserError(f"--dataset_config {source.config!r} is not a configuration of {source.name!r}; "
                                f"{text[text.index('Available'):] if 'Available' in text else text}") from None
            if "Config name is missing" in text:
                raise UserError(f"--dataset {source.name!r} has several configurations; pick one with "
                                f"--dataset_config ({text[text.index('among'):] if 'among' in text else text})") \
                    from None
            raise


def choose_splits(raw, source: DataSource) -> tuple[str, str | None]:
    """(the split that trains, the split that evaluates or None) of `raw` (a DatasetDict) for `source`: the names
    --dataset_split gives, else "train" (or the first split) and "validation" or "test" if there is one."""
    train, evaluate = source.splits()
    for name in (train, evaluate):
        if name is not None and name not in raw:
            raise UserError(f"--dataset_split {name!r} is not a split of --dataset {source.name!r}; it has: "
                            f"{', '.join(raw)}.")
    train = train or ("train" if "train" in raw else next(iter(raw)))
    if evaluate is None:
        evaluate = next((s for s in ("validation", "test") if s in raw and s != train), None)
    if evaluate == train:
        raise UserError(f"--dataset_split {source.split!r} trains and evaluates on the same split; name two splits.")
    return train, evaluate


def data_fingerprint(source: DataSource, raw) -> dict:
    """What identifies the data: each local file's path, size and modification time (ns), or a Hub id with its
    configuration, revision and the fingerprints `datasets` gave the splits it loaded."""
    if source.is_local:
        path = Path(source.name).expanduser().resolve()
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        return {"files": [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
    return {"hub": source.name, "config": source.config, "revision": source.revision,
            "splits": {name: split._fingerprint for name, split in raw.items()}}


def check_mixture_reachable(mixture) -> None:
    """Before a mixture's preparation reads any source: every source of `mixture` (a `mixture.Mixture`) can be
    reached. A local path exists (relative to the launch's directory, as --dataset); a Hub data set resolves
    (`datasets.load_dataset_builder`: its repository, revision and module, from the cache when offline; no data
    file is downloaded). `UserError` naming the first source that cannot be reached, its position (source i of n)
    and the file that lists it; failures past reaching (a configuration to choose, a split, a column) are left to
    the load, which names them."""
    import datasets

    for position, source in enumerate(mixture.sources, 1):
        where = f"dataset_mixture source {position} of {len(mixture.sources)} ({mixture.where})"
        if DataSource(source.id).is_local:
            if not Path(source.id).expanduser().exists():
                raise UserError(f"{where}: {source.id!r} does not exist; give an existing local file or folder "
                                "(a relative path starts at the directory you launch from) or a Hub data set id.")
            continue
        with reaching(f"{where}:", source.id, revision=source.revision or None, revision_flag=f"{where}: revision",
                      repo_type="dataset"):
            try:
                datasets.load_dataset_builder(source.id, source.config or None, revision=source.revision or None)
            except ValueError as error:  # reached; a configuration to choose is the load's sentence
                if failure_sentence(error, "", source.id, repo_type="dataset") is not None:
                    raise


def load_mixture_source(source) -> tuple:
    """One source of a dataset mixture (`mixture.MixtureSource`) loaded as --dataset loads one: (its train
    split's name, the split, its data fingerprint), the split reduced to the source's kept `columns` if it names
    any. `UserError` for a source without rows or without a kept column (the columns it has named)."""
    named = DataSource(source.id, source.split, source.config, source.revision)
    raw = load_raw_dataset(named)
    train_split, _ = choose_splits(raw, named)
    data = raw[train_split]
    if len(data) == 0:
        raise UserError(f"dataset_mixture source {source.id!r} has no rows in its {train_split!r} split.")
    kept = source.kept_columns()
    if kept:
        missing = [c for c in kept if c not in data.column_names]
        if missing:
            raise UserError(f"dataset_mixture source {source.id!r} has no column(s) {', '.join(missing)}; it has "
                            f"{', '.join(sorted(data.column_names))}.")
        data = data.select_columns(kept)
    return train_split, data, data_fingerprint(named, raw)
