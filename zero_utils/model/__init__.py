"""The model, and parallelism applied to it from outside: loading a causal LM and its tokenizer (loading), QLoRA's
4-bit config (qlora), DeepSpeed's own steps around accelerate (deepspeed_setup), FSDP2 block-by-block wrapping
(wrapping), activation offloading (activation_offload) and the one place they are applied (parallelize).

`from zero_utils.model import load_causal_lm, ...` (the names 0.1's recipes imported) imports as it did in 0.1."""

from zero_utils.model.loading import (
    BUNDLED_MODEL,
    choose_attention,
    count_parameters,
    gather_trainable_state_dict,
    greedy_answer,
    load_causal_lm,
    load_config,
    load_tokenizer,
)

__all__ = ["BUNDLED_MODEL", "choose_attention", "count_parameters", "gather_trainable_state_dict", "greedy_answer",
           "load_causal_lm", "load_config", "load_tokenizer"]
