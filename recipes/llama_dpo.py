"""Full-parameter preference tuning (DPO, IPO, SimPO) of a Llama-family causal LM under DDP, DeepSpeed ZeRO-1/2/3
or FSDP2. The accelerate YAML picks the engine; the reference model is held the way that engine holds the policy:

    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/llama_dpo.py        # FSDP2 = ZeRO-3
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/llama_dpo.py        # DeepSpeed ZeRO-3
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/llama_dpo.py          # DDP baseline
    # on a CPU-only machine, add --num_processes 2 (the YAMLs default to 8 GPUs):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 recipes/llama_dpo.py

Features, the flag that controls each, and its cost:
    data        --dataset with prompt / chosen / rejected strings, or chosen / rejected as chat messages (the
                prompt a column, or the turns both share: UltraFeedback-binarized, Anthropic HH), --columns renames,
                any source llama_zero3.py takes; the chat template as in SFT, loss on the final answer's tokens;
                each answer with its prompt cut to --seq_len tokens, a pair whose answer keeps no token dropped
                (both counted in the data line); a pair's two answers in one micro-batch, right-padded, never
                packed (zero_utils/preference/data.py); pairs tokenized once per job by --num_proc forked
                processes into memory-mapped files, reused by a relaunch with the same data and settings
                (zero_utils/data/preparation.py, zero_utils/preference/pair_rows.py)
    loss        --loss sigmoid (DPO) | ipo | simpo, --beta (0 = the loss's default), --simpo_gamma, --sft_weight
                (+ the chosen answers' NLL per token); the mean over the global batch's pairs, so processes and
                accumulation never change the maths (zero_utils/preference/loss.py cites each paper)
    reference   --reference model (sigmoid, ipo) | precomputed (sigmoid, ipo) | none (simpo). model: a frozen
                copy of the starting weights in the compute dtype, sharded like the policy under ZeRO-3 and FSDP2
                (2 Psi / N bytes in bf16), a replica under DDP and ZeRO-1/2 (2 Psi); one more forward per
                micro-batch; checked equal to the policy by digest at the start and at the end (one gather of each
                model); rebuilt on resume, never saved (a resume must name the checkpoint's --model).
                precomputed: the same copy scores every pair once before the policy is built and is freed (training
                holds 8 bytes per pair of it); the log-probs are kept with the prepared pairs and reused by a
                relaunch or a resume (zero_utils/preference/reference_logps.py); no forward of it per micro-batch
    flow        SFT with llama_zero3.py, then --model runs/llama_zero3/final (README: Preference tuning)
    batch       --per_device_batch_size pairs (2x rows) x --gradient_accumulation_steps x processes = global batch
    offloading  --activation_offloading (with --gradient_checkpointing) as in llama_zero3.py
    fit check   as in llama_zero3.py at 2 rows per pair, with the reference's bytes (python -m zero_utils.memory
                --reference model|precomputed gives the same estimate)
    optimizer, loss chunks (--loss_chunk_tokens), eval (eval_ prefixed metrics), checkpoint, waits
                (--wait_limit_s), FSDP2 (--fsdp_*), tracking, presets (--config): as in llama_zero3.py
Logged per step and on eval: loss, reward_chosen, reward_rejected, reward_margin, reward_accuracy, logps_chosen,
logps_rejected. Outputs: --output_dir/{metrics.jsonl, summary.json, checkpoints/step_<N>/, final/}.
"""

import math
from dataclasses import dataclass

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from zero_utils.assets import BUNDLED_MODEL, BUNDLED_PREFERENCES
from zero_utils.checkpoint.policy import Checkpointer
from zero_utils.data.training import DataSource
from zero_utils.launch.cli import flag, run_recipe
from zero_utils.memory.fit_check import check_fit
from zero_utils.model.loading import count_parameters, greedy_answer, load_causal_lm, load_config, load_tokenizer
from zero_utils.model.parallelize import FSDPWrapping, after_prepare, parallelize
from zero_utils.preference.data import PreferenceData
from zero_utils.preference.loss import (
    LOSSES,
    answer_log_probs,
    averages_log_probs,
    learning_rate,
    objective_sum,
    pair_scores,
    resolve,
)
from zero_utils.preference.reference import build_reference
from zero_utils.run.accelerator import build_accelerator, close_and_exit
from zero_utils.train import tracking
from zero_utils.train.measurement import RunMeasurements
from zero_utils.train.optim import build_adamw, clip_gradients, describe_param_groups, lr_at, set_lr
from zero_utils.train.token_loss import TokenLosses


# ---------------------------------------------------------------------------------------------- settings
@dataclass
class Settings:
    model: str = flag(BUNDLED_MODEL, "Hub id or local folder of a causal LM (the policy and its reference)")
    revision: str = flag("", "Hub revision (branch, tag or commit) of --model")
    dataset: str = flag(BUNDLED_PREFERENCES, "Hub id, local file or folder of prompt/chosen/rejected pairs")
    dataset_split: str = flag("", "TRAIN[,EVAL] split names, e.g. train_prefs,test_prefs (default: train; test)")
    dataset_config: str = flag("", "configuration of a Hub data set")
    dataset_revision: str = flag("", "Hub revision (branch, tag or commit) of --dataset")
    columns: str = flag("", "rename columns, e.g. prompt=question,chosen=good,rejected=bad")
    num_proc: int = flag(0, "processes that tokenize the pairs (0: the main process's CPUs, at most 8); same pairs "
                         "for any", min=0)
    output_dir: str = flag("runs/llama_dpo", "where metrics, checkpoints and final/ go")
    loss: str = flag("sigmoid", "preference loss", choices=list(LOSSES))
    beta: float = flag(0.0, "loss temperature; 0 = the loss's default (sigmoid, ipo: 0.1; simpo: 2.0)", min=0.0)
    simpo_gamma: float = flag(1.0, "SimPO's target reward margin", min=0.0)
    sft_weight: float = flag(0.0, "weight of the chosen answers' NLL per token added to the loss", min=0.0)
    reference: str = flag("", "model, precomputed or none (default: model for sigmoid/ipo, none for simpo)")
    max_steps: int = flag(150, "optimizer steps", min=1)
    per_device_batch_size: int = flag(8, "pairs per process per micro-step (2 rows each)", min=1)
    gradient_accumulation_steps: int = flag(1, "micro-steps per optimizer step", min=1)
    seq_len: int = flag(128, "the most tokens of prompt + answer kept", min=8)
    lr: float | None = flag(None, "peak learning rate (default: 1e-3 for a model with only a config, such as the "
                                  "bundled one; pretrained weights need it given, e.g. 5e-7)", min=0.0)
    weight_decay: float = flag(0.0, "AdamW weight decay on matrices", min=0.0)
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
    seed: int = flag(42, "seed for init (policy and reference), data order and the eval split")
    eval_fraction: float = flag(0.05, "fraction held out when the dataset has no eval split", min=0.0)
    eval_every: int = flag(25, "eval every N steps (0 = only at the end)", min=0)
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
    cfg.lr = learning_rate(cfg.lr, cfg.model)  # not given: 1e-3 for a config-only model; pretrained: one sentence
    beta, reference_mode = resolve(cfg.loss, cfg.beta, cfg.reference)  # a loss without its reference: one sentence
    # ------------------------------------------------------------------------------ accelerator and engine
    accelerator, engine = build_accelerator(  # the engine is what the YAML decided
        per_device_batch_size=cfg.per_device_batch_size, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        max_grad_norm=cfg.max_grad_norm, log_with=tracking.trackers_for(cfg.report_to), project_dir=cfg.output_dir,
        timeout_s=cfg.collective_timeout_s, wait_limit_s=cfg.wait_limit_s)
    world = accelerator.num_processes
    checkpointer = Checkpointer(accelerator, engine, cfg)  # --output_dir, --resume, --save_every, --keep_last, ...

    # ------------------------------------------------------------------------------ will it fit
    model_config = load_config(cfg.model, cfg.trust_remote_code, cfg.revision, accelerator=accelerator)
    fit = check_fit(accelerator, engine, model_config, seq_len=cfg.seq_len,  # + the reference
                    micro_batch_size=2 * cfg.per_device_batch_size,  # a pair is two rows
                    activation_checkpointing=cfg.gradient_checkpointing,
                    activation_offloading=cfg.activation_offloading, attn_implementation=cfg.attn_implementation,
                    loss_chunk_tokens=cfg.loss_chunk_tokens, device_memory=cfg.device_memory, enabled=cfg.fit_check,
                    trust_remote_code=cfg.trust_remote_code, reference=reference_mode,
                    packed_rows=False)  # pairs are padded rows, not packed: no block mask

    # ------------------------------------------------------------------------------ data
    tokenizer = load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    pairs = PreferenceData.prepare(  # tokenized once per job and kept; sliced per step into micro-batches of pairs
        accelerator, tokenizer, model_config, columns=cfg.columns, seq_len=cfg.seq_len,
        dataset=DataSource(cfg.dataset, cfg.dataset_split, cfg.dataset_config, cfg.dataset_revision),
        eval_fraction=cfg.eval_fraction, seed=cfg.seed, per_device_batch_size=cfg.per_device_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, num_proc=cfg.num_proc)
    checkpointer.check(model_config, pairs.global_batch_pairs)  # an incompatible checkpoint fails here

    # ------------------------------------------------------------------------------ reference
    # model: a frozen copy held like the policy (built at start); precomputed: every pair's log-probs computed here by
    # that copy, before the policy exists, then freed; none: nothing (zero_utils/preference/reference.py)
    reference = build_reference(reference_mode, accelerator, engine, pairs, model=cfg.model,
                                seed=checkpointer.init_seed, loss_chunk_tokens=cfg.loss_chunk_tokens,
                                revision=cfg.revision, attn_implementation=cfg.attn_implementation,
                                trust_remote_code=cfg.trust_remote_code)

    # ------------------------------------------------------------------------------ policy, parallelize, prepare
    set_seed(checkpointer.init_seed)  # the policy and the reference (a config-only model) draw the same weights
    model = load_causal_lm(cfg.model, accelerator=accelerator, attn_implementation=cfg.attn_implementation or None,
                           trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    num_params = count_parameters(model, trainable_only=True)
    offload = parallelize(model, accelerator, engine, activation_checkpointing=cfg.gradient_checkpointing,
                          activation_offloading=cfg.activation_offloading,  # None unless --activation_offloading
                          fsdp=FSDPWrapping(cfg.fsdp_reshard_last_block, cfg.fsdp_embedding_group,
                                            cfg.fsdp_prefetch_blocks))
    optimizer = build_adamw(model, cfg.lr, cfg.weight_decay, (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_eps)
    param_groups = describe_param_groups(optimizer)
    model, optimizer = accelerator.prepare(model, optimizer)
    after_prepare(model, accelerator, engine, cfg.model, cfg.revision)  # [DeepSpeed] fp32 master from the weights
    token_losses = TokenLosses(model, cfg.loss_chunk_tokens, pairs.ignore_index, accelerator)  # chunked head

    reference.start(model, token_losses)  # checks the policy starts from the reference's weights (also on a resume)

    # metrics.jsonl, summary.json and W&B: the settings and the run's facts in its config; a resumed run continues
    tracker = tracking.RunTracker(accelerator, cfg, engine, data=pairs, fit=fit, num_params=num_params,
                                  param_groups=param_groups, resumed=checkpointer.resumed,
                                  run_name=f"{engine}-{world}x-{cfg.loss}",
                                  config={"beta": beta})
    start_step = checkpointer.load(model, optimizer, hf_files=(accelerator.unwrap_model(model).config, tokenizer),
                                   tracker_run_id=tracker.run_id)
    meter = RunMeasurements(accelerator, engine, model, optimizer, tokens_per_step=pairs.tokens_per_step,
                            max_bad_steps=cfg.max_bad_steps, newest_checkpoint=checkpointer.newest)
    accelerator.print(f"engine {engine} | {world} process(es) | {num_params / 1e6:.2f}M params | --loss {cfg.loss}, "
                      f"beta {beta:g} | --reference {reference_mode} | mixed precision: {accelerator.mixed_precision}"
                      + (f" | resumed at step {start_step}" if start_step else ""))
    accelerator.print("\n".join(filter(None, [pairs.describe(), reference.describe()])))  # what it costs

    def scores_of(micro):  # the pairs' losses and rewards: chosen rows first, then the rejected ones
        average = averages_log_probs(cfg.loss)
        answers = micro.labels != pairs.ignore_index
        ref = reference.pair_log_probs(micro, answers, average)  # (None, None) without one
        policy_losses = token_losses(model, micro)  # -log p of each answer token, (2 x pairs, seq_len)
        policy = answer_log_probs(-policy_losses, answers, average).chunk(2)
        scores = pair_scores(cfg.loss, beta, *policy, *ref, simpo_gamma=cfg.simpo_gamma)
        chosen_nll = (policy_losses * answers)[: len(policy[0])].sum()  # for --sft_weight
        return scores, chosen_nll

    def eval_sums(batch):  # held-out pairs' sums (filler pairs weigh 0), for the eval_ metrics
        micro, weights = batch
        scores, _ = scores_of(micro)
        return {**scores.sums(weights), "count": weights.sum()}

    def evaluate(step):  # every --eval_every steps and at the end
        due = step == cfg.max_steps or (cfg.eval_every and step % cfg.eval_every == 0)
        return meter.eval_means(eval_sums, pairs.eval_batches()) if due and pairs.has_eval else None

    # ------------------------------------------------------------------------------ training loop
    model.train()
    stopped, eval_metrics, last = False, None, None
    progress = tqdm(range(start_step + 1, cfg.max_steps + 1), initial=start_step, total=cfg.max_steps,
                    disable=not accelerator.is_main_process, desc=f"dpo [{engine}]")
    for step in progress:
        meter.start_step()
        lr = lr_at(step, max_steps=cfg.max_steps, peak_lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                   schedule=cfg.lr_schedule, min_lr_ratio=cfg.min_lr_ratio)
        set_lr(optimizer, lr)
        batches = pairs.step_batches(step)  # this rank's micro-batches, the global batch's pair and token counts
        # the mean over the global batch's pairs, exact after accelerate's 1 / accumulation and the engines' rank mean
        scale = world * cfg.gradient_accumulation_steps / batches.pairs
        loss_sum, sums = torch.zeros((), device=accelerator.device), {}
        for micro in batches.micro_batches:
            with accelerator.accumulate(model), meter.micro_batch(offload):
                scores, chosen_nll = scores_of(micro)
                micro_loss_sum = objective_sum(scores, chosen_nll, sft_weight=cfg.sft_weight,
                                               global_pairs=batches.pairs, global_chosen_tokens=batches.chosen_tokens)
                accelerator.backward(micro_loss_sum * scale)
                loss_sum += micro_loss_sum.detach()
                sums = {k: sums.get(k, 0) + v for k, v in scores.sums().items() if k != "loss"}
        grad_norm = clip_gradients(accelerator, model, cfg.max_grad_norm)
        result = meter.end_step(step, lr=lr, loss_sum=loss_sum, loss_tokens=batches.pairs, grad_norm=grad_norm,
                                extra_sums=sums)  # rewards and log-probs: means over the global batch's pairs
        if result.skipped:
            optimizer.zero_grad()
            continue
        optimizer.step()
        optimizer.zero_grad()
        eval_metrics = evaluate(step)
        tracker.log_step(result, eval_metrics=eval_metrics)
        last = result
        progress.set_postfix(loss=f"{result.loss:.3f}", acc=f"{result.means['reward_accuracy']:.2f}")
        stopped = checkpointer.save(step, stop=result.stop)  # saves when due; after a stop signal: stop here
        if stopped:
            break
    progress.close()

    # ------------------------------------------------------------------------------ export, answer, summary
    if not stopped:
        final_checkpoint = checkpointer.export(f"{cfg.output_dir}/final")
        answer = greedy_answer(model, tokenizer, cfg.prompt, cfg.max_new_tokens, accelerator.device)
        summary = tracker.write_summary(  # the meter's figures next to the fit check's, the data, the checkpoint
            meter, last, eval_loss=(eval_metrics or {}).get("loss"), answer=answer, checkpoint=final_checkpoint,
            own={"loss_type": cfg.loss, "beta": beta, **(last.means if last else {}),
                 **{f"eval_{k}": v for k, v in (eval_metrics or {}).items()}, "perplexity": None,
                 **reference.summary()})
        accelerator.print(f"\n{cfg.prompt!r} -> {answer!r}")
        accelerator.print(tracking.summary_table(summary))
        if math.isfinite(summary.get("eval_reward_accuracy") or math.nan):
            accelerator.print(f"held-out reward accuracy {summary['eval_reward_accuracy']:.3f}, margin "
                              f"{summary['eval_reward_margin']:.3f}")
    close_and_exit(accelerator)


if __name__ == "__main__":
    run_recipe(main, Settings, __doc__)
