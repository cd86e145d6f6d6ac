"""Data pipeline, in process: formats, layouts, masking, packing, batching."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from zero_utils.assets import BUNDLED_MODEL
from zero_utils.data import packing, sft_examples
from zero_utils.data import sources as data_sources
from zero_utils.data import training as data
from zero_utils.data.preparation import prepare as prepare_once_per_job
from zero_utils.data.sft_rows import SFTRows
from zero_utils.run.errors import UserError

pytestmark = pytest.mark.unit

CHAT = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "2 plus 3 is 5."}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(BUNDLED_MODEL)


@pytest.fixture(scope="module")
def plain_tokenizer():
    """The bundled tokenizer without a chat template and without a pad token: the fallback path."""
    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    tok.chat_template = None
    tok.pad_token = None
    return tok


def trained_text(tokenizer, example) -> str:
    """The text of the tokens that carry loss (labels are shifted: label t is the target of position t)."""
    return tokenizer.decode([t for t in example["labels"] if t != sft_examples.IGNORE_INDEX])


def test_chat_template_masks_everything_but_the_answer(tokenizer):
    example = sft_examples.tokenize_example(tokenizer, CHAT)
    assert tokenizer.decode(example["input_ids"]).startswith("<s><|user|>")
    assert trained_text(tokenizer, example) == "2 plus 3 is 5.<|end|>\n"
    assert len(example["labels"]) == len(example["input_ids"]) and example["labels"][-1] == sft_examples.IGNORE_INDEX


def test_labels_are_the_next_token_of_the_same_example(tokenizer):
    example = sft_examples.tokenize_example(tokenizer, CHAT)
    ids, labels = example["input_ids"], example["labels"]
    answer = [t for t, label in enumerate(labels) if label != sft_examples.IGNORE_INDEX]
    assert len(answer) >= len(tokenizer("2 plus 3 is 5.", add_special_tokens=False)["input_ids"])  # the answer's
    assert labels[0] == sft_examples.IGNORE_INDEX  # the prompt is not trained on
    for t in answer:
        assert labels[t] == ids[t + 1]


def test_multi_turn_trains_every_assistant_turn(tokenizer):
    turns = CHAT + [{"role": "user", "content": "And 1 plus 1?"}, {"role": "assistant", "content": "1 plus 1 is 2."}]
    text = trained_text(tokenizer, sft_examples.tokenize_example(tokenizer, turns))
    assert "2 plus 3 is 5." in text and "1 plus 1 is 2." in text and "And 1 plus 1" not in text


def test_fallback_format_without_chat_template(plain_tokenizer):
    example = sft_examples.tokenize_example(plain_tokenizer, CHAT)
    decoded = plain_tokenizer.decode(example["input_ids"])
    assert "### User:\nWhat is 2 plus 3?" in decoded and "### Assistant:\n2 plus 3 is 5." in decoded
    assert trained_text(plain_tokenizer, example).startswith("2 plus 3 is 5.")
    assert sft_examples.render_prompt(plain_tokenizer, CHAT[:1]).endswith(sft_examples.PLAIN_ASSISTANT_PREFIX)


def test_prompt_rendering_matches_training_prefix(tokenizer):
    prompt = sft_examples.render_prompt(tokenizer, CHAT[:1])
    full = tokenizer.decode(sft_examples.tokenize_example(tokenizer, CHAT)["input_ids"])
    assert full.startswith(prompt)


def test_text_layout_trains_every_token(tokenizer):
    example = sft_examples.tokenize_example(tokenizer, "plain text to learn")
    assert sum(label != sft_examples.IGNORE_INDEX for label in example["labels"]) == len(example["input_ids"]) - 1


@pytest.mark.parametrize("columns,layout", [
    (["messages"], "messages"), (["prompt", "completion"], "prompt_completion"),
    (["instruction", "input", "output"], "alpaca"), (["instruction", "output"], "alpaca"), (["text", "id"], "text"),
])
def test_layout_detection(columns, layout):
    assert sft_examples.detect_layout(columns) == layout


def test_layout_detection_error_names_columns_and_fix():
    with pytest.raises(UserError, match=r"\['answer', 'question'\].*--columns"):
        sft_examples.detect_layout(["question", "answer"])
    mapping = sft_examples.parse_column_map("prompt=question,completion=answer")
    assert sft_examples.detect_layout(["question", "answer"], mapping) == "prompt_completion"
    assert sft_examples.to_messages({"question": "q", "answer": "a"}, "prompt_completion", mapping)[1]["content"] == "a"


@pytest.mark.parametrize("spec", ["prompt", "bogus=question", "prompt="])
def test_bad_column_map_is_a_user_error(spec):
    with pytest.raises(UserError):
        sft_examples.parse_column_map(spec)


def test_alpaca_input_joins_the_instruction():
    messages = sft_examples.to_messages({"instruction": "Sum", "input": "1 2", "output": "3"}, "alpaca")
    assert messages[0]["content"] == "Sum\n\n1 2" and messages[1]["content"] == "3"


def _write(path, records, fmt):
    import pandas as pd

    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif fmt == "json":
        path.write_text(json.dumps(records))
    elif fmt == "parquet":
        pd.DataFrame(records).to_parquet(path)
    elif fmt == "csv":
        pd.DataFrame(records).to_csv(path, index=False)
    elif fmt == "txt":
        path.write_text("".join(r["text"] + "\n" for r in records))


@pytest.mark.parametrize("fmt,records,layout", [
    ("jsonl", [{"messages": CHAT}] * 4, "messages"),
    ("json", [{"prompt": "p", "completion": "c"}] * 4, "prompt_completion"),
    ("parquet", [{"instruction": "i", "input": "", "output": "o"}] * 4, "alpaca"),
    ("csv", [{"prompt": "p", "completion": "c"}] * 4, "prompt_completion"),
    ("txt", [{"text": "some plain text"}] * 4, "text"),
])
def test_local_file_formats(tmp_path, fmt, records, layout):
    path = tmp_path / f"data.{fmt}"
    _write(path, records, fmt)
    raw = data_sources.load_raw_dataset(str(path))
    assert len(raw["train"]) == 4
    assert sft_examples.detect_layout(raw["train"].column_names) == layout


def test_missing_dataset_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        data_sources.load_raw_dataset(str(tmp_path / "nope.jsonl"))


def test_packing_fills_rows_and_restarts_positions(tokenizer):
    examples = [sft_examples.tokenize_example(tokenizer, CHAT) for _ in range(10)]
    length = len(examples[0]["input_ids"])
    rows, truncated = packing.pack_examples(examples, seq_len=3 * length + 2, pad_token_id=tokenizer.pad_token_id)
    assert truncated == 0 and len(rows) == 4  # 3 + 3 + 3 + 1 examples
    first = rows[0]
    assert all(len(first[k]) == 3 * length + 2 for k in ("input_ids", "labels", "position_ids"))
    assert first["position_ids"][:length] == list(range(length))
    assert first["position_ids"][length:2 * length] == list(range(length))
    assert first["labels"][length - 1] == sft_examples.IGNORE_INDEX  # no prediction across the example boundary
    assert first["labels"][-2:] == [sft_examples.IGNORE_INDEX] * 2  # padding carries no loss


def test_long_examples_are_truncated_and_counted(tokenizer):
    examples = [sft_examples.tokenize_example(tokenizer, "word " * 100)]
    rows, truncated = packing.pack_examples(examples, seq_len=16, pad_token_id=0)
    assert truncated == 1 and len(rows[0]["input_ids"]) == 16 and rows[0]["labels"][-1] == sft_examples.IGNORE_INDEX


def test_packed_example_logits_equal_alone(tokenizer):
    """No cross-contamination: an example's logits are the same packed behind another example as alone."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    first = sft_examples.tokenize_example(tokenizer, CHAT)
    second = sft_examples.tokenize_example(tokenizer, [{"role": "user", "content": "Spell cat."},
                                               {"role": "assistant", "content": "c-a-t"}])
    rows, _ = packing.pack_examples([first, second], seq_len=128, pad_token_id=tokenizer.pad_token_id)
    row = rows[0]
    n1, n2 = len(first["input_ids"]), len(second["input_ids"])
    with torch.no_grad():
        packed = model(input_ids=torch.tensor([row["input_ids"]]), position_ids=torch.tensor([row["position_ids"]]),
                       use_cache=False).logits[0, n1:n1 + n2]
        alone = model(input_ids=torch.tensor([second["input_ids"]]), use_cache=False).logits[0]
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


def test_global_batches_partition_each_epoch():
    seen = [i for step in range(1, 6) for i in data.global_batch_indices(53, 10, step, seed=1)]
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 50  # 5 batches/epoch, tail of 3 dropped
    assert data.global_batch_indices(53, 10, 6, seed=1) != data.global_batch_indices(53, 10, 1, seed=1)
    # a pure function of (rows, batch, step, seed), in any process: pinned (torch.randperm seeded 1 * 1_000_003 + 0)
    assert data.global_batch_indices(53, 10, 3, seed=1) == [28, 13, 33, 30, 19, 50, 43, 34, 20, 10]


def test_each_step_splits_the_global_batch_over_ranks_and_micro_steps_without_overlap():
    """TrainingData.step_batches: 2 ranks x accumulation 2 x 4 rows = the 16-row global batch, each row once, with
    the model's keyword arguments and the global batch's answer-token count (every label here is an answer)."""
    import datasets

    from zero_utils.data import attention

    table = {k: torch.arange(16).unsqueeze(1).repeat(1, 4).tolist() for k in ("input_ids", "labels", "position_ids")}
    rows = datasets.Dataset.from_dict({**table, "num_loss_tokens": [4] * 16}).with_format(
        "torch", columns=["input_ids", "labels", "position_ids"])  # as sft_rows.open_rows returns them

    got = []
    for rank in range(2):
        train_data = data.TrainingData(rows, None, {}, seq_len=4, per_device_batch_size=4,
                                       gradient_accumulation_steps=2, seed=0, attention_path=attention.BLOCK_MASK,
                                       rank=rank, world_size=2, device="cpu")
        batches = train_data.step_batches(1)
        assert len(batches.micro_batches) == 2 and batches.loss_tokens == 16 * 4
        for micro in batches.micro_batches:
            assert micro.inputs["input_ids"].shape == (4, 4) and micro.inputs["use_cache"] is False
            got += micro.inputs["input_ids"][:, 0].tolist()
    assert sorted(got) == list(range(16))


def test_eval_batches_are_equal_in_number_on_every_rank():
    table = {k: torch.arange(5).unsqueeze(1).repeat(1, 3) for k in ("input_ids", "labels", "position_ids")}

    class Rows:
        def __len__(self):
            return 5

        def __getitem__(self, idx):
            return {k: v[idx] for k, v in table.items()}

    per_rank = [list(data.eval_micro_batches(Rows(), r, 4, 1)) for r in range(4)]
    assert {len(b) for b in per_rank} == {2}
    real = [int(b["labels"][0, 0]) for batches in per_rank for b in batches
            if (b["labels"] != sft_examples.IGNORE_INDEX).any()]
    assert sorted(real) == [0, 1, 2, 3, 4]  # each row exactly once; the three filler batches carry no loss


def test_not_enough_rows_names_the_global_batch():
    with pytest.raises(UserError, match="global batch"):
        data.check_enough_rows(3, 8)


ONE_PROCESS = SimpleNamespace(is_main_process=True, num_processes=1)  # the preparation's only use of it


def prepare(tmp_path, tokenizer, path, vocab_size, seq_len=128, **kwargs):
    """The preparation of SFT rows as TrainingData.prepare calls it, rows kept under tmp_path."""
    kwargs = {"eval_fraction": 0.0, "seed": 0, "column_map": None, **kwargs}
    return prepare_once_per_job(ONE_PROCESS, tokenizer, str(path),
                                SFTRows(seq_len, data.pad_token_id_within(tokenizer, vocab_size)),
                                cache_root=tmp_path / "rows", **kwargs)


def test_rows_are_padded_inside_the_embedding_when_the_tokenizer_pad_is_outside(tmp_path):
    """A tokenizer whose pad token is not in the model's embedding (as transformers' Qwen2 tokenizer adds
    `<|endoftext|>` when the saved one has none): rows are padded with EOS, which the embedding has."""
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    vocab_size = len(tokenizer)
    tokenizer.add_special_tokens({"pad_token": "<|pad_outside|>"})
    assert tokenizer.pad_token_id == vocab_size
    assert data.pad_token_id_within(tokenizer, vocab_size) == tokenizer.eos_token_id
    path = tmp_path / "chat.jsonl"
    _write(path, [{"messages": CHAT}] * 6, "jsonl")
    train, _, _ = prepare(tmp_path, tokenizer, path, vocab_size)
    ids = torch.cat([row["input_ids"] for row in train])
    assert int(ids.max()) < vocab_size and (ids == tokenizer.eos_token_id).sum() > 6  # EOS ends examples and pads


def test_text_tokens_outside_the_embedding_stop_before_training(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    vocab_size = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    path = tmp_path / "tool.jsonl"
    _write(path, [{"prompt": "call <|tool|> now", "completion": "done"}] * 6, "jsonl")
    with pytest.raises(UserError, match=rf"token id {vocab_size} \('<\|tool\|>'\), outside the model's embedding "
                                        rf"of {vocab_size} tokens.*resize_token_embeddings"):
        _, _, info = prepare(tmp_path, tokenizer, path, vocab_size)
        data.check_token_ids(tokenizer, info["max_token_id"], vocab_size)  # as TrainingData.prepare does
