"""The data and models users already have, in process: every local layout prepared through the recipe's own data
function (`TrainingData.prepare`) with its data line, --dataset_split / --dataset_config / --dataset_revision, and
every failure to reach a model or data set as one sentence: offline for real (an empty cache, HF_HUB_OFFLINE=1, in
a subprocess), the other Hub failures by raising huggingface_hub's and datasets' own exception types into the
functions that load. The launched half is tests/test_bad_input.py and tests/test_data_layouts.py."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO
from transformers import AutoConfig

from zero_utils.assets import BUNDLED_MODEL
from zero_utils.data import preparation
from zero_utils.data import sources as data_sources
from zero_utils.data import training as data
from zero_utils.data.sources import DataSource
from zero_utils.model import loading as model
from zero_utils.run import hub
from zero_utils.run.errors import UserError

pytestmark = pytest.mark.unit

CHAT = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "2 plus 3 is 5."}]
ONE_PROCESS = SimpleNamespace(is_main_process=True, num_processes=1, process_index=0, device="cpu")


def records(n=24, tag="x"):
    return [{"messages": [CHAT[0], {"role": "assistant", "content": f"{tag} answer {i}"}]} for i in range(n)]


def write_layout(root, layout):
    """Write `records()` in one of the layouts users keep; returns (--dataset, --dataset_split)."""
    import datasets

    ds = datasets.Dataset.from_list(records())
    path = root / layout
    if layout == "save_to_disk_dataset":
        ds.save_to_disk(str(path))
    elif layout == "save_to_disk_dict":
        datasets.DatasetDict({"train_sft": ds, "test_sft": datasets.Dataset.from_list(records(6, "t"))}).save_to_disk(
            str(path))
        return str(path), "train_sft,test_sft"
    elif layout in ("jsonl_shards", "parquet_shards", "arrow_shards", "jsonl_gz_shards"):
        path.mkdir()
        for i in range(3):
            shard = ds.shard(3, i)
            if layout == "jsonl_shards":
                shard.to_json(str(path / f"part-{i}.jsonl"))
            elif layout == "parquet_shards":
                shard.to_parquet(str(path / f"part-{i}.parquet"))
            elif layout == "jsonl_gz_shards":
                with gzip.open(path / f"part-{i}.jsonl.gz", "wt") as f:
                    f.writelines(json.dumps(r) + "\n" for r in shard.to_list())
            else:
                from datasets.arrow_writer import ArrowWriter

                writer = ArrowWriter(path=str(path / f"part-{i}.arrow"))
                writer.write_table(shard.data.table)
                writer.finalize()
                writer.close()
    elif layout == "jsonl_gz":
        path = root / "sft.jsonl.gz"
        with gzip.open(path, "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in records())
    return str(path), ""


@pytest.fixture(scope="module")
def tokenizer():
    return model.load_tokenizer(BUNDLED_MODEL)


def prepare(tmp_path, tokenizer, source, monkeypatch, **kwargs):
    monkeypatch.setattr(preparation, "rows_cache_root", lambda: tmp_path / "rows")
    settings = {"columns": "", "seq_len": 64, "eval_fraction": 0.25, "seed": 0, "per_device_batch_size": 1,
                "gradient_accumulation_steps": 1, "attn_implementation": "", **kwargs}
    return data.TrainingData.prepare(ONE_PROCESS, tokenizer, model.load_config(BUNDLED_MODEL), dataset=source,
                                     **settings)


@pytest.mark.parametrize("layout", ["save_to_disk_dataset", "save_to_disk_dict", "jsonl_shards", "parquet_shards",
                                    "arrow_shards", "jsonl_gz_shards", "jsonl_gz"])
def test_every_local_layout_users_keep_is_prepared(tmp_path, tokenizer, monkeypatch, layout):
    name, split = write_layout(tmp_path, layout)
    train_data = prepare(tmp_path, tokenizer, DataSource(name, split), monkeypatch)
    line = train_data.describe().splitlines()[-1]
    assert line.startswith("data: messages layout")
    if layout == "save_to_disk_dict":  # both named splits: 24 examples train, 6 evaluate
        assert "(train: 'train_sft', eval: 'test_sft'), 24 train / 6 eval examples" in line, line
    else:  # one split: a quarter of the 24 held out
        assert "(train: 'train', eval: 0.25 of 'train' held out), 18 train / 6 eval examples" in line, line


def test_split_names_a_data_set_does_not_have_are_listed(tmp_path, tokenizer, monkeypatch):
    name, _ = write_layout(tmp_path, "save_to_disk_dict")
    with pytest.raises(UserError, match=r"--dataset_split 'train' is not a split of .*; it has: train_sft, test_sft"):
        prepare(tmp_path, tokenizer, DataSource(name, "train"), monkeypatch)
    with pytest.raises(UserError, match="--dataset_split 'valid'.*it has: train_sft, test_sft"):
        prepare(tmp_path, tokenizer, DataSource(name, "train_sft,valid"), monkeypatch)
    with pytest.raises(UserError, match="same split"):
        prepare(tmp_path, tokenizer, DataSource(name, "train_sft,train_sft"), monkeypatch)
    # TRAIN alone: the eval split is chosen as without the flag (here none is named validation/test: held out)
    line = prepare(tmp_path, tokenizer, DataSource(name, "test_sft"), monkeypatch).describe()
    assert "(train: 'test_sft', eval: 0.25 of 'test_sft' held out)" in line


@pytest.mark.parametrize("make, needle", [
    (lambda p: (p / "empty.jsonl").write_text("") and None or p / "empty.jsonl", "is empty (0 bytes)"),
    (lambda p: (p / "shards").mkdir() or (p / "shards" / "a.jsonl").write_text("") and None or p / "shards",
     "a.jsonl is empty (0 bytes)"),
    (lambda p: (p / "notes").mkdir() or (p / "notes" / "README.md").write_text("hi") and None or p / "notes",
     "holds no data file of a known kind"),
    (lambda p: (p / "data.xlsx").write_text("x") and None or p / "data.xlsx", "unsupported extension"),
])
def test_local_data_that_cannot_train_is_one_sentence(tmp_path, make, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        data_sources.load_raw_dataset(str(make(tmp_path)))


def test_hub_only_flags_on_local_data_are_refused(tmp_path):
    name, _ = write_layout(tmp_path, "jsonl_gz")
    for source, flag in ((DataSource(name, config="default"), "--dataset_config"),
                         (DataSource(name, revision="main"), "--dataset_revision")):
        with pytest.raises(UserError, match=f"{flag} .* applies to Hub data sets"):
            data_sources.load_raw_dataset(source)


def test_model_folders_without_config_or_tokenizer_are_one_sentence(tmp_path):
    import shutil

    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    shutil.copy(f"{BUNDLED_MODEL}/config.json", no_tokenizer)
    with pytest.raises(UserError, match="has no tokenizer .*tokenizer.save_pretrained"):
        model.load_tokenizer(str(no_tokenizer))
    (tmp_path / "no_config").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        model.load_config(str(tmp_path / "no_config"))


# ---------------------------------------------------------------- the Hub, with the libraries' own exception types
def _response(status):
    try:
        import httpx2 as httpx  # what this huggingface_hub build uses
    except ImportError:
        import httpx
    return httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/x"))


def hub_error(kind):
    from huggingface_hub import errors

    if kind == "gated":
        return errors.GatedRepoError("Access to model is restricted", response=_response(401))
    if kind == "missing":
        return errors.RepositoryNotFoundError("Repository Not Found", response=_response(404))
    if kind == "revision":
        return errors.RevisionNotFoundError("Revision Not Found", response=_response(404))
    if kind == "network":
        return errors.LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub")
    raise ValueError(kind)


SENTENCES = {"gated": "is a gated repository: accept its licence on https://huggingface.co/",
             "missing": "does not exist on the Hub (or is private): check the spelling",
             "revision": "--revision 'v9' does not exist in 'org/model'",
             "network": "could not reach the Hub for --model 'org/model' (a network error)"}


@pytest.mark.parametrize("kind", list(SENTENCES))
def test_model_hub_failures_are_one_sentence(monkeypatch, kind):
    """As transformers raises them: an OSError whose cause is huggingface_hub's error."""
    def from_pretrained(*args, **kwargs):
        raise OSError("transformers' own wording") from hub_error(kind)

    monkeypatch.setattr(AutoConfig, "from_pretrained", from_pretrained)
    with pytest.raises(UserError) as info:
        model.load_config("org/model", revision="v9")
    assert SENTENCES[kind] in str(info.value)
    if kind == "gated":
        assert "`hf auth login` (or set HF_TOKEN)" in str(info.value)


@pytest.mark.parametrize("kind, needle", [
    ("gated", "is a gated repository: accept its licence on https://huggingface.co/datasets/org/data"),
    ("missing", "--dataset 'org/data' does not exist on the Hub"),
    ("revision", "--dataset_revision 'v9' does not exist in 'org/data'"),
    ("datasets_missing", "--dataset 'org/data' does not exist on the Hub"),
    ("config", "--dataset_config 'nope' is not a configuration of 'org/data'; Available: ['default', 'small']"),
    ("no_config", "has several configurations; pick one with --dataset_config (among the available configs"),
])
def test_data_set_hub_failures_are_one_sentence(monkeypatch, kind, needle):
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    def load_dataset(*args, **kwargs):
        if kind == "datasets_missing":
            raise DatasetNotFoundError("Dataset 'org/data' doesn't exist on the Hub or cannot be accessed.")
        if kind == "config":
            raise ValueError("BuilderConfig 'nope' not found. Available: ['default', 'small']")
        if kind == "no_config":
            raise ValueError("Config name is missing.\nPlease pick one among the available configs: ['a', 'b']")
        raise hub_error(kind)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(UserError) as info:
        data_sources.load_raw_dataset(DataSource("org/data", config="nope", revision="v9"))
    assert needle in str(info.value)


def test_an_error_that_is_not_about_reaching_passes_unchanged():
    with pytest.raises(KeyError), hub.reaching("--model", "org/model"):
        raise KeyError("a bug, not a user's mistake")


def test_offline_with_an_empty_cache_names_hf_hub_offline_and_the_download(tmp_path):
    """For real: no network here, an empty HF_HOME and HF_HUB_OFFLINE=1, as a user on a compute node meets it."""
    code = ("from zero_utils.data import sources as data_sources\nfrom zero_utils.model import loading as model\n"
            "from zero_utils.run.errors import UserError\n"
            "for load in (lambda: model.load_tokenizer('meta-llama/Llama-3.2-1B'),\n"
            "             lambda: model.load_config('meta-llama/Llama-3.2-1B', revision='main'),\n"
            "             lambda: data_sources.load_raw_dataset('HuggingFaceH4/ultrachat_200k')):\n"
            "    try:\n        load()\n    except UserError as error:\n        print(error)\n")
    env = {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out.stdout + out.stderr[-3000:]
    for line, download in zip(lines, ("hf download meta-llama/Llama-3.2-1B", "hf download meta-llama/Llama-3.2-1B",
                                      "hf download --repo-type dataset HuggingFaceH4/ultrachat_200k"), strict=True):
        assert "is not in the local cache and HF_HUB_OFFLINE=1 forbids downloading it" in line, line
        assert download in line, line
