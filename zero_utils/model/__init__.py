"""The model, and parallelism applied to it from outside: loading a causal LM and its tokenizer (loading), QLoRA's
4-bit config (qlora), DeepSpeed's own steps around accelerate (deepspeed_setup), FSDP2 block-by-block wrapping
(wrapping), activation offloading (activation_offload) and the one place they are applied (parallelize)."""
