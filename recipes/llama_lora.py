"""LoRA fine-tuning (PEFT) of a Llama-family causal LM under DDP, DeepSpeed ZeRO-3 or FSDP2: only the adapters
train, so gradients and optimizer state shrink to the adapters' share; the frozen base is sharded like any
parameter under ZeRO-3/FSDP2. This file is llama_zero3.py with every line that differs marked [LoRA].

    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/llama_lora.py    # FSDP2 = ZeRO-3
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/llama_lora.py    # DeepSpeed ZeRO-3
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/llama_lora.py      # DDP
    # on a CPU-only machine, add --num_processes 2 (the YAMLs default to 8 GPUs):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 recipes/llama_lora.py

Features, the flag that controls each, and its cost:
    LoRA        --lora_r, --lora_alpha, --lora_dropout, --lora_target_modules ("all-linear" = every linear layer
                of the blocks, any model family); trainable parameters and their optimizer state are r-sized
    QLoRA       --qlora: 4-bit base weights through bitsandbytes, CUDA GPUs only (untested here: no GPU in CI)
    export      final/ = the PEFT adapter (adapter_config.json + adapter_model.safetensors): only the trainable
                tensors are gathered, one at a time; --merge also writes final/merged/, the base with the
                adapters merged in (on the main process, from the base model on disk)
    data, batch, optimizer, eval, checkpoint, FSDP2 (--fsdp_*), tracking, presets (--config):
                as in llama_zero3.py
Outputs: --output_dir/{metrics.jsonl, summary.json, checkpoints/step_<N>/, final/ (adapter), final/merged/}.
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from peft import LoraConfig, get_peft_model  # [LoRA]
from tqdm.auto import tqdm

from zero_utils import attention, checkpoint, data, distributed, errors, generate, memory, tracking, wrapping
from zero_utils.accelerator import build_accelerator, size_deepspeed_buckets
from zero_utils.cli import flag, run_recipe
from zero_utils.engine import Engine, shard_group_size
from zero_utils.measure import RunMeasurements
from zero_utils.model import (
    BUNDLED_MODEL,
    count_parameters,
    gather_trainable_state_dict,  # [LoRA]
    load_causal_lm,
    load_config,
    load_tokenizer,
    quantization_config,  # [LoRA]
    zero3_init_disabled,  # [LoRA]
)
from zero_utils.optim import build_adamw, describe_param_groups, lr_at, set_lr


# ---------------------------------------------------------------------------------------------- settings
@dataclass
class Settings:
    model: str = flag(BUNDLED_MODEL, "Hub id or local folder of a causal LM")
    dataset: str = flag(data.BUNDLED_DATASET, "Hub id or local file/folder")
    columns: str = flag("", "rename columns, e.g. prompt=question,completion=answer")
    output_dir: str = flag("runs/llama_lora", "where metrics, checkpoints and final/ go")  # [LoRA]
    lora_r: int = flag(16, "LoRA rank", min=1)  # [LoRA]
    lora_alpha: int = flag(32, "LoRA scaling numerator (scale = alpha / r)", min=1)  # [LoRA]
    lora_dropout: float = flag(0.05, "dropout on the LoRA input", min=0.0)  # [LoRA]
    lora_target_modules: str = flag("all-linear", "comma-separated module names, or all-linear")  # [LoRA]
    merge: bool = flag(False, "also write final/merged: the base model with the adapters merged in")  # [LoRA]
    qlora: bool = flag(False, "4-bit base weights (bitsandbytes; CUDA GPUs only)")  # [LoRA]
    max_steps: int = flag(150, "optimizer steps", min=1)
    per_device_batch_size: int = flag(4, "rows of seq_len tokens per process per micro-step", min=1)
    gradient_accumulation_steps: int = flag(1, "micro-steps per optimizer step", min=1)
    seq_len: int = flag(256, "tokens per packed row", min=8)
    lr: float = flag(3e-3, "peak learning rate", min=0.0)
    weight_decay: float = flag(0.1, "AdamW weight decay on matrices", min=0.0)
    warmup_steps: int = flag(10, "linear warmup steps", min=0)
    lr_schedule: str = flag("cosine", "decay after warmup", choices=["cosine", "constant"])
    max_grad_norm: float = flag(1.0, "clip the global gradient norm to this", min=0.0)
    max_bad_steps: int = flag(0, "non-finite losses tolerated (their updates skipped) before the run stops", min=0)
    seed: int = flag(42, "seed for init, data order and the eval split")
    eval_fraction: float = flag(0.05, "fraction held out when the dataset has no validation split", min=0.0)
    eval_every: int = flag(50, "eval every N steps (0 = only at the end)", min=0)
    save_every: int = flag(0, "checkpoint every N steps (0 = only at the end)", min=0)
    keep_last: int = flag(2, "checkpoints to keep", min=1)
    collective_timeout_s: int = flag(1800, "a rank waiting this long on a dead peer fails the job", min=10)
    resume: str = flag("", "'auto' (newest complete checkpoint in output_dir) or a checkpoint path")
    overwrite: bool = flag(False, "allow an output_dir that already holds checkpoints")
    report_to: str = flag("wandb", "wandb, none, or any accelerate tracker")
    project: str = flag("zero-recipes", "tracker project name")
    group: str = flag("", "tracker run group (W&B group), e.g. one comparison of engines")
    attn_implementation: str = flag("", "sdpa (default), eager, flash_attention_2, ...")
    trust_remote_code: bool = flag(False, "run the model repository's own Python code (only for repos you trust)")
    gradient_checkpointing: bool = flag(False, "recompute each block's activations in backward (less memory)")
    fsdp_reshard_last_block: bool = flag(False, "FSDP2: reshard the last block after forward too (less memory, "
                                         "one more all-gather)")
    fsdp_embedding_group: bool = flag(True, "FSDP2: the input embedding is its own unit (else the root's, "
                                      "gathered all step)")
    fsdp_prefetch_blocks: int = flag(1, "FSDP2: all-gathers of the next K blocks started early (1 = implicit)",
                                     min=1)
    prompt: str = flag("What is the capital of France?", "answered greedily at the end")
    max_new_tokens: int = flag(24, "tokens generated for --prompt", min=0)
    async_save: bool = flag(False, "FSDP2/DDP: write checkpoints in the background while training goes on")


def main(cfg: Settings) -> None:
    # ------------------------------------------------------------------------------ accelerator, seed, resume
    accelerator = build_accelerator(
        per_device_batch_size=cfg.per_device_batch_size, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        max_grad_norm=cfg.max_grad_norm, log_with=tracking.trackers_for(cfg.report_to), project_dir=cfg.output_dir,
        timeout_s=cfg.collective_timeout_s)
    engine = Engine.of(accelerator)  # what runs, read from the accelerator (the YAML decided it)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    # Owns resume, cadence, async saves, keep-last, metadata and the save on SIGTERM/SIGINT/SIGUSR1.
    checkpointer = checkpoint.Checkpointer(
        accelerator, engine, cfg.output_dir, resume=cfg.resume, overwrite=cfg.overwrite, save_every=cfg.save_every,
        keep_last=cfg.keep_last, max_steps=cfg.max_steps, async_save=cfg.async_save, seed=cfg.seed,
        settings=asdict(cfg))
    set_seed(cfg.seed)

    # ------------------------------------------------------------------------------ data
    # Packed rows hold several examples: sdpa/eager keep them apart with per-row block masks, flash-attention with
    # the examples' offsets passed to its varlen kernel; any other implementation is refused here, before data prep.
    attention_path = attention.packing_path(cfg.attn_implementation)
    tokenizer = load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code)
    model_config = load_config(cfg.model, cfg.trust_remote_code)
    data.check_seq_len(cfg.seq_len, model_config.max_position_embeddings)  # before tokenizing anything
    train_rows, eval_rows, data_info = data.build_sft_datasets(
        accelerator, tokenizer, cfg.dataset, cfg.seq_len, cfg.eval_fraction, cfg.seed,
        data.parse_column_map(cfg.columns), vocab_size=model_config.vocab_size)  # pads inside the embedding
    global_batch = cfg.per_device_batch_size * cfg.gradient_accumulation_steps * world
    data.check_enough_rows(len(train_rows), global_batch)
    loss_tokens_per_row = data.loss_tokens_per_row(train_rows)  # each step's token count, with no collective
    checkpointer.check_resume(model_config, global_batch)  # an incompatible checkpoint fails here, before loading

    # ------------------------------------------------------------------------------ model
    model = load_causal_lm(cfg.model, accelerator=accelerator, attn_implementation=cfg.attn_implementation or None,
                           trust_remote_code=cfg.trust_remote_code,  # [LoRA]
                           quantization_config=quantization_config(cfg.qlora))  # [LoRA] QLoRA: 4-bit base
    lora_config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,  # [LoRA]
                             target_modules=_target_modules(cfg.lora_target_modules), task_type="CAUSAL_LM")  # [LoRA]
    model = get_peft_model(model, lora_config)  # [LoRA] freezes the base, adds the adapters
    num_params = count_parameters(model, trainable_only=True)
    frozen_params = count_parameters(model) - num_params  # [LoRA]
    if cfg.gradient_checkpointing:  # before sharding, so every engine wraps the checkpointed blocks
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if engine.is_fsdp2:  # [FSDP2] shard block by block, then the root, before the optimizer sees params
        wrapping.shard_model(model, accelerator, reshard_last_block=cfg.fsdp_reshard_last_block,
                             embedding_group=cfg.fsdp_embedding_group, prefetch_blocks=cfg.fsdp_prefetch_blocks)
    elif any(getattr(cfg, f) != getattr(Settings, f) for f in ("fsdp_reshard_last_block", "fsdp_embedding_group",
                                                               "fsdp_prefetch_blocks")):
        accelerator.print(f"warning: the --fsdp_* wrapping flags have no effect under {engine}.")
    if engine.is_deepspeed:  # [DeepSpeed] communication buckets sized from the model's hidden size
        size_deepspeed_buckets(accelerator, model)

    # ------------------------------------------------------------------------------ optimizer, prepare, resume
    optimizer = build_adamw(model, cfg.lr, cfg.weight_decay)
    param_groups = describe_param_groups(optimizer)  # decay / no-decay: the same under every engine
    expected_state_bytes = memory.expected_model_state_bytes(
        engine, num_params, world, accelerator.mixed_precision, param_groups=memory.param_group_shapes(optimizer),
        shard_group_size=shard_group_size(accelerator), frozen_params=frozen_params)  # [LoRA] frozen base
    model, optimizer = accelerator.prepare(model, optimizer)
    # [LoRA] no fp32-master restore from the checkpoint under DeepSpeed: the trainable adapters are new tensors
    start_step = checkpointer.load(model, optimizer, hf_files=(accelerator.unwrap_model(model).config, tokenizer))

    # ------------------------------------------------------------------------------ tracking
    run_config = {**asdict(cfg), "engine": engine.name, "world_size": world, "num_params": num_params,
                  "optimizer_param_groups": param_groups, "mixed_precision": accelerator.mixed_precision,
                  "global_batch_rows": global_batch, "frozen_params": frozen_params}  # [LoRA]
    tracker = tracking.RunTracker(accelerator, cfg.output_dir, cfg.report_to, cfg.project, config=run_config,
                                  run_name=f"{engine}-{world}x", group=cfg.group or None,
                                  resume_step=checkpointer.resumed_step,
                                  resume_run_id=checkpointer.resumed_tracker_run_id)
    checkpointer.tracker_run_id = tracker.run_id  # a resumed run continues the same W&B run
    tokens_per_step = global_batch * cfg.seq_len
    accelerator.print(
        f"engine {engine} | {world} process(es) | micro-batch {cfg.per_device_batch_size} x accumulation "
        f"{cfg.gradient_accumulation_steps} x {world} = global batch {global_batch} rows = {tokens_per_step} tokens | "
        f"{num_params / 1e6:.2f}M params | model states per rank (expected): {expected_state_bytes / 1e6:.1f} MB | "
        f"mixed precision: {accelerator.mixed_precision}"
        + (f" | resumed from {checkpointer.resume_from} at step {start_step}" if start_step else ""))
    accelerator.print(data.describe(data_info, cfg.seq_len))
    if engine.is_data_parallel_only:
        accelerator.print(f"no ZeRO engine named by the launch: running {engine}. For ZeRO-3 add --config_file "
                          "accelerate_configs/fsdp2.yaml (or zero3.yaml for DeepSpeed) to accelerate launch.")

    def token_loss_sum(batch):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                       **attention.packed_kwargs(batch["position_ids"], attention_path)).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=data.IGNORE_INDEX, reduction="sum")

    def evaluate():
        model.eval()
        totals = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in data.eval_micro_batches(eval_rows, rank, world, cfg.per_device_batch_size, device):
                num_tokens = (batch["labels"] != data.IGNORE_INDEX).sum().float()
                totals += torch.stack([token_loss_sum(batch), num_tokens])
        wrapping.reshard_after_inference(model)  # [FSDP2] free what eval left gathered
        model.train()
        totals = accelerator.reduce(totals, "sum")
        return (totals[0] / totals[1]).item()

    # ------------------------------------------------------------------------------ training loop
    model.train()
    # tokens/s, memory peaks from here on, model-state bytes next to the formula, saved-activation bytes
    meter = RunMeasurements(accelerator, model, optimizer, tokens_per_step=tokens_per_step,
                            expected_model_state_bytes=expected_state_bytes)
    last, bad_steps = {}, 0
    progress = tqdm(range(start_step + 1, cfg.max_steps + 1), initial=start_step, total=cfg.max_steps,
                    disable=not accelerator.is_main_process, desc=f"train [{engine}]")
    for step in progress:
        meter.start_step()
        lr = lr_at(step, max_steps=cfg.max_steps, peak_lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                   schedule=cfg.lr_schedule)
        set_lr(optimizer, lr)
        indices = data.global_batch_indices(len(train_rows), global_batch, step, cfg.seed)
        micro_batches = data.rank_micro_batches(train_rows, indices, rank, world, cfg.per_device_batch_size,
                                                cfg.gradient_accumulation_steps, device)
        # The loss is the mean over every answer token of the global batch: scale each micro-batch's token-loss
        # sum so that (after accelerate divides by the accumulation steps and the engine averages over ranks) the
        # gradient is d(sum of token losses)/d(theta) / global token count.
        global_tokens = data.global_batch_loss_tokens(loss_tokens_per_row, indices)
        loss_sum = torch.zeros((), device=device)
        for batch in micro_batches:
            with accelerator.accumulate(model), meter.count_saved_activations():  # the first forward is measured
                micro_loss_sum = token_loss_sum(batch)
                accelerator.backward(micro_loss_sum * (world * cfg.gradient_accumulation_steps / global_tokens))
                loss_sum += micro_loss_sum.detach()
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        # One collective and one host sync per step: the loss, the gradient norm, the memory peaks and whether a
        # stop signal reached any rank travel together.
        values = distributed.reduce_step_values(
            accelerator, sums={"loss_sum": loss_sum},
            maxes={"grad_norm": distributed.local_scalar(grad_norm), "stop": checkpointer.stop_requested_here(),
                   **meter.peak_memory()})
        step_loss = values["loss_sum"] / global_tokens
        if not math.isfinite(step_loss):
            # Skip the update (DeepSpeed has already applied it inside backward) and stop past --max_bad_steps,
            # without saving: the last good checkpoint stays the newest.
            optimizer.zero_grad()
            bad_steps += 1
            if bad_steps > cfg.max_bad_steps:
                raise errors.non_finite_loss(step_loss, step, bad_steps, cfg.max_bad_steps,
                                             newest_checkpoint=checkpoint.newest_complete(cfg.output_dir))
            accelerator.print(f"warning: non-finite loss at step {step}, update skipped ({bad_steps} so far)")
            continue
        optimizer.step()
        optimizer.zero_grad()
        last = {"step": step, "loss": step_loss, "lr": lr, "grad_norm": values["grad_norm"],
                **meter.step_metrics(values)}
        if eval_rows is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps):
            last["eval_loss"] = evaluate()
        tracker.log_step(last)
        progress.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{last['tokens_per_s']:.0f}")
        checkpointer.step(step, stop=values["stop"] > 0)  # saves when due; after a stop signal: saves and exits
    progress.close()

    # ------------------------------------------------------------------------------ save, answer, summary
    final_checkpoint = checkpointer.finish()
    # [LoRA] the adapter: only the trainable tensors are gathered, one at a time (the frozen base never is)
    adapter_state = gather_trainable_state_dict(model, accelerator)  # [LoRA]

    def save_adapter_and_merge():  # [LoRA] on the main process alone: no DeepSpeed zero.Init (a collective) here
        accelerator.unwrap_model(model).save_pretrained(f"{cfg.output_dir}/final", state_dict=adapter_state)  # [LoRA]
        tokenizer.save_pretrained(f"{cfg.output_dir}/final")  # [LoRA]
        if cfg.merge:  # [LoRA] the base from disk plus the adapters
            with zero3_init_disabled(accelerator):  # [LoRA]
                merged = get_peft_model(load_causal_lm(cfg.model), lora_config)  # [LoRA]
            if merged.load_state_dict(adapter_state, strict=False).unexpected_keys:  # [LoRA]
                raise RuntimeError("the adapter's tensor names do not match the merged model's")  # [LoRA]
            merged.merge_and_unload().save_pretrained(f"{cfg.output_dir}/final/merged")  # [LoRA]
            tokenizer.save_pretrained(f"{cfg.output_dir}/final/merged")  # [LoRA]

    # [LoRA] the other ranks wait outside any collective: a long merge is not cut off by --collective_timeout_s.
    distributed.run_on_main_process(accelerator, save_adapter_and_merge)  # [LoRA]
    answer = generate.greedy_answer(model, tokenizer, cfg.prompt, cfg.max_new_tokens, device)  # every rank: sharded
    eval_loss = last.get("eval_loss")
    summary = {
        "engine": engine.name, "world_size": world, "mixed_precision": accelerator.mixed_precision,
        "steps": cfg.max_steps, "final_loss": last.get("loss"), "eval_loss": eval_loss,
        "perplexity": math.exp(eval_loss) if eval_loss is not None else None, **meter.summary(),
        "num_params": num_params, "global_batch_rows": global_batch, "seq_len": cfg.seq_len, "data": data_info,
        "frozen_params": frozen_params,  # [LoRA]
        "optimizer_param_groups": param_groups, "prompt": cfg.prompt, "answer": answer, "group": cfg.group or None,
        "checkpoint": str(final_checkpoint), "checkpoint_bytes": checkpoint.checkpoint_bytes(final_checkpoint),
    }
    tracker.write_summary(summary)
    accelerator.print(f"\n{cfg.prompt!r} -> {answer!r}")
    accelerator.print(tracking.summary_table(summary))
    distributed.close_and_exit(accelerator)  # closes the trackers (flushes W&B) and the process group; exits


def _target_modules(spec: str):  # [LoRA]
    return spec if spec == "all-linear" else [name.strip() for name in spec.split(",") if name.strip()]  # [LoRA]


if __name__ == "__main__":
    run_recipe(main, Settings, __doc__)
