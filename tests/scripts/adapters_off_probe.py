"""One process, gloo, FSDP2 as recipes/llama_dpo_lora.py shards a LoRA policy (every block its own unit, the last
kept gathered after forward, then the root): two steps of the reference's no-grad forward inside
`zero_utils.preference.reference.adapters_off`, then the policy's forward and backward. Prints JSON: the logits
inside the context against the base model's (adapters nonzero, so they differ from the policy's), and how many of the
trainable parameters (the shards the optimizer holds) still require grad after each step. tests/test_dpo_lora.py."""

import json
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from zero_utils.assets import BUNDLED_MODEL
from zero_utils.preference.reference import adapters_off


class Unwrapped:  # accelerate's unwrap_model: an FSDP2 model is its own module
    @staticmethod
    def unwrap_model(model):
        return model


os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BUNDLED_MODEL))
ids = torch.arange(8).unsqueeze(0)
with torch.no_grad():
    base_logits = base(input_ids=ids).logits
model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))  # B != 0
layers = model.base_model.model.model.layers
for i, block in enumerate(layers):
    fully_shard(block, reshard_after_forward=i < len(layers) - 1)
fully_shard(model)
trainable = [p for p in model.parameters() if p.requires_grad]
found = {"trainable": len(trainable), "requiring_grad_after_step": [], "reference_equals_base": [],
         "policy_differs": []}
for _ in range(2):
    with torch.no_grad(), adapters_off(model, Unwrapped):
        reference = model(input_ids=ids).logits
    policy = model(input_ids=ids).logits
    policy.sum().backward()
    found["reference_equals_base"].append(torch.allclose(reference, base_logits, atol=1e-5))
    found["policy_differs"].append(not torch.allclose(policy.detach(), base_logits, atol=1e-3))
    found["requiring_grad_after_step"].append(sum(p.requires_grad for p in trainable))
print(json.dumps(found))
dist.destroy_process_group()
