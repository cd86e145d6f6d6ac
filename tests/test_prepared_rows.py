"""Rows prepared once per job, in process: the bounded packer and the epoch sampler against frozen copies of the code
they replaced, documents split into windows, the cache key, and tokenizers `datasets` cannot hash. The launched
behaviour (memory that does not grow with the corpus, other ranks that never tokenize, a relaunch that reuses the
rows) is tests/test_data_scale.py."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pyarrow
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from zero_utils.assets import BUNDLED_DATASET, BUNDLED_MODEL
from zero_utils.data import packing, preparation, sft_examples, sft_rows, source_stream
from zero_utils.data import sources as data_sources
from zero_utils.data import training as data
from zero_utils.data.sft_rows import SFTRows
from zero_utils.run.errors import UserError

pytestmark = pytest.mark.unit

ONE_PROCESS = SimpleNamespace(is_main_process=True, num_processes=1)
IGNORE = -100


# ---------------------------------------------------------------- frozen references (the code before, unchanged)
def reference_pack_examples(examples, seq_len, pad_token_id):
    """`pack_examples` of data.py (zero_utils/data/training.py now) as of commit 01486b0 (one batch of Python
    lists): the reference."""
    rows, cur_ids, cur_labels, cur_pos, truncated = [], [], [], [], 0

    def flush():
        pad = seq_len - len(cur_ids)
        if pad:
            cur_ids.extend([pad_token_id] * pad)
            cur_labels.extend([IGNORE] * pad)
            cur_pos.extend(range(pad))
        rows.append({"input_ids": list(cur_ids), "labels": list(cur_labels), "position_ids": list(cur_pos)})
        cur_ids.clear(), cur_labels.clear(), cur_pos.clear()

    for ex in examples:
        ids, labels = ex["input_ids"], ex["labels"]
        if len(ids) > seq_len:
            truncated += 1
            ids, labels = ids[:seq_len], labels[: seq_len - 1] + [IGNORE]
        if not any(label != IGNORE for label in labels):
            continue
        if len(cur_ids) + len(ids) > seq_len:
            flush()
        cur_ids += ids
        cur_labels += labels
        cur_pos += range(len(ids))
    if cur_ids:
        flush()
    return rows, truncated


def reference_global_batch_indices(num_rows, global_batch_size, step, seed):
    """`global_batch_indices` of data.py (zero_utils/data/training.py now) as of commit 01486b0 (a permutation drawn
    every step)."""
    batches_per_epoch = num_rows // global_batch_size
    epoch, batch_in_epoch = divmod(step - 1, batches_per_epoch)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    start = batch_in_epoch * global_batch_size
    return order[start:start + global_batch_size].tolist()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(BUNDLED_MODEL)


def prepare(tmp_path, tokenizer, dataset, seq_len=128, eval_fraction=0.0, seed=0, column_map=None, num_proc=1,
            cache="rows"):
    return preparation.prepare(ONE_PROCESS, tokenizer, str(dataset),
                               SFTRows(seq_len, data.pad_token_id_within(tokenizer, len(tokenizer))),
                               eval_fraction=eval_fraction, seed=seed, column_map=column_map,
                               cache_root=tmp_path / cache, num_proc=num_proc)


def as_lists(rows):
    return [{k: rows[i][k].tolist() for k in ("input_ids", "labels", "position_ids")} for i in range(len(rows))]


@pytest.mark.parametrize("seq_len", [64, 128, 512])
def test_bounded_packer_gives_the_reference_rows_on_the_bundled_data(tmp_path, tokenizer, seq_len):
    """The streaming preparation (chunks of examples, the open row carried, Arrow rows) writes exactly the rows the
    old one-batch packer made of the same split, train and held-out alike."""
    train, evald, info = prepare(tmp_path, tokenizer, BUNDLED_DATASET, seq_len=seq_len, eval_fraction=0.1)
    raw = data_sources.load_raw_dataset(BUNDLED_DATASET)["train"].train_test_split(test_size=0.1, seed=0)
    pad = data.pad_token_id_within(tokenizer, len(tokenizer))
    for rows, split in ((train, raw["train"]), (evald, raw["test"])):
        tokenized = [sft_examples.tokenize_example(tokenizer, sft_examples.to_messages(ex, "messages")) for ex in split]
        expected, truncated = reference_pack_examples(tokenized, seq_len, pad)
        assert as_lists(rows) == expected
    assert info["train_rows"] == len(train) and info["eval_rows"] == len(evald)
    counts = data.loss_tokens_per_row(train)  # the packer's own column, not recounted
    assert counts.tolist() == [sum(label != IGNORE for label in row["labels"]) for row in as_lists(train)]


def test_rows_do_not_depend_on_the_chunk_sizes(tmp_path, tokenizer, monkeypatch):
    """Small read and write chunks (7 examples, 3 rows of 96 tokens): the open row crosses chunk borders, the rows
    stay the reference's."""
    monkeypatch.setattr(source_stream, "CHUNK_EXAMPLES", 7)
    monkeypatch.setattr(sft_rows, "WRITE_TOKENS", 3 * 96)
    train, _, info = prepare(tmp_path, tokenizer, BUNDLED_DATASET, seq_len=96)
    split = data_sources.load_raw_dataset(BUNDLED_DATASET)["train"]
    tokenized = [sft_examples.tokenize_example(tokenizer, sft_examples.to_messages(ex, "messages")) for ex in split]
    expected, _ = reference_pack_examples(tokenized, 96, data.pad_token_id_within(tokenizer, len(tokenizer)))
    assert as_lists(train) == expected
    # pyarrow reads the file as record batches of WRITE_TOKENS tokens (every rank opening the rows holds a few KB of
    # metadata per batch, so their size, not the buffer's convenience, sets it), the last one the rest
    with pyarrow.memory_map(str(Path(info["folder"]) / "train.arrow")) as source:
        sizes = [batch.num_rows for batch in pyarrow.ipc.open_stream(source)]
    assert sizes == [3] * (len(expected) // 3) + ([len(expected) % 3] if len(expected) % 3 else [])


def test_the_epoch_sampler_draws_the_reference_order_once_per_epoch():
    """Same rows in the same order as the per-step permutation it replaces (exact resume and resume on another
    world size still hold), for several row counts, batches, seeds and epochs; the permutation is drawn once per
    epoch, not per step."""
    for num_rows, batch, seed in ((53, 10, 1), (1000, 64, 7), (8, 8, 0)):
        for step in range(1, 3 * (num_rows // batch) + 2):
            assert data.global_batch_indices(num_rows, batch, step, seed) == reference_global_batch_indices(
                num_rows, batch, step, seed)
    data.epoch_order.cache_clear()
    for step in range(1, 16):  # 5 batches per epoch: 3 epochs
        data.global_batch_indices(53, 10, step, seed=3)
    assert data.epoch_order.cache_info().misses == 3


def test_a_long_document_is_split_into_windows_that_cover_it_exactly(tokenizer):
    document = sft_examples.tokenize_example(tokenizer, " ".join(f"w{i}" for i in range(300)))
    short = sft_examples.tokenize_example(tokenizer, "a short one")
    assert len(document["input_ids"]) > 3 * 64
    packer = packing.Packer(64, 0)
    rows = packer.add(short["input_ids"], short["labels"], split_long=True)
    rows += packer.add(document["input_ids"], document["labels"], split_long=True) + packer.finish()
    assert packer.split_documents == 1 and packer.truncated == 0
    # the short document's row closes first; then full windows, then the tail of the document, padded
    windows = [(r["input_ids"], r["labels"], r["position_ids"]) for r in rows[1:]]
    n_tail = len(document["input_ids"]) % 64
    ids = sum((w[0] for w in windows[:-1]), []) + windows[-1][0][:n_tail]
    labels = sum((w[1] for w in windows[:-1]), []) + windows[-1][1][:n_tail]
    assert ids == document["input_ids"] and labels == document["labels"]
    assert all(w[2][:n_tail] == list(range(n_tail)) for w in windows)
    # every target of the document is in a row: all but its last token (EOS predicts nothing)
    assert sum(r["num_loss_tokens"] for r in rows[1:]) == len(document["input_ids"]) - 1


def test_sft_examples_keep_truncation(tokenizer):
    long = sft_examples.tokenize_example(tokenizer, [{"role": "user", "content": "q"},
                                                     {"role": "assistant", "content": "word " * 200}])
    packer = packing.Packer(64, 0)
    rows = packer.add(long["input_ids"], long["labels"]) + packer.finish()
    assert packer.truncated == 1 and packer.split_documents == 0 and len(rows) == 1


def test_packed_documents_have_the_logits_each_has_alone(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    docs = [sft_examples.tokenize_example(tokenizer, text) for text in ("the first document", "and a second one")]
    rows, _ = packing.pack_examples(docs, 128, 0, split_long=True)
    [row] = rows
    with torch.no_grad():
        packed = model(input_ids=torch.tensor([row["input_ids"]]), position_ids=torch.tensor([row["position_ids"]]),
                       use_cache=False).logits[0]
        start = 0
        for doc in docs:
            alone = model(input_ids=torch.tensor([doc["input_ids"]]), use_cache=False).logits[0]
            torch.testing.assert_close(packed[start:start + len(doc["input_ids"])], alone, rtol=1e-4, atol=1e-4)
            start += len(doc["input_ids"])


def write_corpus(path, num_docs, seed=0, words=(300, 900)):
    rng = random.Random(seed)
    vocabulary = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "north", "quiet", "market"]
    with path.open("w") as f:
        for _ in range(num_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(vocabulary) for _ in range(rng.randint(*words)))}) + "\n")
    return path


def test_text_layout_prepares_documents_with_loss_on_every_token(tmp_path, tokenizer):
    corpus = write_corpus(tmp_path / "corpus.jsonl", 40)
    train, evald, info = prepare(tmp_path, tokenizer, corpus, seq_len=256)
    assert info["layout"] == "text" and evald is None and info["truncated_examples"] == 0
    documents = [sft_examples.tokenize_example(tokenizer, json.loads(line)["text"])
                 for line in corpus.read_text().splitlines()]
    assert info["split_documents"] == sum(len(d["input_ids"]) > 256 for d in documents) > 0
    assert int(data.loss_tokens_per_row(train).sum()) == sum(len(d["input_ids"]) - 1 for d in documents)
    assert "documents split into windows" in data.describe(info, 256)


def test_a_relaunch_reuses_the_rows_and_any_dependency_prepares_again(tmp_path, tokenizer):
    corpus = write_corpus(tmp_path / "corpus.jsonl", 20)
    first = prepare(tmp_path, tokenizer, corpus)[2]
    again = prepare(tmp_path, tokenizer, corpus)[2]
    assert not first["reused"] and again["reused"] and again["folder"] == first["folder"]
    assert again["cache_files_written"] == 0 and "prepared rows reused from" in data.describe(again, 128)
    changed = {"seed": prepare(tmp_path, tokenizer, corpus, eval_fraction=0.1, seed=1)[2],
               "seq_len": prepare(tmp_path, tokenizer, corpus, seq_len=64)[2],
               "eval_fraction": prepare(tmp_path, tokenizer, corpus, eval_fraction=0.1)[2],
               "columns": prepare(tmp_path, tokenizer, corpus, column_map={"text": "text"})[2]}
    chat = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    chat.chat_template = "{{ messages }}"
    changed["chat template"] = prepare(tmp_path, chat, corpus)[2]
    write_corpus(corpus, 21)  # the data changes
    changed["data"] = prepare(tmp_path, tokenizer, corpus)[2]
    folders = {info["folder"] for info in changed.values()} | {first["folder"]}
    assert len(folders) == len(changed) + 1 and not any(info["reused"] for info in changed.values())


def test_a_tokenizer_datasets_cannot_hash_is_keyed_and_reused(tmp_path, tokenizer):
    from datasets.fingerprint import Hasher

    unhashable = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    unhashable.unhashable = (n for n in range(1))  # as tests/scripts/harness.py makes it
    with pytest.raises(Exception):  # noqa: B017 - the premise: datasets' own cache key cannot be computed
        Hasher.hash(unhashable)
    corpus = write_corpus(tmp_path / "corpus.jsonl", 10)
    assert not prepare(tmp_path, unhashable, corpus)[2]["reused"]
    assert prepare(tmp_path, unhashable, corpus)[2]["reused"]
    assert preparation.tokenizer_fingerprint(unhashable) == preparation.tokenizer_fingerprint(tokenizer)


def test_rows_are_the_same_for_any_num_proc(tmp_path, tokenizer):
    """The bundled 4,000 examples (held-out 5%: the train split is above PARALLEL_MIN_EXAMPLES) tokenized by 2
    worker processes and packed in one pass: the same rows, byte for byte, as one process makes; the rows'
    folder holds the rows and info.json, nothing else."""
    import hashlib

    one = prepare(tmp_path, tokenizer, BUNDLED_DATASET, eval_fraction=0.05, num_proc=1, cache="one")
    two = prepare(tmp_path, tokenizer, BUNDLED_DATASET, eval_fraction=0.05, num_proc=2, cache="two")
    assert len(one[0]) > 0 and one[2]["train_examples"] >= preparation.PARALLEL_MIN_EXAMPLES
    for name in ("train.arrow", "eval.arrow"):
        digests = {hashlib.sha256((Path(info["folder"]) / name).read_bytes()).hexdigest() for *_, info in (one, two)}
        assert len(digests) == 1, name
    files = sorted(p.name for p in Path(two[2]["folder"]).iterdir())
    assert files == [".in_use", "eval.arrow", "info.json", "train.arrow"]  # .in_use: zero_utils.data.cache.hold
    assert (one[2]["tokenizing_processes"], two[2]["tokenizing_processes"]) == (1, 2)
    assert "(2 tokenizing processes)" in data.describe(two[2], 128)
    assert "tokenizing processes" not in data.describe(one[2], 128)


def test_num_proc_0_takes_the_cpus_this_process_may_use_at_most_8(tmp_path, tokenizer, monkeypatch):
    """The default --num_proc 0: the CPUs of this process's affinity mask (not the machine's count), capped at 8."""
    for cpus, expected in ((range(64), 8), (range(3), 3), (range(1), 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cpus=cpus: set(cpus))
        assert preparation.default_num_proc() == expected
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5})
    monkeypatch.setattr(preparation, "PARALLEL_MIN_EXAMPLES", 1)  # workers on this small corpus
    info = prepare(tmp_path, tokenizer, write_corpus(tmp_path / "corpus.jsonl", 10), num_proc=0)[2]
    assert info["tokenizing_processes"] == 2


def test_a_tokenizer_that_cannot_be_pickled_tokenizes_in_the_forked_workers(tmp_path, tokenizer, monkeypatch):
    """The workers inherit the tokenizer (fork): one that neither pickle nor dill takes makes the same rows at
    --num_proc 2 as the picklable one at 1 (`datasets.map(num_proc=2)` would fail on it)."""
    import dill

    unpicklable = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    unpicklable.unhashable = (n for n in range(1))  # a generator
    with pytest.raises(TypeError):
        dill.dumps(unpicklable)
    monkeypatch.setattr(preparation, "PARALLEL_MIN_EXAMPLES", 1)  # workers on this small corpus
    corpus = write_corpus(tmp_path / "corpus.jsonl", 30)
    one = prepare(tmp_path, tokenizer, corpus, num_proc=1, cache="one")[2]
    two = prepare(tmp_path, unpicklable, corpus, num_proc=2, cache="two")[2]
    assert two["tokenizing_processes"] == 2 and one["train_rows"] > 1
    assert (Path(one["folder"]) / "train.arrow").read_bytes() == (Path(two["folder"]) / "train.arrow").read_bytes()


def test_without_fork_one_process_tokenizes_with_a_line(tmp_path, tokenizer, capsys, monkeypatch):
    monkeypatch.setattr(preparation.multiprocessing, "get_all_start_methods", lambda: ["spawn"])  # as on Windows
    monkeypatch.setattr(preparation, "PARALLEL_MIN_EXAMPLES", 1)
    info = prepare(tmp_path, tokenizer, write_corpus(tmp_path / "corpus.jsonl", 10), num_proc=2)[2]
    assert info["tokenizing_processes"] == 1
    assert "--num_proc 2: this platform cannot fork worker processes (they inherit the tokenizer); tokenizing in " \
           "this process alone (--num_proc 1)." in capsys.readouterr().out


def test_a_worker_that_dies_stops_the_preparation_with_one_sentence(tmp_path, tokenizer, monkeypatch):
    """A worker killed mid-split (as the kernel's OOM killer does) ends the preparation with an error naming
    --num_proc instead of leaving the job waiting for its chunk forever; no rows are kept."""
    monkeypatch.setattr(preparation, "PARALLEL_MIN_EXAMPLES", 1)
    monkeypatch.setattr(SFTRows, "make", lambda *args: os._exit(9))  # the forked workers see it
    with pytest.raises(UserError, match=r"a --num_proc 2 worker process died while tokenizing .* pass a lower "):
        prepare(tmp_path, tokenizer, write_corpus(tmp_path / "corpus.jsonl", 10), num_proc=2)
    assert list((tmp_path / "rows").iterdir()) == []  # nor the half-written folder


def test_a_node_prepares_its_own_rows_unless_it_sees_the_main_process_ones(tmp_path):
    """How a node's local main process decides (the launched half, each node its own cache folder, is
    tests/test_multinode.py): the main process's rows at the same path and complete there are opened; the same path
    on a local disk the main process never wrote (no shared file system), a half-written folder, or a cache folder
    of the node's own, make it prepare."""
    shared = tmp_path / "cache"
    main_folder = shared / "0123abcd"
    assert not preparation.sees_rows_of_main_process(shared, main_folder)  # this node's disk: nothing there
    main_folder.mkdir(parents=True)
    (main_folder / "train.arrow").write_bytes(b"")
    assert not preparation.sees_rows_of_main_process(shared, main_folder)  # incomplete: no info.json yet
    (main_folder / "info.json").write_text("{}")
    assert preparation.sees_rows_of_main_process(shared, main_folder)
    assert not preparation.sees_rows_of_main_process(tmp_path / "node1_cache", main_folder)
