"""Data preparation at corpus scale, launched: 4 runs of the unchanged recipe (DDP, 2 processes), continued
pretraining on synthetic text corpora (jsonl, one document a line) of about 4 MB and 40 MB, and one of
recipes/llama_dpo.py on about 20 MB of synthetic preference pairs.

- Memory: the per-rank peak anonymous RSS (`RssAnon`: not the page cache of memory-mapped rows) during preparation,
  with the private anonymous memory of the two tokenizing workers (--num_proc 2), rises by less than half the
  larger corpus's size from the small corpus to the large one. A copy of the corpus held in memory (its text, or its
  tokens) raises it by the corpus's size or more; about 11 MB of the rise does not scale with the corpus (measured:
  +10.9 MB from 4 to 40 MB, +11.6 MB from 4 to 80 MB).
- Once per job: the other rank never calls the tokenizer, and writes no row file (tests/scripts/harness.py counts the
  calls per process), also with a tokenizer `datasets` cannot hash, which cannot be pickled either: the forked
  workers inherit it.
- Cache: a relaunch with the same settings reuses the rows and says so in its data line (no tokenizer call anywhere);
  another --seq_len prepares again. The in-process half (every dependency of the key, the packer and sampler against
  the code they replaced) is tests/test_prepared_rows.py.
"""

from __future__ import annotations

import pytest
from conftest import isolated_env, launch
from test_prepared_pairs import write_pairs
from test_prepared_rows import write_corpus

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SMALL_DOCS, LARGE_DOCS = 1100, 11000  # ~4 MB and ~40 MB of text (words of 4 to 6 letters, 300 to 900 a document)
LARGE_PAIRS = 5500  # ~20 MB of preference pairs (a prompt and two answers of 100 to 300 words of 3 to 7 letters)
FLAGS = ("--max_steps", "1", "--seq_len", "256", "--per_device_batch_size", "2", "--eval_fraction", "0.01",
         "--num_proc", "2", "--max_new_tokens", "0", "--report_to", "none")
UNHASHABLE = {"ZERO_RECIPES_HARNESS_UNHASHABLE_TOKENIZER": "1"}


@pytest.fixture(scope="module")
def scale(tmp_path_factory):
    """The five launches, sharing one datasets cache (as relaunches on one machine do)."""
    root = tmp_path_factory.mktemp("scale")
    env = {**isolated_env(root), "ZERO_RECIPES_HARNESS_RSS_PROBE": "1"}
    corpora = {name: write_corpus(root / f"{name}.jsonl", docs) for name, docs in (("small", SMALL_DOCS),
                                                                                 ("large", LARGE_DOCS))}
    runs = {}
    launches = {"small": ("small", ()), "large": ("large", ()), "relaunch": ("small", ()),
                "seq_len": ("small", ("--seq_len", "128"))}
    for name, (corpus, extra) in launches.items():
        args = [*FLAGS, "--dataset", str(corpora[corpus]), *extra]
        probes = UNHASHABLE if name == "seq_len" else {}  # a tokenizer that can be neither hashed nor pickled
        runs[name] = launch(root / name, *args, config="ddp", env={**env, **probes}).check()
    corpora["pairs"] = write_pairs(root / "pairs.jsonl", LARGE_PAIRS, words=(100, 300))  # recipes/llama_dpo.py's
    runs["pairs"] = launch(root / "pairs", *FLAGS, "--dataset", str(corpora["pairs"]), "--seq_len", "1024",
                           recipe="recipes/llama_dpo.py", config="ddp", env=env).check()  # whole prompts kept
    return corpora, runs


def test_preparation_memory_does_not_grow_with_the_corpus(scale):
    corpora, runs = scale
    large_bytes = corpora["large"].stat().st_size
    assert large_bytes > 9 * corpora["small"].stat().st_size
    rise = {}
    for name in ("small", "large"):
        (before, peak), _ = runs[name].summary()["data_prep_rss_anon_bytes_per_rank"]
        rise[name] = peak - before
    assert all("(2 tokenizing processes)" in runs[name].output for name in ("small", "large"))  # workers ran
    print(f"RssAnon rise while preparing: small corpus {rise['small'] / 1e6:.1f} MB, large "
          f"{rise['large'] / 1e6:.1f} MB ({large_bytes / 1e6:.1f} MB of text)")
    assert rise["large"] - rise["small"] < large_bytes / 2


def test_preference_preparation_memory_does_not_grow_with_the_pairs(scale):
    """recipes/llama_dpo.py's pairs (PreferenceData.prepare) on about 20 MB of pairs: the RssAnon rise while
    preparing stays within half their size of the small SFT corpus's rise, as the large SFT corpus's does;
    only the main process tokenizes."""
    corpora, runs = scale
    pairs_bytes = corpora["pairs"].stat().st_size
    assert pairs_bytes > 9 * corpora["small"].stat().st_size / 2
    (before, peak), _ = runs["pairs"].summary()["data_prep_rss_anon_bytes_per_rank"]
    (small_before, small_peak), _ = runs["small"].summary()["data_prep_rss_anon_bytes_per_rank"]
    print(f"RssAnon rise while preparing: {pairs_bytes / 1e6:.1f} MB of pairs {(peak - before) / 1e6:.1f} MB, the "
          f"small SFT corpus {(small_peak - small_before) / 1e6:.1f} MB")
    assert "(2 tokenizing processes)" in runs["pairs"].output
    assert (peak - before) - (small_peak - small_before) < pairs_bytes / 2
    assert runs["pairs"].summary()["tokenizer_calls_in_data_prep_per_rank"][1] == 0


def test_only_the_main_process_tokenizes_also_with_an_unhashable_tokenizer(scale):
    """Rank 0's count is its own calls (the eval split's 11 or 110 examples: the train split's are in its
    workers); rank 1 calls it never."""
    _, runs = scale
    for name in ("small", "large", "seq_len"):
        summary = runs[name].summary()
        calls, written = summary["tokenizer_calls_in_data_prep_per_rank"], summary["data_cache_files_written_per_rank"]
        assert calls[0] > 0 and calls[1] == 0, (name, calls)
        assert written == [2, 0], (name, written)  # train and eval rows, by the main process
    assert "documents split into windows" in runs["small"].output


def test_a_relaunch_reuses_the_rows_and_another_seq_len_prepares_again(scale):
    _, runs = scale
    relaunch = runs["relaunch"].summary()
    assert relaunch["tokenizer_calls_in_data_prep_per_rank"] == [0, 0]
    assert relaunch["data_cache_files_written_per_rank"] == [0, 0]
    assert "prepared rows reused from" in runs["relaunch"].output
    assert "prepared rows reused from" not in runs["seq_len"].output
    assert runs["relaunch"].metrics()[0]["loss"] == pytest.approx(runs["small"].metrics()[0]["loss"], rel=1e-6)


def test_a_tokenizer_that_cannot_be_pickled_tokenizes_in_the_workers(scale):
    """The seq_len run's tokenizer cannot be pickled (it holds a generator: `datasets.map(num_proc=2)` would fail
    on it); the forked workers inherit it, so the train split is tokenized by 2 processes there too."""
    _, runs = scale
    assert "(2 tokenizing processes)" in runs["seq_len"].output
