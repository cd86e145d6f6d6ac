"""One training example as the model sees it: the layout detected from the columns (messages, prompt/completion,
Alpaca, text; `column_map` renames a user's columns), the example turned into chat messages, rendered by the
tokenizer's chat template (or `PLAIN_FORMAT` without one), and tokenized with the loss mask: labels already
shifted, `IGNORE_INDEX` where there is no loss (prompt tokens, the last token). Packing the examples into rows is
data.packing, batching them data.training.
"""

from __future__ import annotations

from zero_utils.run.errors import UserError

IGNORE_INDEX = -100

LAYOUTS = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
# Used when the tokenizer has no chat template. Documented in the README; the model sees exactly this.
PLAIN_FORMAT = {"user": "### User:\n{content}\n\n", "system": "### System:\n{content}\n\n",
                "assistant": "### Assistant:\n{content}"}
PLAIN_ASSISTANT_PREFIX = "### Assistant:\n"



def detect_layout(column_names: list[str], column_map: dict[str, str] | None = None) -> str:
    """Name the layout ('messages', 'prompt_completion', 'alpaca' or 'text') of a dataset from its columns.

    `column_map` maps our column names to the dataset's (e.g. {"prompt": "question"}). Raises `UserError` naming
    the columns found and those expected when nothing matches.
    """
    column_map = column_map or {}
    for layout, required in LAYOUTS.items():
        if all(column_map.get(c, c) in column_names for c in required):
            return layout
    expected = " or ".join("+".join(cols) for cols in LAYOUTS.values())
    raise UserError(
        f"the dataset has columns {sorted(column_names)} but needs {expected}; "
        "name yours with --columns, e.g. --columns prompt=question,completion=answer."
    )


def parse_column_map(spec: str, known: tuple[str, ...] | None = None,
                     example: str = "prompt=question,completion=answer") -> dict[str, str]:
    """Parse `--columns` ("prompt=question,completion=answer") into {"prompt": "question", ...}. `known`: the names
    a recipe reads (default: the SFT layouts' columns); `example` is shown in the error of a malformed item."""
    if not spec:
        return {}
    known = set(known or {c for cols in LAYOUTS.values() for c in cols} | {"input"})
    mapping = {}
    for item in spec.split(","):
        ours, sep, theirs = item.partition("=")
        ours, theirs = ours.strip(), theirs.strip()
        if not sep or not ours or not theirs:
            raise UserError(f"--columns item {item!r} is not NAME=COLUMN; write e.g. --columns {example}.")
        if ours not in known:
            raise UserError(f"--columns names {ours!r}, which is not one of {sorted(known)}.")
        mapping[ours] = theirs
    return mapping


def to_messages(example: dict, layout: str, column_map: dict[str, str] | None = None) -> list[dict] | str:
    """Turn one raw example into chat messages (or a plain string for the 'text' layout)."""
    names = ("messages", "prompt", "completion", "instruction", "input", "output", "text")
    col = {c: (column_map or {}).get(c, c) for c in names}
    if layout == "messages":
        return [{"role": m["role"], "content": m["content"]} for m in example[col["messages"]]]
    if layout == "prompt_completion":
        return [{"role": "user", "content": example[col["prompt"]]},
                {"role": "assistant", "content": example[col["completion"]]}]
    if layout == "alpaca":
        user = example[col["instruction"]]
        extra = example.get(col["input"]) or ""
        if extra:
            user = f"{user}\n\n{extra}"
        return [{"role": "user", "content": user}, {"role": "assistant", "content": example[col["output"]]}]
    return example[col["text"]]


def render_prompt(tokenizer, messages: list[dict]) -> str:
    """The text a model is given to answer `messages` (generation prompt included), as training formatted it."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token or ""
    turns = "".join(PLAIN_FORMAT[m["role"]].format(content=m["content"]) for m in messages)
    return bos + turns + PLAIN_ASSISTANT_PREFIX


def _segments(tokenizer, messages: list[dict], train_from: int = 0) -> list[tuple[str, bool]]:
    """Split a rendered conversation into (text, is_trained) pieces: assistant replies from turn `train_from` on are
    trained, the rest not."""
    if not tokenizer.chat_template:
        pieces, eos = [(tokenizer.bos_token or "", False)], tokenizer.eos_token or ""
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                pieces += [(PLAIN_ASSISTANT_PREFIX, False), (m["content"] + eos + "\n\n", i >= train_from)]
            else:
                pieces.append((PLAIN_FORMAT[m["role"]].format(content=m["content"]), False))
        return pieces
    pieces, rendered = [], ""
    for i, m in enumerate(messages):
        is_assistant = m["role"] == "assistant"
        before = (tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=is_assistant)
                  if i else "")
        if is_assistant and before.startswith(rendered):
            pieces.append((before[len(rendered):], False))
            rendered = before
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not full.startswith(rendered):
            raise UserError("the tokenizer's chat template does not render conversations prefix by prefix, so prompt "
                            "tokens cannot be masked; use a tokenizer with a standard template or the 'text' layout.")
        pieces.append((full[len(rendered):], is_assistant and i >= train_from))
        rendered = full
    return pieces


def tokenize_example(tokenizer, messages_or_text: list[dict] | str, train_from: int = 0) -> dict:
    """Tokenize one example. Returns {"input_ids": list[int], "labels": list[int]} with labels already shifted
    (labels[t] = input_ids[t+1] when that token is trained, else -100; the last label is always -100). Messages:
    the assistant turns from index `train_from` on are trained (a preference pair's answer after its prompt)."""
    if isinstance(messages_or_text, str):
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids = bos + tokenizer(messages_or_text, add_special_tokens=False)["input_ids"] + eos
        trained = [False] * len(bos) + [True] * (len(ids) - len(bos))
    else:
        ids, trained = [], []
        for text, is_trained in _segments(tokenizer, messages_or_text, train_from):
            if text:
                piece = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += piece
                trained += [is_trained] * len(piece)
    labels = [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
    return {"input_ids": ids, "labels": labels}
