"""The one preparation pipeline (zero_utils.data.preparation: a source stream times a row maker), in process: the
rows each kind of data makes are the rows the code before the pipeline made (digests pinned from it), SFT rows of one
example each (--no-packing), and prompts for generation."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest
from test_data_mixture import mixture_file, write_alpaca

from zero_utils.assets import BUNDLED_DATASET, BUNDLED_MODEL, BUNDLED_PREFERENCES

pytestmark = pytest.mark.unit

ONE_PROCESS = SimpleNamespace(is_main_process=True, num_processes=1)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BUNDLED_MODEL)


def digest(rows) -> str:
    """A hash of a prepared split's column values (names, types, offsets and values), not of its file's bytes."""
    import numpy as np
    import pyarrow

    table, h = rows.data.table if hasattr(rows.data, "table") else rows.data, hashlib.sha256()
    for name in sorted(table.column_names):
        column = table.column(name).combine_chunks()
        h.update(f"{name}:{column.type}:{len(column)}".encode())
        if pyarrow.types.is_list(column.type):
            h.update(np.asarray(column.offsets).astype(np.int64).tobytes())
            column = column.flatten()
        h.update(np.asarray(column).astype(np.int64).tobytes())
    return h.hexdigest()[:16]


def write_documents(path, count: int):
    """`count` plain-text documents of 5 to 5 + 3 x count words (the longer ones split into windows at seq_len 64)."""
    path.write_text("".join(json.dumps({"text": " ".join(f"word{j % 37}" for j in range(5 + 3 * i))}) + "\n"
                            for i in range(count)))
    return path


def write_conversational_pairs(path, count: int):
    """The bundled pairs' first `count` as chat messages without a prompt column (the shared-turns layout)."""
    lines = open(BUNDLED_PREFERENCES).read().splitlines()[:count]
    out = []
    for line in lines:
        pair = json.loads(line)
        turn = [{"role": "user", "content": pair["prompt"]}]
        out.append(json.dumps({"chosen": turn + [{"role": "assistant", "content": pair["chosen"]}],
                               "rejected": turn + [{"role": "assistant", "content": pair["rejected"]}]}))
    path.write_text("\n".join(out) + "\n")
    return path


# Digests of the rows as the code before the one pipeline (6aee865..87ae240: prepared_rows, prepared_mixture,
# prepared_pairs) prepared them: (train, eval) per case.
PINNED = {"sft": ("9af5e41134c7869a", "346b3df988652f87"),
          "sft_mixture": ("f84a6174b067c658", "31c237ae6df53d62"),
          "pairs": ("ff1f56bde9c4a89b", "8f2f1f84fb478f67"),
          "pairs_mixture": ("98bb280e6b5453ea", "81da5ffa3da36adf")}


def prepare_case(case: str, tmp_path, tokenizer):
    from zero_utils.data.preparation import prepare
    from zero_utils.data.sft_rows import SFTRows
    from zero_utils.preference.pair_rows import PairRows

    root = tmp_path / "rows"
    if case == "sft":
        return prepare(ONE_PROCESS, tokenizer, BUNDLED_DATASET, SFTRows(128, 0), eval_fraction=0.05, seed=3,
                       cache_root=root, num_proc=2)
    if case == "sft_mixture":
        sources = [(BUNDLED_DATASET, 0.5, "train"), (str(write_alpaca(tmp_path / "alpaca.json", 400)), 1.0, "train"),
                   (str(write_documents(tmp_path / "docs.jsonl", 60)), 2.0, "train")]
        mixture = mixture_file(tmp_path, "sft.yaml", sources, seed=5)
        return prepare(ONE_PROCESS, tokenizer, mixture, SFTRows(64, 2), eval_fraction=0.0, seed=0, cache_root=root,
                       num_proc=2)
    if case == "pairs":
        return prepare(ONE_PROCESS, tokenizer, BUNDLED_PREFERENCES, PairRows(48), eval_fraction=0.1, seed=7,
                       column_map={}, cache_root=root, num_proc=2)
    if case == "pairs_mixture":
        sources = [(BUNDLED_PREFERENCES, 0.7, "train"),
                   (str(write_conversational_pairs(tmp_path / "conv.jsonl", 500)), 1.5, "train")]
        mixture_file(tmp_path, "pairs.yaml", sources, seed=9)
        return prepare(ONE_PROCESS, tokenizer, str(tmp_path / "pairs.yaml"), PairRows(26), eval_fraction=0.0, seed=0,
                       cache_root=root, num_proc=2)
    raise ValueError(case)


@pytest.mark.parametrize("case", ["sft", "sft_mixture", "pairs", "pairs_mixture"])
def test_the_rows_are_the_rows_the_code_before_the_pipeline_made(case, tmp_path, tokenizer):
    train, evaluation, info = prepare_case(case, tmp_path, tokenizer)
    """Byte-identical column values for the bundled SFT data (forked tokenizers, held-out fraction), an SFT mixture
    of three layouts (chat, Alpaca, documents split into windows, one source drawn twice over), the bundled pairs
    (some truncated) and a pairs mixture of two layouts at a length that truncates and drops pairs."""
    train, evaluation, _ = prepare_case(case, tmp_path, tokenizer)
    assert (digest(train), digest(evaluation)) == PINNED[case]


# ---------------------------------------------------------------------------------------------- --no-packing
def test_without_packing_each_example_is_a_row_of_its_own(tmp_path, tokenizer):
    """SFTRows(packing=False), as --no-packing asks: row i is example i tokenized alone (`tokenize_example`, the
    reference), cut to seq_len with its last target dropped when longer, padded with the pad id, its positions
    0..n-1 then the padding's own 0..; an example without a loss token (a chat without an answer) makes no row; the
    packed rows of the same data are fewer and live under another key."""
    from zero_utils.data.preparation import prepare
    from zero_utils.data.sft_examples import IGNORE_INDEX, to_messages, tokenize_example
    from zero_utils.data.sft_rows import SFTRows

    seq_len, pad = 48, 3
    lines = open(BUNDLED_DATASET).read().splitlines()[:60]
    lines.append(json.dumps({"messages": [{"role": "user", "content": "Say it."},
                                          {"role": "assistant", "content": " ".join(["paris"] * 40)}]}))
    lines.append(json.dumps({"messages": [{"role": "user", "content": "Nothing to learn here."}]}))
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    unpacked, _, info = prepare(ONE_PROCESS, tokenizer, str(tmp_path / "chat.jsonl"),
                                SFTRows(seq_len, pad, packing=False), eval_fraction=0.0, seed=0,
                                cache_root=tmp_path / "rows")
    expected, long = [], 0
    for line in lines:
        example = tokenize_example(tokenizer, to_messages(json.loads(line), "messages"))
        ids, labels = example["input_ids"][:seq_len], example["labels"][:seq_len]
        if len(example["input_ids"]) > seq_len:
            labels, long = labels[:-1] + [IGNORE_INDEX], long + 1
        if any(label != IGNORE_INDEX for label in labels):
            expected.append((ids, labels))
    assert len(unpacked) == len(expected) < len(lines) and info["truncated_examples"] == long >= 1
    assert info["packing"] is False
    for row, (ids, labels) in zip(unpacked, expected, strict=True):
        n, tail = len(ids), seq_len - len(ids)
        assert row["input_ids"].tolist() == ids + [pad] * tail
        assert row["labels"].tolist() == labels + [IGNORE_INDEX] * tail
        assert row["position_ids"].tolist() == list(range(n)) + list(range(tail))
    packed, _, packed_info = prepare(ONE_PROCESS, tokenizer, str(tmp_path / "chat.jsonl"), SFTRows(seq_len, pad),
                                     eval_fraction=0.0, seed=0, cache_root=tmp_path / "rows")
    assert len(packed) < len(unpacked) and packed_info["folder"] != info["folder"] and packed_info["packing"]


# ---------------------------------------------------------------------------------------------- prompts
def rendered_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The reference: the tokenizer's own chat template with its generation prompt, tokenized whole."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_bundled_pairs_prompts_keep_their_last_tokens_and_their_other_columns(tmp_path, tokenizer):
    """PromptRows on the bundled pairs (the prompt layout): each prompt is its chat-template rendering's last 12
    tokens (cut from the left, counted when cut), its chosen and rejected answers kept beside it; a second call
    reuses the folder; `left_padded` puts each prompt at the right end of the batch with a mask of ones over it."""
    from zero_utils.data.preparation import prepare
    from zero_utils.data.prompt_rows import PromptRows, extra_columns, left_padded

    def prepare_prompts():
        return prepare(ONE_PROCESS, tokenizer, BUNDLED_PREFERENCES, PromptRows(12), eval_fraction=0.0, seed=0,
                       cache_root=tmp_path / "rows")

    train, evaluation, info = prepare_prompts()
    pairs = [json.loads(line) for line in open(BUNDLED_PREFERENCES)]
    full = [rendered_prompt(tokenizer, [{"role": "user", "content": p["prompt"]}]) for p in pairs]
    assert evaluation is None and len(train) == len(pairs) and info["layout"] == "prompts (prompt)"
    assert [row["prompt_ids"] for row in train] == [ids[-12:] for ids in full]
    assert info["train"]["truncated"] == sum(len(ids) > 12 for ids in full) > 0
    assert extra_columns(train[:len(pairs)]) == [{"chosen": p["chosen"], "rejected": p["rejected"]} for p in pairs]
    assert not info["reused"] and prepare_prompts()[2]["reused"]
    batch = train[:3]["prompt_ids"]
    ids, mask = left_padded(batch, pad_token_id=0)
    for i, prompt in enumerate(batch):
        assert ids[i, ids.shape[1] - len(prompt):].tolist() == prompt and mask[i].sum() == len(prompt)
        assert (ids[i, :ids.shape[1] - len(prompt)] == 0).all()


def write_prompt_mixture(tmp_path):
    """Three prompt sources: the bundled pairs (prompt layout, 0.1 of 2,000), a question/answer file whose
    question is renamed to prompt (1.0 of 50) and the bundled chat messages (messages layout, 0.01 of 4,000)."""
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)})
                                                 + "\n" for i in range(50)))
    (tmp_path / "prompts.yaml").write_text(f"""dataset_mixture:
  datasets:
    - id: {BUNDLED_PREFERENCES}
      weight: 0.1
    - id: {tmp_path / "sums.jsonl"}
      columns:
        prompt: question
      weight: 1.0
    - id: {BUNDLED_DATASET}
      weight: 0.01
  seed: 4
""")
    return str(tmp_path / "prompts.yaml")


@pytest.fixture(scope="module")
def prompt_mixture(tmp_path_factory, tokenizer):
    """The mixture of `write_prompt_mixture` prepared in process, twice: (root, its first and second info, train)."""
    from zero_utils.data.preparation import prepare
    from zero_utils.data.prompt_rows import PromptRows

    root = tmp_path_factory.mktemp("prompt-mixture")
    mixture = write_prompt_mixture(root)
    first = prepare(ONE_PROCESS, tokenizer, mixture, PromptRows(12), eval_fraction=0.0, seed=0,
                    cache_root=root / "rows")
    second = prepare(ONE_PROCESS, tokenizer, mixture, PromptRows(12), eval_fraction=0.0, seed=0,
                     cache_root=root / "rows")
    return root, mixture, first[2], second[2], first[0]


def test_a_mixture_of_prompt_sources_prepares_once_and_keeps_each_sources_columns(prompt_mixture, tokenizer):
    """Each source's draw (200, 50, 40 prompts), each prompt with its own source's other columns (the pairs' answers,
    the sums' answer, nothing left of a chat), the renamed question rendered as the prompt, and a second call that
    reuses the folder."""
    from zero_utils.data.prompt_rows import extra_columns

    _, _, first, second, train = prompt_mixture
    assert [s["examples_used"] for s in first["sources"]] == [200, 50, 40] and len(train) == 290
    assert [s["layout"] for s in first["sources"]] == ["prompt", "prompt", "messages"]
    assert not first["reused"] and second["reused"] and second["folder"] == first["folder"]
    kept = extra_columns(train[:len(train)])
    assert sorted({tuple(sorted(c)) for c in kept}) == [(), ("answer",), ("chosen", "rejected")]
    assert sum("answer" in c for c in kept) == 50 and sum(not c for c in kept) == 40
    i = next(i for i, c in enumerate(kept) if c.get("answer") == "14")
    assert train[i]["prompt_ids"] == rendered_prompt(tokenizer, [{"role": "user", "content": "What is 7 + 7?"}])[-12:]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_relaunch_on_two_processes_prepares_no_prompt(prompt_mixture):
    """The mixture prepared in process above, then a launch of 2 processes on the same cache
    (tests/scripts/prepare_prompts.py): every rank opens the same folder and its 290 prompts, reused, and makes no
    prompt and writes no file."""
    from conftest import launch

    root, mixture, first, _, _ = prompt_mixture
    run = launch(root / "relaunch", "--dataset", mixture, "--cache_root", str(root / "rows"), config="ddp",
                 recipe="tests/scripts/prepare_prompts.py")
    assert run.returncode == 0, run.output[-3000:]
    for rank in (0, 1):
        said = json.loads((root / "relaunch" / f"rank{rank}.json").read_text())
        assert said == {"reused": True, "prepared_on": "main", "cache_files_written": 0, "folder": first["folder"],
                        "prompts": 290, "made": 0}, rank
