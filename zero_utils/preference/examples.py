"""One preference pair: its layout (from the columns and values), its prompt and two answers as chat messages, and
its two token sequences with the loss on the answers only (as zero_utils.data.sft_examples does for one SFT example).

Layouts, detected from the columns and their values (`--columns prompt=question,chosen=good,rejected=bad` renames a
data set's; other columns, such as scores, are ignored):

    pairs                        prompt, chosen, rejected: strings
    conversational               chosen, rejected: lists of chat messages; prompt: a string or messages, and the
                                 lists may start with it (UltraFeedback-binarized stores [user, assistant])
    conversational, shared turns chosen, rejected: lists of messages, no prompt column: the prompt is their shared
                                 leading turns (as Anthropic HH stores them)

Truncation, one rule (`TRUNCATION`): each of a pair's two sequences (prompt + answer) is cut to its first `seq_len`
tokens, so a long answer loses its tail and a long prompt its answer; a pair in which either answer keeps no token
(or has no turn of its own) is dropped.
"""

from __future__ import annotations

from zero_utils.data.sft_examples import IGNORE_INDEX, parse_column_map, tokenize_example
from zero_utils.run.errors import UserError

PAIR_COLUMNS = ("prompt", "chosen", "rejected")


def parse_pair_columns(spec: str) -> dict[str, str]:
    """`--columns` ("prompt=question,chosen=good") -> {"prompt": "question", "chosen": "good"}."""
    return parse_column_map(spec, PAIR_COLUMNS, "prompt=question,chosen=good,rejected=bad")


LAYOUTS = ("pairs", "conversational", "conversational, shared turns")
TRUNCATION = "each sequence's first seq_len tokens; a pair with an answer left empty dropped"  # in the rows' key


def pair_layout(column_names: list[str], first_row: dict, column_map: dict[str, str]) -> str:
    """The layout (module docstring) of a preference set from its columns and first row; a `UserError` naming the
    columns found when it has none of them."""
    col = {c: column_map.get(c, c) for c in PAIR_COLUMNS}
    has = {c: col[c] in column_names for c in PAIR_COLUMNS}
    if has["chosen"] and has["rejected"]:
        conversational = isinstance(first_row[col["chosen"]], list)
        if has["prompt"]:
            return "conversational" if conversational else "pairs"
        if conversational:
            return "conversational, shared turns"
    missing = [c for c in PAIR_COLUMNS if not has[c]]
    raise UserError(f"the dataset has columns {sorted(column_names)} but a preference set needs prompt, chosen and "
                    f"rejected (missing: {', '.join(missing)}; chosen and rejected as chat messages may leave the "
                    "prompt out); name yours with --columns, e.g. --columns prompt=question,chosen=good,rejected=bad.")


def _messages(value, role: str) -> list[dict]:
    return [{"role": role, "content": value}] if isinstance(value, str) else \
        [{"role": m["role"], "content": m["content"]} for m in value]


def split_pair(prompt, chosen, rejected) -> tuple[list[dict], list[dict], list[dict]] | None:
    """(prompt messages, chosen answer messages, rejected answer messages) of one pair in any layout. A string
    prompt is one user turn and a string answer one assistant turn; answers that start with the prompt's messages
    have them removed; without a prompt (None) the prompt is the turns both answers start with. None when an answer
    has no turn of its own."""
    chosen, rejected = _messages(chosen, "assistant"), _messages(rejected, "assistant")
    if prompt is None:
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt_messages = chosen[:shared]
    else:
        prompt_messages = _messages(prompt, "user")
    answers = [answer[len(prompt_messages):] if answer[:len(prompt_messages)] == prompt_messages else answer
               for answer in (chosen, rejected)]
    if not prompt_messages or not all(answers):
        return None
    return prompt_messages, *answers


def tokenize_pair(tokenizer, prompt, chosen, rejected, seq_len: int) -> dict | None:
    """One pair (strings or chat messages, `split_pair`) as two token sequences with shifted labels (IGNORE_INDEX
    off the answer), each cut to `seq_len` tokens; None when an answer keeps no token. Keys: chosen_ids,
    chosen_labels, rejected_ids, rejected_labels (lists of ints) and truncated (bool)."""
    split = split_pair(prompt, chosen, rejected)
    if split is None:
        return None
    prompt_messages, *answers = split
    pair, truncated = {}, False
    for name, answer in zip(("chosen", "rejected"), answers, strict=True):
        example = tokenize_example(tokenizer, prompt_messages + answer, train_from=len(prompt_messages))
        ids, labels = example["input_ids"], example["labels"]
        if len(ids) > seq_len:
            truncated = True
            ids, labels = ids[:seq_len], labels[:seq_len - 1] + [IGNORE_INDEX]  # the last target lies beyond
        if all(label == IGNORE_INDEX for label in labels):
            return None
        pair[f"{name}_ids"], pair[f"{name}_labels"] = ids, labels
    return {**pair, "truncated": truncated}


def pair_columns(layout: str, column_map: dict[str, str]) -> list[str]:
    """The data set's columns a pair of `layout` is read from, in `tokenize_pair`'s order (no prompt column in the
    shared-turns layout)."""
    names = PAIR_COLUMNS if layout != "conversational, shared turns" else PAIR_COLUMNS[1:]
    return [column_map.get(c, c) for c in names]
