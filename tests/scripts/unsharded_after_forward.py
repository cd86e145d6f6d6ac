"""Probe for tests/test_zero_math.py: bytes of parameters FSDP2 holds unsharded between forward and backward.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 \
        tests/scripts/unsharded_after_forward.py --output_dir D

Writes D/report.json (rank 0): unsharded_bytes (parameters still gathered after the forward), full_param_bytes
(the whole model) and never_resharded_bytes (the last block, the final norm and the output head: the groups
zero_utils.wrapping builds with reshard_after_forward=False).
"""

import argparse
import json
import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from zero_utils import runtime, wrapping
from zero_utils.model import BUNDLED_MODEL, load_causal_lm

parser = argparse.ArgumentParser()
parser.add_argument("--output_dir", required=True)
args = parser.parse_args()

accelerator = runtime.build_accelerator(per_device_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=1.0)
torch.manual_seed(0)
model = load_causal_lm(BUNDLED_MODEL, accelerator=accelerator)
sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
last_block = f"model.layers.{model.config.num_hidden_layers - 1}."
never_resharded = sum(b for n, b in sizes.items() if n.startswith((last_block, "model.norm.", "lm_head.")))
wrapping.shard_model(model, accelerator)
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)

logits = model(input_ids=torch.randint(0, 100, (1, 16)), use_cache=False).logits
# Between forward and backward: what is registered unsharded (a plain tensor, not a DTensor shard) is gathered.
unsharded = sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))
logits.float().mean().backward()
optimizer.step()
optimizer.zero_grad()
if accelerator.is_main_process:
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    report = {"unsharded_bytes": unsharded, "full_param_bytes": sum(sizes.values()),
              "never_resharded_bytes": never_resharded, "engine": runtime.engine_name(accelerator)}
    (Path(args.output_dir) / "report.json").write_text(json.dumps(report))
accelerator.wait_for_everyone()
accelerator.end_training()
# Gloo's worker threads can still hold tensors at interpreter shutdown and abort the process ("terminate called
# without an active exception", pytorch/pytorch#179291): this probe has written its report, so skip finalization.
os._exit(0)
