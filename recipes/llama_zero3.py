"""Full-parameter supervised fine-tuning of a Llama-family causal LM under DDP, DeepSpeed ZeRO-1/2/3 or FSDP2.

The accelerate YAML picks the engine; this file is the same under all of them:

    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/llama_zero3.py        # FSDP2 = ZeRO-3
    accelerate launch --config_file accelerate_configs/fsdp2_zero2.yaml recipes/llama_zero3.py  # FSDP2, ZeRO-2 style
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/llama_zero3.py        # DeepSpeed ZeRO-3
    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/llama_zero3.py        # DeepSpeed ZeRO-2
    accelerate launch --config_file accelerate_configs/zero1.yaml recipes/llama_zero3.py        # DeepSpeed ZeRO-1
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/llama_zero3.py          # DDP baseline
    # on a CPU-only machine, add --num_processes 2 (the YAMLs default to 8 GPUs):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 recipes/llama_zero3.py

Features, the flag that controls each, and its cost:
    data        --dataset (Hub id; a .json/.jsonl/.parquet/.csv/.txt/.arrow file, also .gz; a folder of shards or
                a save_to_disk folder), --dataset_split TRAIN[,EVAL], --dataset_config, --dataset_revision
                (--revision pins --model), --columns; packed to --seq_len with per-example position ids
                (--no-packing: one example per row, padded to --seq_len; fewer tokens trained per step);
                --attn_implementation sdpa/eager keep examples apart with block masks, flash_attention_2/3/4
                with varlen offsets (others refused; unset on CUDA in bf16 with
                flash-attn installed: flash_attention_2, said in one line); loss only on answer tokens
                (text: every token, long documents split into windows); rows prepared once per job in bounded
                memory and reused by a relaunch with the same data and settings (zero_utils/data/preparation.py),
                tokenized by --num_proc forked processes (default the CPUs, at most 8; ~20 MB of RAM each)
    batch       --per_device_batch_size x --gradient_accumulation_steps x processes = global batch; the loss
                is the mean over the global batch's answer tokens, so in fp32 the engine never changes the maths
                (in bf16 each engine rounds its own way: docs/PRECISION.md); [FSDP2] every micro-batch's
                gradients are reduce-scattered, so accumulating holds 1/N of them (one reduce-scatter per
                micro-batch instead of per step: docs/MEMORY.md)
    optimizer   AdamW (--lr, --weight_decay, --adam_beta1, --adam_beta2, --adam_eps), warmup (--warmup_steps) then
                --lr_schedule (cosine down to --min_lr_ratio x --lr), --max_grad_norm
    loss        output head + cross-entropy over --loss_chunk_tokens tokens at a time (0 = whole logits): a
                micro-batch's fp32 logits never exist whole; each chunk's recomputed in backward (+1/3 head FLOPs)
    offloading  --activation_offloading (with --gradient_checkpointing): each block's input waits in host memory
                between its forward and its recompute (pinned, copied on a side stream on a GPU; L x s x b x h
                elements per rank on the host, two on the device at once)
    fit check   before the data and the model: this run's peak memory per rank, estimated term by term, against the
                device's (--device_memory, default the GPU's total); stops every rank naming what fits when it does
                not, warns within 15%; --no-fit_check skips it (a meta-device build of the model: seconds)
    eval        --eval_fraction held out (or the dataset's validation split), every --eval_every steps
    checkpoint  --save_every steps, --keep_last, --resume auto|PATH, --overwrite (one save: model + optimizer)
    waits       work one process does alone (data preparation, a Hub model's download once per node, rank 0
                reading the weights, the export) is waited for outside collectives, on every node, as long as it
                takes or --wait_limit_s (default 0: no limit); --collective_timeout_s bounds collectives only. On
                several nodes --output_dir must be a folder every node sees: checked at start, in seconds
    FSDP2       block-by-block wrapping; --fsdp_reshard_last_block, --fsdp_embedding_group, --fsdp_prefetch_blocks
                (default: last block kept gathered for backward); pretrained weights are read by rank 0 only
                and broadcast
    tracking    metrics.jsonl + summary.json in --output_dir; --report_to wandb (offline without a key) | none
    presets     --config RUN.yaml: recipe flags from a file (presets/ for real models); flags given override it
Outputs: --output_dir/{metrics.jsonl, summary.json, checkpoints/step_<N>/, final/ (a Hugging Face model folder)}.
"""

import math
from dataclasses import dataclass

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from zero_utils.assets import BUNDLED_DATASET, BUNDLED_MODEL
from zero_utils.checkpoint.policy import Checkpointer
from zero_utils.data.training import DataSource, TrainingData
from zero_utils.launch.cli import flag, run_recipe
from zero_utils.memory.fit_check import check_fit
from zero_utils.model.loading import (
    choose_attention,
    count_parameters,
    greedy_answer,
    load_causal_lm,
    load_config,
    load_tokenizer,
)
from zero_utils.model.parallelize import FSDPWrapping, after_prepare, parallelize
from zero_utils.run.accelerator import build_accelerator, close_and_exit
from zero_utils.train import tracking
from zero_utils.train.measurement import RunMeasurements
from zero_utils.train.optim import build_adamw, clip_gradients, describe_param_groups, lr_at, set_lr
from zero_utils.train.token_loss import TokenLosses


# ---------------------------------------------------------------------------------------------- settings
@dataclass
class Settings:
    model: str = flag(BUNDLED_MODEL, "Hub id or local folder of a causal LM")
    revision: str = flag("", "Hub revision (branch, tag or commit) of --model")
    dataset: str = flag(BUNDLED_DATASET, "Hub id, local file or folder (shards, or a save_to_disk folder)")
    dataset_split: str = flag("", "TRAIN[,EVAL] split names, e.g. train_sft,test_sft (default: train; validation/test)")
    dataset_config: str = flag("", "configuration of a Hub data set")
    dataset_revision: str = flag("", "Hub revision (branch, tag or commit) of --dataset")
    columns: str = flag("", "rename columns, e.g. prompt=question,completion=answer")
    num_proc: int = flag(0, "processes that tokenize the data (0: the main process's CPUs, at most 8); same rows for "
                         "any", min=0)
    output_dir: str = flag("runs/llama_zero3", "where metrics, checkpoints and final/ go")
    max_steps: int = flag(150, "optimizer steps", min=1)
    per_device_batch_size: int = flag(4, "rows of seq_len tokens per process per micro-step", min=1)
    gradient_accumulation_steps: int = flag(1, "micro-steps per optimizer step", min=1)
    seq_len: int = flag(256, "tokens per packed row", min=8)
    packing: bool = flag(True, "pack several examples per row; --no-packing: one example per row, padded (as trl)")
    lr: float = flag(3e-3, "peak learning rate", min=0.0)
    weight_decay: float = flag(0.1, "AdamW weight decay on matrices", min=0.0)
    adam_beta1: float = flag(0.9, "AdamW's first-moment decay", min=0.0, below=1.0)
    adam_beta2: float = flag(0.95, "AdamW's second-moment decay (transformers and torch default: 0.999)", min=0.0,
                             below=1.0)
    adam_eps: float = flag(1e-8, "AdamW's epsilon, added to the root of the second moment", min=0.0)
    min_lr_ratio: float = flag(0.1, "the cosine schedule's floor at --max_steps, as a fraction of --lr (0: to zero)",
                               min=0.0)
    warmup_steps: int = flag(10, "linear warmup steps", min=0)
    lr_schedule: str = flag("cosine", "decay after warmup", choices=["cosine", "constant"])
    max_grad_norm: float = flag(1.0, "clip the global gradient norm to this", min=0.0)
    loss_chunk_tokens: int = flag(1024, "tokens per chunk of the output head and loss (0 = whole logits)", min=0)
    max_bad_steps: int = flag(0, "non-finite losses tolerated (their updates skipped) before the run stops", min=0)
    seed: int = flag(42, "seed for init, data order and the eval split")
    eval_fraction: float = flag(0.05, "fraction held out when the dataset has no validation split", min=0.0)
    eval_every: int = flag(50, "eval every N steps (0 = only at the end)", min=0)
    save_every: int = flag(0, "checkpoint every N steps (0 = only at the end)", min=0)
    keep_last: int = flag(2, "checkpoints to keep", min=1)
    collective_timeout_s: int = flag(1800, "a rank waiting this long on a dead peer fails the job", min=10)
    wait_limit_s: int = flag(0, "longest wait for one process's work: data prep, download, rank-0 load, export "
                             "(0 = no limit)", min=0)
    resume: str = flag("", "'auto' (newest complete checkpoint in output_dir) or a checkpoint path")
    overwrite: bool = flag(False, "allow an output_dir that already holds checkpoints")
    report_to: str = flag("wandb", "wandb, none, or any accelerate tracker")
    project: str = flag("zero-recipes", "tracker project name")
    group: str = flag("", "tracker run group (W&B group), e.g. one comparison of engines")
    attn_implementation: str = flag("", "sdpa (default), eager, flash_attention_2, ...")
    trust_remote_code: bool = flag(False, "run the model repository's own Python code (only for repos you trust)")
    gradient_checkpointing: bool = flag(False, "recompute each block's activations in backward (less memory)")
    activation_offloading: bool = flag(False, "with --gradient_checkpointing: the blocks' inputs wait in host memory")
    fsdp_reshard_last_block: bool = flag(FSDPWrapping.reshard_last_block, "FSDP2: reshard the last block after "
                                         "forward too (less memory, one more all-gather)")
    fsdp_embedding_group: bool = flag(FSDPWrapping.embedding_group, "FSDP2: the input embedding is its own unit "
                                      "(else the root's, gathered all step)")
    fsdp_prefetch_blocks: int = flag(FSDPWrapping.prefetch_blocks, "FSDP2: all-gathers of the next K blocks "
                                     "started early (1 = implicit)", min=1)
    prompt: str = flag("What is the capital of France?", "answered greedily at the end")
    max_new_tokens: int = flag(24, "tokens generated for --prompt", min=0)
    async_save: bool = flag(False, "FSDP2/DDP: write checkpoints in the background while training goes on")
    device_memory: str = flag("", "memory per rank the fit check plans for: 80GB, 80GiB, 80e9 (default: the GPU's "
                              "total; on CPU the available host memory / local processes)")
    fit_check: bool = flag(True, "estimate the peak memory per rank before building the model; stop if it won't fit")


def main(cfg: Settings) -> None:
    # ------------------------------------------------------------------------------ accelerator and engine
    accelerator, engine = build_accelerator(  # the engine is what the YAML decided
        per_device_batch_size=cfg.per_device_batch_size, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        max_grad_norm=cfg.max_grad_norm, log_with=tracking.trackers_for(cfg.report_to), project_dir=cfg.output_dir,
        timeout_s=cfg.collective_timeout_s, wait_limit_s=cfg.wait_limit_s)
    world = accelerator.num_processes
    attn_implementation, attention_note = choose_attention(  # [CUDA] flash-attn's varlen kernel when installed
        cfg.attn_implementation, accelerator.device, accelerator.mixed_precision)
    if attention_note:
        accelerator.print(attention_note)
    # Owns resume, cadence, async saves, keep-last, metadata and the save after SIGTERM/SIGINT/SIGUSR1.
    checkpointer = Checkpointer(accelerator, engine, cfg)  # --output_dir, --resume, --save_every, --keep_last, ...
    set_seed(cfg.seed)

    # ------------------------------------------------------------------------------ will it fit
    model_config = load_config(cfg.model, cfg.trust_remote_code, cfg.revision, accelerator=accelerator)
    # This run's peak memory per rank, estimated term by term, against the device's: every rank stops here, before
    # the data is prepared and the model built, naming the engine or setting that fits when it does not.
    fit = check_fit(accelerator, engine, model_config, seq_len=cfg.seq_len, micro_batch_size=cfg.per_device_batch_size,
                    activation_checkpointing=cfg.gradient_checkpointing,
                    activation_offloading=cfg.activation_offloading, attn_implementation=attn_implementation,
                    loss_chunk_tokens=cfg.loss_chunk_tokens, device_memory=cfg.device_memory, enabled=cfg.fit_check,
                    trust_remote_code=cfg.trust_remote_code)

    # ------------------------------------------------------------------------------ data
    tokenizer = load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    train_data = TrainingData.prepare(  # tokenized and packed once; sliced per step into this rank's micro-batches
        accelerator, tokenizer, model_config, columns=cfg.columns, seq_len=cfg.seq_len,
        dataset=DataSource(cfg.dataset, cfg.dataset_split, cfg.dataset_config, cfg.dataset_revision),
        eval_fraction=cfg.eval_fraction, seed=cfg.seed, per_device_batch_size=cfg.per_device_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, attn_implementation=attn_implementation,
        num_proc=cfg.num_proc, packing=cfg.packing)
    checkpointer.check(model_config, train_data.global_batch_rows)  # an incompatible checkpoint fails here

    # ------------------------------------------------------------------------------ model, parallelize
    model = load_causal_lm(cfg.model, accelerator=accelerator, attn_implementation=attn_implementation or None,
                           trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    num_params = count_parameters(model, trainable_only=True)
    offload = parallelize(model, accelerator, engine, activation_checkpointing=cfg.gradient_checkpointing,
                          activation_offloading=cfg.activation_offloading,  # None unless --activation_offloading
                          fsdp=FSDPWrapping(cfg.fsdp_reshard_last_block, cfg.fsdp_embedding_group,
                                            cfg.fsdp_prefetch_blocks))

    # ------------------------------------------------------------------------------ optimizer, prepare, resume
    optimizer = build_adamw(model, cfg.lr, cfg.weight_decay, (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_eps)
    param_groups = describe_param_groups(optimizer)  # decay / no-decay: the same under every engine
    model, optimizer = accelerator.prepare(model, optimizer)
    after_prepare(model, accelerator, engine, cfg.model, cfg.revision)  # [DeepSpeed] fp32 master from the weights
    token_losses = TokenLosses(model, cfg.loss_chunk_tokens, train_data.ignore_index, accelerator)  # chunked head
    # metrics.jsonl, summary.json and W&B: the settings and the run's facts in its config; a resumed run continues
    own_config = {"attention": attn_implementation or "sdpa"}  # what ran, also when the recipe chose it
    tracker = tracking.RunTracker(accelerator, cfg, engine, data=train_data, fit=fit, num_params=num_params,
                                  param_groups=param_groups, resumed=checkpointer.resumed, config=own_config)
    start_step = checkpointer.load(model, optimizer, hf_files=(accelerator.unwrap_model(model).config, tokenizer),
                                   tracker_run_id=tracker.run_id)
    # tokens/s, memory peaks from here on, model-state bytes next to the formula's, saved-activation bytes
    meter = RunMeasurements(accelerator, engine, model, optimizer, tokens_per_step=train_data.tokens_per_step,
                            max_bad_steps=cfg.max_bad_steps, newest_checkpoint=checkpointer.newest)
    accelerator.print(f"engine {engine} | {world} process(es) | {num_params / 1e6:.2f}M params | model states per "
                      f"rank (expected): {meter.expected_model_state_bytes / 1e6:.1f} MB | mixed precision: "
                      f"{accelerator.mixed_precision}" + (f" | resumed from {checkpointer.resume_from} at step "
                                                          f"{start_step}" if start_step else ""))
    accelerator.print(train_data.describe())  # the batch arithmetic and the packed data

    def token_loss_sum(micro):  # summed over the micro-batch's answer tokens
        return token_losses(model, micro).sum()

    def evaluate(step):  # mean loss over the held-out answer tokens, every --eval_every steps and at the end
        due = step == cfg.max_steps or (cfg.eval_every and step % cfg.eval_every == 0)
        return meter.eval_loss(token_loss_sum, train_data.eval_batches()) if due and train_data.has_eval else None

    # ------------------------------------------------------------------------------ training loop
    model.train()
    stopped, eval_loss, last = False, None, None
    progress = tqdm(range(start_step + 1, cfg.max_steps + 1), initial=start_step, total=cfg.max_steps,
                    disable=not accelerator.is_main_process, desc=f"train [{engine}]")
    for step in progress:
        meter.start_step()
        lr = lr_at(step, max_steps=cfg.max_steps, peak_lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                   schedule=cfg.lr_schedule, min_lr_ratio=cfg.min_lr_ratio)
        set_lr(optimizer, lr)
        batches = train_data.step_batches(step)  # this rank's micro-batches, and the global batch's answer tokens
        # The loss is the mean over the global batch's answer tokens: after accelerate divides by the accumulation
        # steps and the engine averages over ranks, the gradient is d(sum of token losses)/d(theta) / token count:
        # loss_scale = processes x accumulation / answer tokens ([SP] with the engine's own averaging).
        scale = batches.loss_scale
        loss_sum = torch.zeros((), device=accelerator.device)
        for micro in batches.micro_batches:
            with accelerator.accumulate(model), meter.micro_batch(offload):  # saved activations; states (steps 1-2)
                micro_loss_sum = token_loss_sum(micro)
                accelerator.backward(micro_loss_sum * scale)
                loss_sum += micro_loss_sum.detach()
        grad_norm = clip_gradients(accelerator, model, cfg.max_grad_norm)  # fp64 norm; DeepSpeed clips in its step
        # The step's one collective and host sync: loss, gradient norm, memory peaks, and any rank's stop signal.
        result = meter.end_step(step, lr=lr, loss_sum=loss_sum, loss_tokens=batches.loss_tokens, grad_norm=grad_norm)
        if result.skipped:  # a non-finite loss: no update (past --max_bad_steps end_step stops the run)
            optimizer.zero_grad()
            continue
        optimizer.step()
        optimizer.zero_grad()
        eval_loss = evaluate(step)  # None unless due
        tracker.log_step(result, eval_loss=eval_loss)
        last = result
        progress.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{result.tokens_per_s:.0f}")
        stopped = checkpointer.save(step, stop=result.stop)  # saves when due; after a stop signal: stop here
        if stopped:
            break
    progress.close()

    # ------------------------------------------------------------------------------ export, answer, summary
    if not stopped:
        final_checkpoint = checkpointer.export(f"{cfg.output_dir}/final")  # a Hugging Face folder, from the shards
        answer = greedy_answer(model, tokenizer, cfg.prompt, cfg.max_new_tokens, accelerator.device)  # every rank
        own_summary = {"perplexity": math.exp(eval_loss) if eval_loss is not None else None}
        summary = tracker.write_summary(  # the meter's figures next to the fit check's, the data, the checkpoint
            meter, last, eval_loss=eval_loss, answer=answer, checkpoint=final_checkpoint, own=own_summary)
        accelerator.print(f"\n{cfg.prompt!r} -> {answer!r}")
        accelerator.print(tracking.summary_table(summary))
    close_and_exit(accelerator)  # closes the trackers (flushes W&B) and the process group; exits with status 0


if __name__ == "__main__":
    run_recipe(main, Settings, __doc__)
