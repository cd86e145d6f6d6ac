"""The recipe's training step written as a minimal PyTorch loop (no accelerate, one process): the reference that
benchmarks/run.py times against recipes/llama_zero3.py at world size 1 to measure what the recipe costs.

    python benchmarks/plain_loop.py --model DIR --output_dir D --max_steps 10 --per_device_batch_size 4 --seq_len 256

Same model (built from the config with the same seed), same packed rows and global-batch order
(zero_utils.data.training), same loss (mean over answer tokens), same AdamW (zero_utils.train.optim.build_adamw:
torch.optim.AdamW), same clipping. A step is timed from its start to the end of `zero_grad` (the recipe: from its start
to the optimizer's update, the moment `measurement.RunMeasurements` records; `zero_grad` after it sets gradients to
None, microseconds). Writes D/plain_loop.json: median tokens_per_s over the steps after --untimed_steps, and every step
time.
"""

import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import workload  # benchmarks/workload.py: flags, loss and timing shared with trainer_baseline.py
from transformers import AutoConfig, AutoModelForCausalLM

from zero_utils.assets import BUNDLED_DATASET
from zero_utils.data import sft_examples
from zero_utils.data import training as data
from zero_utils.data.preparation import prepare
from zero_utils.data.sft_rows import SFTRows
from zero_utils.model.loading import load_tokenizer
from zero_utils.train.optim import build_adamw

args = workload.parser(__doc__).parse_args()

torch.manual_seed(args.seed)
tokenizer = load_tokenizer(args.model)
# zero_utils.data.preparation asks its "accelerator" only which process runs first: one process, so this one.
one_process = SimpleNamespace(is_main_process=True, num_processes=1)
rows, _, _ = prepare(one_process, tokenizer, BUNDLED_DATASET,
                     SFTRows(args.seq_len, data.pad_token_id_within(tokenizer, len(tokenizer))), eval_fraction=0.0,
                     seed=args.seed)
rows = rows.with_format("torch", columns=["input_ids", "labels", "position_ids"])
# A config-only folder, as the recipe builds it (zero_utils.model.loading.load_causal_lm): random fp32 weights.
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=torch.float32)
optimizer = build_adamw(model, args.lr, weight_decay=0.1)
model.train()

step_times_s = []
for step in range(1, args.max_steps + 1):
    t0 = time.perf_counter()
    batch = rows[data.global_batch_indices(len(rows), args.per_device_batch_size, step, args.seed)]
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    labels = batch["labels"]
    loss = workload.token_loss_sum(logits, labels) / (labels != sft_examples.IGNORE_INDEX).sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    loss_value = loss.item()
    step_times_s.append(time.perf_counter() - t0)

tokens_per_step = args.per_device_batch_size * args.seq_len
result = {"tokens_per_s": workload.tokens_per_s(step_times_s, tokens_per_step, args.untimed_steps),
          "step_times_s": step_times_s, "final_loss": loss_value}
Path(args.output_dir).mkdir(parents=True, exist_ok=True)
Path(args.output_dir, "plain_loop.json").write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps(result))
