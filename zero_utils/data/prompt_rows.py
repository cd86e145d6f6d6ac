"""The prompt row maker of the preparation pipeline (zero_utils.data.preparation), for recipes that generate (GRPO):
each example's prompt rendered as the model is asked to answer it (`sft_examples.render_prompt`: the chat template
with its generation prompt, or PLAIN_FORMAT), tokenized, and cut to its last `max_prompt_tokens` tokens (from the
left, as trl does: the question's end and the generation prompt stay). Every other column of the example is kept
with its prompt (an answer a reward function checks against, a task id), as one JSON object per row.

Layouts, detected from the columns (`--columns prompt=question` renames a data set's):

    prompt                 prompt: a string (one user turn) or a list of chat messages
    messages               a conversation: the prompt is every turn before the last assistant turn (all of them when
                           the last turn is not the assistant's)
    alpaca                 instruction (+ input): one user turn

Columns of a split's file, one row per prompt in the data's order: prompt_ids (int32, unpadded), prompt_tokens
(int32) and columns (a JSON object: the example's other columns). `left_padded` makes a batch of them what
`generate` takes (left padding, attention mask); `extra_columns` gives the kept columns back, per prompt.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path

from zero_utils.data.preparation import int32_lists, open_prepared, write_record_batches
from zero_utils.data.sft_examples import render_prompt
from zero_utils.run.errors import UserError

PROMPTS_VERSION = 1  # what a file of prompts holds and how it is made; a change prepares every data set again
LAYOUTS = {"prompt": ("prompt",), "messages": ("messages",), "alpaca": ("instruction",)}
WRITE_PROMPT_TOKENS = 1 << 18  # prompt tokens per record batch (int32 arrays until written)


class PromptRows:
    """Prompts of at most `max_prompt_tokens` tokens (the last ones), with the examples' other columns, for
    `preparation.prepare`. Its info (`open`): the layout, splits, max_prompt_tokens, per split {"prompts",
    "truncated"}, the folder and each mixture source's share."""

    def __init__(self, max_prompt_tokens: int):
        self.max_prompt_tokens = max_prompt_tokens

    def key(self) -> dict:
        return {"kind": "prompts", "max_prompt_tokens": self.max_prompt_tokens, "prompts": PROMPTS_VERSION}

    def layout(self, column_names, first_example, column_map) -> str:
        return prompt_layout(column_names, column_map)

    def columns(self, layout, column_map) -> None:
        return None  # every column: the others are kept with the prompt

    def make(self, tokenizer, example: dict, layout: str, column_map) -> tuple:
        """(truncated, prompt ids as int32, the other columns as JSON)."""
        messages, used = prompt_messages(example, layout, column_map or {})
        ids = tokenizer(render_prompt(tokenizer, messages), add_special_tokens=False)["input_ids"]
        kept = {name: value for name, value in example.items() if name not in used}
        truncated = len(ids) > self.max_prompt_tokens
        return truncated, array("i", ids[-self.max_prompt_tokens:]), json.dumps(kept, default=str)

    def describe(self, layouts: list[str], mixture: bool) -> str:
        return "prompts (a mixture)" if mixture else f"prompts ({layouts[0]})"

    def empty(self, sources: int) -> dict:
        return {"prompts": 0, "truncated": 0, "tokens_per_source": [0] * sources}

    def check(self, info: dict, named: str) -> None:
        pass  # every example has a prompt: its layout's column

    def write(self, made, examples: int, name: str, folder: Path, layouts: list[str]) -> dict:
        return write_prompts(made, examples, name, folder, len(layouts))

    def open(self, folder: Path):
        return open_prompts(folder)


def prompt_layout(column_names: list[str], column_map: dict | None) -> str:
    """The layout (module docstring) of a prompt set from its columns; a `UserError` naming the columns found when it
    has none of them."""
    column_map = column_map or {}
    for layout, required in LAYOUTS.items():
        if all(column_map.get(c, c) in column_names for c in required):
            return layout
    raise UserError(f"the dataset has columns {sorted(column_names)} but prompts need a prompt, messages or "
                    "instruction column; name yours with --columns, e.g. --columns prompt=question.")


def prompt_messages(example: dict, layout: str, column_map: dict) -> tuple[list[dict], set[str]]:
    """(the prompt as chat messages, the columns it was read from) of one example of `layout`."""
    col = {c: column_map.get(c, c) for c in ("prompt", "messages", "instruction", "input")}
    if layout == "prompt":
        value = example[col["prompt"]]
        messages = [{"role": "user", "content": value}] if isinstance(value, str) else \
            [{"role": m["role"], "content": m["content"]} for m in value]
        return messages, {col["prompt"]}
    if layout == "messages":
        turns = [{"role": m["role"], "content": m["content"]} for m in example[col["messages"]]]
        last = max((i for i, m in enumerate(turns) if m["role"] == "assistant"), default=len(turns))
        return turns[:last] or turns, {col["messages"]}
    extra = example.get(col["input"]) or ""
    user = f"{example[col['instruction']]}\n\n{extra}" if extra else example[col["instruction"]]
    return [{"role": "user", "content": user}], {col["instruction"], col["input"]}


def write_prompts(made, total: int, name: str, folder: Path, sources: int) -> dict:
    """Write one split's prompts (`made`: ((truncated, ids, columns JSON), source) in order) into
    `<folder>/<name>.arrow`, WRITE_PROMPT_TOKENS tokens at a time. Returns its counts, with "tokens_per_source"."""
    import pyarrow
    from datasets import Features, Sequence, Value
    from tqdm.auto import tqdm

    features = Features({"prompt_ids": Sequence(Value("int32")), "prompt_tokens": Value("int32"),
                         "columns": Value("string")})
    counts = {"prompts": 0, "truncated": 0, "tokens_per_source": [0] * sources}

    def table_of(prompts):  # one record batch
        return pyarrow.table({"prompt_ids": int32_lists([ids for ids, _ in prompts]),
                              "prompt_tokens": pyarrow.array([len(ids) for ids, _ in prompts], type=pyarrow.int32()),
                              "columns": pyarrow.array([kept for _, kept in prompts], type=pyarrow.string())})

    def counted():
        with tqdm(total=total, unit="prompt", desc=f"tokenize {name} prompts") as progress:
            for (truncated, ids, kept), source in made:
                progress.update(1)
                counts["prompts"] += 1
                counts["truncated"] += truncated
                counts["tokens_per_source"][source] += len(ids)
                yield (ids, kept), len(ids)

    write_record_batches(folder / f"{name}.arrow", features, counted(), table_of, WRITE_PROMPT_TOKENS)
    return counts


def open_prompts(folder: Path):
    """The prepared prompts of `folder`, memory-mapped: (train, eval or None, info)."""
    train, evaluation, info = open_prepared(folder, "prompts")
    return train, evaluation, {
        **{k: info[k] for k in ("layout", "train_split", "eval_split", "tokenizing_processes")},
        "max_prompt_tokens": info["depends_on"]["rows"]["max_prompt_tokens"], "folder": str(folder),
        **{split: {k: info[split][k] for k in ("prompts", "truncated")} for split in ("train", "eval")},
        **({"sources": info["sources"]} if "sources" in info else {})}


def left_padded(prompt_ids: list, pad_token_id: int):
    """A batch of prompts (lists or tensors of ids) as `generate` takes them: (input_ids, attention_mask), int64
    [B, longest], each prompt at the right end, `pad_token_id` and mask 0 on its left."""
    import torch

    longest = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), longest), dtype=torch.long)
    for i, ids in enumerate(prompt_ids):
        if len(ids):
            input_ids[i, longest - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            mask[i, longest - len(ids):] = 1
    return input_ids, mask


def extra_columns(rows) -> list[dict]:
    """The kept columns of prompt `rows` (a slice of a prepared split), one dict per prompt."""
    return [json.loads(text) for text in rows["columns"]]
