"""Preference pairs prepared once per job, in process: the stored pairs are the in-memory pairs the code before made
(a frozen copy of it below), for any --num_proc; the key changes with everything the pairs depend on; the peak
anonymous memory of a preparation does not grow with the number of pairs. The launched half (one process
tokenizes, a relaunch reuses, the losses of before) is in tests/test_dpo.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO
from transformers import AutoTokenizer

from zero_utils.assets import BUNDLED_MODEL, BUNDLED_PREFERENCES
from zero_utils.data.preparation import prepare as prepare_once
from zero_utils.data.sources import DataSource, choose_splits, load_raw_dataset
from zero_utils.preference.examples import PAIR_COLUMNS, pair_layout, tokenize_pair
from zero_utils.preference.pair_rows import PairRows

pytestmark = pytest.mark.unit

ONE_PROCESS = SimpleNamespace(is_main_process=True, num_processes=1)


# ---------------------------------------------------------------- frozen reference (the code before, unchanged)
def reference_tokenize_pairs(tokenizer, raw, column_map, seq_len, layout):
    pairs, truncated, dropped = [], 0, 0
    names = PAIR_COLUMNS if layout != "conversational, shared turns" else PAIR_COLUMNS[1:]
    columns = [column_map.get(c, c) for c in names]
    for row in raw.select_columns(columns):
        values = [row[c] for c in columns]
        pair = tokenize_pair(tokenizer, *([None] if len(values) == 2 else []), *values, seq_len)
        if pair is None:
            dropped += 1
            continue
        truncated += pair.pop("truncated")
        pairs.append(pair)
    return pairs, {"pairs": len(pairs), "truncated": truncated, "dropped": dropped}


def reference_pairs(tokenizer, dataset, seq_len, eval_fraction, seed, column_map):
    """What PreferenceData.prepare tokenized in memory on every rank before the pairs were prepared once."""
    source = DataSource(dataset)
    raw = load_raw_dataset(source)
    train_split, eval_split = choose_splits(raw, source)
    train_raw, eval_raw = raw[train_split], raw[eval_split] if eval_split else None
    layout = pair_layout(train_raw.column_names, train_raw[0], column_map)
    if eval_raw is None and eval_fraction > 0:
        held_out = train_raw.train_test_split(test_size=eval_fraction, seed=seed)
        train_raw, eval_raw = held_out["train"], held_out["test"]
    train = reference_tokenize_pairs(tokenizer, train_raw, column_map, seq_len, layout)
    evaluation = reference_tokenize_pairs(tokenizer, eval_raw, column_map, seq_len, layout) \
        if eval_raw is not None else ([], {"pairs": 0, "truncated": 0, "dropped": 0})
    return train, evaluation


# ---------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(BUNDLED_MODEL)


def prepare(tmp_path, tokenizer, dataset, seq_len=128, eval_fraction=0.0, seed=0, column_map=None, num_proc=1,
            cache="pairs"):
    return prepare_once(ONE_PROCESS, tokenizer, str(dataset), PairRows(seq_len), eval_fraction=eval_fraction,
                        seed=seed, column_map=column_map or {}, cache_root=tmp_path / cache, num_proc=num_proc)


def write_pairs(path: Path, num_pairs: int, words: tuple[int, int] = (5, 20), columns=("prompt", "chosen", "rejected"),
                seed: int = 0) -> Path:
    """A jsonl preference set of random words: a prompt and two answers of `words` words each."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 7)))
                  for _ in range(2000)]

    def text():
        return " ".join(rng.choices(vocabulary, k=rng.randint(*words)))

    with open(path, "w") as f:
        for _ in range(num_pairs):
            f.write(json.dumps(dict(zip(columns, (text(), text(), text()), strict=True))) + "\n")
    return path


def stored(rows) -> list[dict]:
    return [{k: rows[i][k] for k in ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels")}
            for i in range(len(rows))]


# ---------------------------------------------------------------- tests
def test_stored_pairs_are_the_in_memory_pairs_of_before_for_any_num_proc(tmp_path, tokenizer, monkeypatch):
    """The bundled 2,000 pairs with 5% held out (the train split above PARALLEL_MIN_EXAMPLES: 2 workers tokenize it):
    the same pairs in the same order, the same counts, as the code before held in memory; at --seq_len 24 many
    pairs are cut and some dropped, also the same."""
    for seq_len in (128, 24):
        (ref_train, ref_train_counts), (ref_eval, ref_eval_counts) = reference_pairs(
            tokenizer, BUNDLED_PREFERENCES, seq_len, 0.05, 42, {})
        for num_proc in (1, 2):
            train, evaluation, info = prepare(tmp_path, tokenizer, BUNDLED_PREFERENCES, seq_len=seq_len,
                                              eval_fraction=0.05, seed=42, num_proc=num_proc, cache=f"c{num_proc}")
            assert stored(train) == ref_train and stored(evaluation) == ref_eval, (seq_len, num_proc)
            assert (info["train"], info["eval"]) == (ref_train_counts, ref_eval_counts)
            assert info["tokenizing_processes"] == num_proc and info["cache_files_written"] == 2
        assert train["chosen_tokens"] == [sum(x != -100 for x in p["chosen_labels"]) for p in ref_train]
        assert train["tokens"] == [len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in ref_train]
    assert ref_train_counts["truncated"] > 0 and ref_train_counts["dropped"] > 0  # the cut rule was exercised
    files = sorted(p.name for p in Path(info["folder"]).iterdir())
    assert files == [".in_use", "eval.arrow", "info.json", "train.arrow"]  # .in_use: zero_utils.data.cache.hold


def test_the_key_changes_with_what_the_pairs_depend_on_and_a_relaunch_reuses(tmp_path, tokenizer):
    pairs = write_pairs(tmp_path / "pairs.jsonl", 30)
    first = prepare(tmp_path, tokenizer, pairs)[2]
    again = prepare(tmp_path, tokenizer, pairs)[2]
    assert not first["reused"] and again["reused"] and again["folder"] == first["folder"]
    assert again["cache_files_written"] == 0
    renamed = write_pairs(tmp_path / "renamed.jsonl", 30, columns=("question", "good", "bad"))
    changed = {"seq_len": prepare(tmp_path, tokenizer, pairs, seq_len=64)[2],
               "seed": prepare(tmp_path, tokenizer, pairs, eval_fraction=0.1, seed=1)[2],
               "eval_fraction": prepare(tmp_path, tokenizer, pairs, eval_fraction=0.1)[2],
               "columns": prepare(tmp_path, tokenizer, renamed,
                                  column_map={"prompt": "question", "chosen": "good", "rejected": "bad"})[2]}
    chat = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    chat.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    changed["chat template"] = prepare(tmp_path, chat, pairs)[2]
    another = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    another.add_tokens(["<an added token>"])  # another vocabulary
    changed["tokenizer"] = prepare(tmp_path, another, pairs)[2]
    write_pairs(pairs, 31)  # the data changes
    changed["data"] = prepare(tmp_path, tokenizer, pairs)[2]
    folders = {info["folder"] for info in changed.values()} | {first["folder"]}
    assert len(folders) == len(changed) + 1 and not any(info["reused"] for info in changed.values())


PROBE = """
import json, sys
sys.path.insert(0, {scripts!r})
from types import SimpleNamespace
from transformers import AutoTokenizer
from harness import _RssAnonPeak
from zero_utils.assets import BUNDLED_MODEL
from zero_utils.data.preparation import prepare
from zero_utils.preference.pair_rows import PairRows
from zero_utils.data.sources import DataSource, load_raw_dataset
tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
load_raw_dataset(DataSource({data!r}))  # datasets' own JSON -> Arrow conversion (10 MB blocks), done before
with _RssAnonPeak() as probe:
    train, _, info = prepare(SimpleNamespace(is_main_process=True, num_processes=1), tokenizer, {data!r},
                             PairRows(512), eval_fraction=0.01, seed=0, cache_root={cache!r}, num_proc=2)
print(json.dumps({{"rise": probe.peak - probe.before, "pairs": len(train)}}))
"""


@pytest.mark.slow
def test_preparation_memory_does_not_grow_with_the_number_of_pairs(tmp_path):
    """The peak anonymous memory of a preparation (this process's RssAnon and its 2 tokenizing workers' private
    memory, sampled every 2 ms: tests/scripts/harness.py; the raw file already converted to Arrow by `datasets`,
    whose JSON reader parses 10 MB blocks, as a relaunch finds it) for 1,100 and 11,000 pairs of about 0.8 KB (both
    train splits of 1,000 or more: the workers run in both), each in a fresh process: the rise with 10x the pairs is
    under a quarter of the larger set's size (holding the tokenized pairs in lists, as the code before did, costs
    about 36 bytes a token: several times the file)."""
    rise = {}
    for name, count in (("small", 1100), ("large", 11_000)):
        data = write_pairs(tmp_path / f"{name}.jsonl", count, words=(30, 50))
        code = PROBE.format(scripts=str(REPO / "tests/scripts"), data=str(data), cache=str(tmp_path / f"c-{name}"))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO,
                              env={**os.environ, "TQDM_DISABLE": "1",
                                   "HF_DATASETS_CACHE": str(tmp_path / f"hf-{name}")})
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["pairs"] > 0.95 * count
        rise[name] = result["rise"]
    large_bytes = (tmp_path / "large.jsonl").stat().st_size
    print(f"RssAnon rise while preparing: 1,100 pairs {rise['small'] / 1e6:.1f} MB, 11,000 pairs "
          f"{rise['large'] / 1e6:.1f} MB ({large_bytes / 1e6:.1f} MB of pairs)")
    assert rise["large"] - rise["small"] < large_bytes / 4

