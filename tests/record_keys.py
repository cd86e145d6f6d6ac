"""The keys of summary.json and of the run's tracker (W&B) config of each recipe, as the code before issue 71 wrote
them (6396565: each recipe built both dicts itself), for the shared runs the recipes' test files read: a test holds
that the bookkeeping in the tracker writes exactly these (not the harness's `*_per_rank` keys)."""

from __future__ import annotations

KEYS = {
    "llama_zero3": {
        "summary": set("""
        answer checkpoint checkpoint_bytes data engine eval_loss final_loss first_step_extra_s fit_check
        global_batch_rows group mixed_precision model_state_breakdown_bytes model_state_bytes
        model_state_bytes_expected num_params optimizer_param_groups peak_mem_bytes peak_mem_bytes_estimated
        peak_mem_measured peak_reserved_bytes perplexity prompt saved_activation_bytes seq_len step_time_s steps
        tokens_per_s tracker_run_id versions world_size
        """.split()),
        "config": set("""
        activation_offloading adam_beta1 adam_beta2 adam_eps async_save attention attn_implementation
        collective_timeout_s columns data_sources dataset dataset_config dataset_revision dataset_split
        device_memory engine eval_every eval_fraction fit_check fsdp_embedding_group fsdp_prefetch_blocks
        fsdp_reshard_last_block global_batch_rows gradient_accumulation_steps gradient_checkpointing group keep_last
        loss_chunk_tokens lr lr_schedule max_bad_steps max_grad_norm max_new_tokens max_steps min_lr_ratio
        mixed_precision model num_params num_proc optimizer_param_groups output_dir overwrite packing
        peak_mem_bytes_estimated per_device_batch_size project prompt report_to resume revision save_every seed
        seq_len trust_remote_code version_accelerate version_deepspeed version_python version_torch
        version_transformers version_zero_recipes version_zero_utils_from wait_limit_s warmup_steps weight_decay
        world_size
        """.split()),
    },
    "llama_lora": {
        "summary": set("""
        answer checkpoint checkpoint_bytes data engine eval_loss final_loss first_step_extra_s fit_check
        frozen_params global_batch_rows group mixed_precision model_state_breakdown_bytes model_state_bytes
        model_state_bytes_expected num_params optimizer_param_groups peak_mem_bytes peak_mem_bytes_estimated
        peak_mem_measured peak_reserved_bytes perplexity prompt saved_activation_bytes seq_len step_time_s steps
        tokens_per_s tracker_run_id versions world_size
        """.split()),
        "config": set("""
        activation_offloading adam_beta1 adam_beta2 adam_eps async_save attention attn_implementation
        collective_timeout_s columns data_sources dataset dataset_config dataset_revision dataset_split
        device_memory engine eval_every eval_fraction fit_check frozen_params fsdp_embedding_group
        fsdp_prefetch_blocks fsdp_reshard_last_block global_batch_rows gradient_accumulation_steps
        gradient_checkpointing group keep_last lora_alpha lora_dropout lora_r lora_target_modules loss_chunk_tokens
        lr lr_schedule max_bad_steps max_grad_norm max_new_tokens max_steps merge min_lr_ratio mixed_precision model
        num_params num_proc optimizer_param_groups output_dir overwrite packing peak_mem_bytes_estimated
        per_device_batch_size project prompt qlora report_to resume revision save_every seed seq_len
        trust_remote_code version_accelerate version_deepspeed version_python version_torch version_transformers
        version_zero_recipes version_zero_utils_from wait_limit_s warmup_steps weight_decay world_size
        """.split()),
    },
    "llama_dpo": {
        "summary": set("""
        answer beta checkpoint checkpoint_bytes data engine eval_loss final_loss first_step_extra_s fit_check
        global_batch_pairs group logps_chosen logps_rejected loss_type mixed_precision model_state_breakdown_bytes
        model_state_bytes model_state_bytes_expected num_params optimizer_param_groups peak_mem_bytes
        peak_mem_bytes_estimated peak_mem_measured peak_reserved_bytes perplexity prompt reference
        reference_digest_end reference_digest_start reference_logps reference_state_bytes
        reference_state_bytes_expected reward_accuracy reward_chosen reward_margin reward_rejected
        saved_activation_bytes seq_len step_time_s steps tokens_per_s tracker_run_id versions world_size
        """.split()),
        "config": set("""
        activation_offloading adam_beta1 adam_beta2 adam_eps async_save attn_implementation beta
        collective_timeout_s columns data_sources dataset dataset_config dataset_revision dataset_split
        device_memory engine eval_every eval_fraction fit_check fsdp_embedding_group fsdp_prefetch_blocks
        fsdp_reshard_last_block global_batch_pairs gradient_accumulation_steps gradient_checkpointing group
        keep_last loss loss_chunk_tokens lr lr_schedule max_bad_steps max_grad_norm max_new_tokens max_steps
        min_lr_ratio mixed_precision model num_params num_proc optimizer_param_groups output_dir overwrite
        peak_mem_bytes_estimated per_device_batch_size project prompt reference report_to resume revision save_every
        seed seq_len sft_weight simpo_gamma trust_remote_code version_accelerate version_deepspeed version_python
        version_torch version_transformers version_zero_recipes version_zero_utils_from wait_limit_s warmup_steps
        weight_decay world_size
        """.split()),
    },
    "llama_dpo_lora": {
        "summary": set("""
        answer beta checkpoint checkpoint_bytes data engine eval_logps_chosen eval_logps_rejected eval_loss
        eval_reward_accuracy eval_reward_chosen eval_reward_margin eval_reward_rejected final_loss
        first_step_extra_s fit_check frozen_params global_batch_pairs group logps_chosen logps_rejected loss_type
        mixed_precision model_state_breakdown_bytes model_state_bytes model_state_bytes_expected num_params
        optimizer_param_groups peak_mem_bytes peak_mem_bytes_estimated peak_mem_measured peak_reserved_bytes
        perplexity prompt reference reference_digest_end reference_digest_start reference_logps
        reference_state_bytes reference_state_bytes_expected reward_accuracy reward_chosen reward_margin
        reward_rejected saved_activation_bytes seq_len step_time_s steps tokens_per_s tracker_run_id versions
        world_size
        """.split()),
        "config": set("""
        activation_offloading adam_beta1 adam_beta2 adam_eps async_save attn_implementation beta
        collective_timeout_s columns data_sources dataset dataset_config dataset_revision dataset_split
        device_memory engine eval_every eval_fraction fit_check frozen_params fsdp_embedding_group
        fsdp_prefetch_blocks fsdp_reshard_last_block global_batch_pairs gradient_accumulation_steps
        gradient_checkpointing group keep_last lora_alpha lora_dropout lora_r lora_target_modules loss
        loss_chunk_tokens lr lr_schedule max_bad_steps max_grad_norm max_new_tokens max_steps merge min_lr_ratio
        mixed_precision model num_params num_proc optimizer_param_groups output_dir overwrite
        peak_mem_bytes_estimated per_device_batch_size project prompt reference report_to resume revision save_every
        seed seq_len sft_weight simpo_gamma trust_remote_code version_accelerate version_deepspeed version_python
        version_torch version_transformers version_zero_recipes version_zero_utils_from wait_limit_s warmup_steps
        weight_decay world_size
        """.split()),
    },
}


def assert_record_keys(run, recipe: str) -> None:
    """summary.json's keys (less the harness's `*_per_rank`) and the tracker config's keys (the harness writes them to
    tracker_config_keys.json) are `recipe`'s of KEYS."""
    import json

    summary = {k for k in run.summary() if not k.endswith("_per_rank")}
    config = set(json.loads((run.output_dir / "tracker_config_keys.json").read_text()))
    assert summary == KEYS[recipe]["summary"], (sorted(summary - KEYS[recipe]["summary"]),
                                                 sorted(KEYS[recipe]["summary"] - summary))
    assert config == KEYS[recipe]["config"], (sorted(config - KEYS[recipe]["config"]),
                                               sorted(KEYS[recipe]["config"] - config))
