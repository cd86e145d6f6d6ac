"""trl's DPOTrainer on the pairs benchmarks/trl_dpo.py orders, one process of an `accelerate launch` (that driver
launches it; trl is imported here only). Writes --result (JSON, on the main process): the engine the Trainer's
Accelerator really ran (`Engine.of`), per-step loss and rewards from trl's logs, each step's wall time, the peak
memory per rank during training (`zero_utils.train.measurement.peak_memory_bytes`, as the recipes measure it) and the
bytes of trl's reference model each rank holds (`zero_utils.train.evidence.held_here`).

On CPU, zero_utils.run.accelerator's adaptation runs before the Trainer builds its Accelerator: without it accelerate
selects FSDP only for accelerator devices and fsdp2.yaml would silently run DDP.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", required=True, help="a saved model folder (trl builds its reference from the path)")
parser.add_argument("--pairs", required=True, help="JSON lines of conversational prompt/chosen/rejected, in order")
parser.add_argument("--result", required=True)
parser.add_argument("--output_dir", required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--per_device_batch_size", type=int, required=True)
parser.add_argument("--seq_len", type=int, required=True)
parser.add_argument("--lr", type=float, required=True)
parser.add_argument("--beta", type=float, required=True)
parser.add_argument("--seed", type=int, required=True)


def main() -> None:
    args = parser.parse_args()
    from accelerate import PartialState
    from accelerate.utils import gather_object, set_seed
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from zero_utils.model.loading import load_tokenizer
    from zero_utils.run.accelerator import adapt_cpu_launch, requested_engine_family
    from zero_utils.run.engine import Engine
    from zero_utils.train.evidence import held_here
    from zero_utils.train.measurement import peak_memory_bytes, reset_peak_memory

    family = requested_engine_family()
    timeout = datetime.timedelta(seconds=900)
    if not torch.cuda.is_available():  # before the Trainer's Accelerator exists, which takes this configured state
        for handler in adapt_cpu_launch(family, timeout):  # DeepSpeed: gloo
            PartialState(backend=handler.backend, timeout=timeout)
    PartialState(timeout=timeout)

    set_seed(args.seed)
    tokenizer = load_tokenizer(args.model)
    pairs = Dataset.from_json(args.pairs)

    class InOrder(DPOTrainer):  # the pairs as the driver ordered them: the recipe's global batch of each step
        def _get_train_sampler(self, *_args, **_kwargs):
            return SequentialSampler(self.train_dataset)

    class Timer(TrainerCallback):
        def __init__(self):
            self.step_times, self.started = [], None

        def on_train_begin(self, args, state, control, **kwargs):
            reset_peak_memory(torch.device("cpu") if not torch.cuda.is_available() else torch.device("cuda"))

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_times.append(time.perf_counter() - self.started)

    config = DPOConfig(output_dir=args.output_dir, per_device_train_batch_size=args.per_device_batch_size,
                       gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=args.lr,
                       lr_scheduler_type="constant", warmup_steps=0, beta=args.beta, loss_type=["sigmoid"],
                       max_length=args.seq_len, logging_steps=1, save_strategy="no", report_to=[], bf16=False,
                       seed=args.seed, data_seed=args.seed, max_grad_norm=1.0, weight_decay=0.0,
                       dataloader_drop_last=True, model_init_kwargs={"dtype": torch.float32},
                       accelerator_config={"use_configured_state": True})  # the adapted state, not a fresh one
    timer = Timer()
    trainer = InOrder(model=args.model, ref_model=None, args=config, train_dataset=pairs, processing_class=tokenizer,
                      callbacks=[timer])
    engine = Engine.of(trainer.accelerator)
    trainer.train()
    device = trainer.accelerator.device
    reference = getattr(trainer, "ref_model", None)
    reference_bytes = sum(held_here(p).numel() * held_here(p).element_size() for p in reference.parameters()) \
        if reference is not None else 0
    mine = {"peak_mem_bytes": peak_memory_bytes(device), "reference_state_bytes": reference_bytes}
    every_rank = gather_object([mine])
    if trainer.accelerator.is_main_process:
        logs = [entry for entry in trainer.state.log_history if "loss" in entry and "step" in entry]
        result = {"engine": engine.name, "family": family, "steps": [
            {"step": e["step"], "loss": e["loss"], **{k.removeprefix("rewards/"): e[k] for k in
                                                      ("rewards/chosen", "rewards/rejected", "rewards/margins",
                                                       "rewards/accuracies") if k in e}} for e in logs],
            "step_time_s": timer.step_times, "per_rank": every_rank}
        with open(args.result, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
