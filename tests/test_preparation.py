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
    from zero_utils.data.prepared_mixture import prepare_mixture_rows
    from zero_utils.data.prepared_rows import prepare_rows
    from zero_utils.preference.prepared_pairs import prepare_pairs

    root = tmp_path / "rows"
    if case == "sft":
        return prepare_rows(ONE_PROCESS, tokenizer, BUNDLED_DATASET, seq_len=128, eval_fraction=0.05, seed=3,
                            column_map=None, pad_token_id=0, cache_root=root, num_proc=2)
    if case == "sft_mixture":
        sources = [(BUNDLED_DATASET, 0.5, "train"), (str(write_alpaca(tmp_path / "alpaca.json", 400)), 1.0, "train"),
                   (str(write_documents(tmp_path / "docs.jsonl", 60)), 2.0, "train")]
        mixture = mixture_file(tmp_path, "sft.yaml", sources, seed=5)
        return prepare_mixture_rows(ONE_PROCESS, tokenizer, mixture, seq_len=64, eval_fraction=0.0, pad_token_id=2,
                                    cache_root=root, num_proc=2)
    if case == "pairs":
        return prepare_pairs(ONE_PROCESS, tokenizer, BUNDLED_PREFERENCES, seq_len=48, eval_fraction=0.1, seed=7,
                             column_map={}, cache_root=root, num_proc=2)
    if case == "pairs_mixture":
        sources = [(BUNDLED_PREFERENCES, 0.7, "train"),
                   (str(write_conversational_pairs(tmp_path / "conv.jsonl", 500)), 1.5, "train")]
        mixture_file(tmp_path, "pairs.yaml", sources, seed=9)
        return prepare_pairs(ONE_PROCESS, tokenizer, str(tmp_path / "pairs.yaml"), seq_len=26, eval_fraction=0.0,
                             seed=0, column_map={}, cache_root=root, num_proc=2)
    raise ValueError(case)


@pytest.mark.parametrize("case", ["sft", "sft_mixture", "pairs", "pairs_mixture"])
def test_the_rows_are_the_rows_the_code_before_the_pipeline_made(case, tmp_path, tokenizer):
    train, evaluation, info = prepare_case(case, tmp_path, tokenizer)
    """Byte-identical column values for the bundled SFT data (forked tokenizers, held-out fraction), an SFT mixture
    of three layouts (chat, Alpaca, documents split into windows, one source drawn twice over), the bundled pairs
    (some truncated) and a pairs mixture of two layouts at a length that truncates and drops pairs."""
    train, evaluation, _ = prepare_case(case, tmp_path, tokenizer)
    assert (digest(train), digest(evaluation)) == PINNED[case]
