"""The transformers Trainer on the recipe's model, data, global batch and seq_len, under the same accelerate config:
what users would pick instead of recipes/llama_zero3.py. benchmarks/run.py launches it next to the recipe:

    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 --mixed_precision no \
        benchmarks/trainer_baseline.py --model DIR --output_dir D --max_steps 10 --per_device_batch_size 4 --seq_len 256

On a machine without CUDA the Trainer's own Accelerator falls back to one process per rank, unsharded
(docs/CPU.md). So the accelerate state is built first by zero_utils.run.accelerator.build_accelerator (gloo,
the engine the launch named) and the Trainer is told to reuse it (`accelerator_config={"use_configured_state":
True}`); after training this script records how much of the model each rank holds, so a run that did not shard
is caught.
Writes D/trainer.json: median tokens_per_s (global, steps after --untimed_steps), peak_mem_bytes (max over ranks,
during training: process RSS high-water on CPU, allocator peak on GPU, reset when training begins),
local_param_fraction per rank, engine.
"""

import json
import time
from pathlib import Path

import torch
import workload  # benchmarks/workload.py: flags, loss and timing shared with plain_loop.py
from accelerate import PartialState
from transformers import Trainer, TrainerCallback, TrainingArguments

from zero_utils.assets import BUNDLED_DATASET
from zero_utils.data import sft_examples
from zero_utils.data import training as data
from zero_utils.data.preparation import prepare
from zero_utils.data.sft_rows import SFTRows
from zero_utils.model.loading import load_causal_lm, load_tokenizer
from zero_utils.run import accelerator as accelerator_setup
from zero_utils.run import distributed
from zero_utils.run.engine import Engine
from zero_utils.train import evidence, measurement

args = workload.parser(__doc__).parse_args()

# FSDP2 (and DDP): the state first (zero_utils.run.accelerator: gloo + the launched engine), then the Trainer reuses
# it. DeepSpeed needs only a gloo process group, which the Trainer builds itself from `ddp_backend`; it refuses a
# configured DeepSpeed state ("cannot pass in a deepspeed_plugin when creating a second Accelerator"), so it builds
# its own from the launch's environment, as it would for a user.
use_configured_state = accelerator_setup.requested_engine_family() != "deepspeed"
if use_configured_state:
    accelerator, _ = accelerator_setup.build_accelerator(per_device_batch_size=args.per_device_batch_size,
                                                         gradient_accumulation_steps=1, max_grad_norm=1.0)
else:
    accelerator = PartialState(backend="gloo" if not torch.cuda.is_available() else None)
world = accelerator.num_processes
torch.manual_seed(args.seed)
tokenizer = load_tokenizer(args.model)
train_rows, _, _ = prepare(accelerator, tokenizer, BUNDLED_DATASET,
                           SFTRows(args.seq_len, data.pad_token_id_within(tokenizer, len(tokenizer))),
                           eval_fraction=0.0, seed=args.seed)
train_rows = train_rows.with_format("torch", columns=["input_ids", "labels", "position_ids"])
model = load_causal_lm(args.model, accelerator=accelerator)
model.config.use_cache = False  # packed rows: with a cache object transformers skips the block-diagonal mask


def token_mean_loss(outputs, labels, num_items_in_batch=None):
    loss_sum = workload.token_loss_sum(outputs.logits, labels)
    tokens = num_items_in_batch if num_items_in_batch is not None else (labels != sft_examples.IGNORE_INDEX).sum()
    return loss_sum / tokens


class StepTimer(TrainerCallback):
    def __init__(self):
        self.step_times_s = []

    def on_train_begin(self, *_args, **_kwargs):  # the peak of training, as the recipe's steps measure theirs
        measurement.reset_peak_memory(accelerator.device)

    def on_step_begin(self, *_args, **_kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, *_args, **_kwargs):
        self.step_times_s.append(time.perf_counter() - self.start)


timer = StepTimer()
training_args = TrainingArguments(
    output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.per_device_batch_size,
    gradient_accumulation_steps=1, learning_rate=args.lr, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
    max_grad_norm=1.0, optim="adamw_torch", lr_scheduler_type="constant", seed=args.seed, report_to="none",
    save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_drop_last=True,
    ddp_backend="gloo" if not torch.cuda.is_available() else None,
    accelerator_config={"use_configured_state": use_configured_state})
trainer = Trainer(model=model, args=training_args, train_dataset=train_rows, compute_loss_func=token_mean_loss,
                  callbacks=[timer])
trainer.train()
engine = Engine.of(trainer.accelerator).name

evidence = evidence.sharding_evidence(trainer.model_wrapped, trainer.optimizer)
fractions = distributed.max_over_ranks(trainer.accelerator, {f"rank{r}": 0 for r in range(world)}
                                   | {f"rank{trainer.accelerator.process_index}": round(
                                       evidence["local_param_fraction"] * 1e6)})
peak = distributed.max_over_ranks(trainer.accelerator,
                              {"peak_mem_bytes": measurement.peak_memory_bytes(trainer.accelerator.device)})
tokens_per_step = args.per_device_batch_size * world * args.seq_len
if trainer.accelerator.is_main_process:
    result = {
        "engine": engine, "world_size": world, "trainer_distributed_type": str(trainer.accelerator.distributed_type),
        "tokens_per_s": workload.tokens_per_s(timer.step_times_s, tokens_per_step, args.untimed_steps),
        "step_times_s": timer.step_times_s,
        "peak_mem_bytes": peak["peak_mem_bytes"],
        "local_param_fraction_per_rank": [fractions[f"rank{r}"] / 1e6 for r in range(world)],
        "model_class": evidence["model_class"], "optimizer_class": evidence["optimizer_class"],
    }
    Path(args.output_dir, "trainer.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
accelerator_setup.close_and_exit(trainer.accelerator)
