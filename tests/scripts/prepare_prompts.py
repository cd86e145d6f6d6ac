"""Prepare prompts as a generating recipe will, on every rank of a launch (tests/test_preparation.py):

    accelerate launch --num_processes 2 tests/scripts/prepare_prompts.py --output_dir D --dataset X --cache_root C

Each rank writes D/rank<r>.json: what `preparation.prepare` said (reused, prepared_on, cache_files_written, the
folder, the prompts) and how many examples this rank made into prompts (`PromptRows.make` calls)."""

import argparse
import json
from pathlib import Path

from accelerate import PartialState
from transformers import AutoTokenizer

from zero_utils.assets import BUNDLED_MODEL
from zero_utils.data.preparation import prepare
from zero_utils.data.prompt_rows import PromptRows

parser = argparse.ArgumentParser()
parser.add_argument("--output_dir", required=True)
parser.add_argument("--dataset", required=True)
parser.add_argument("--cache_root", required=True)
parser.add_argument("--max_prompt_tokens", type=int, default=12)
args = parser.parse_args()

state = PartialState(backend="gloo")
made = [0]
make = PromptRows.make


def counted_make(*a):
    made[0] += 1
    return make(*a)


PromptRows.make = counted_make
tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
train, evaluation, info = prepare(state, tokenizer, args.dataset, PromptRows(args.max_prompt_tokens),
                                  eval_fraction=0.0, seed=0, cache_root=Path(args.cache_root), num_proc=1)
Path(args.output_dir).mkdir(parents=True, exist_ok=True)
(Path(args.output_dir) / f"rank{state.process_index}.json").write_text(json.dumps(
    {**{k: info[k] for k in ("reused", "prepared_on", "cache_files_written", "folder")}, "prompts": len(train),
     "made": made[0]}))
state.wait_for_everyone()
state.destroy_process_group()
