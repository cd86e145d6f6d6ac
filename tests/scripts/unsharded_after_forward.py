"""Probe for tests/test_zero_math.py and test_wrapping.py: what FSDP2 holds unsharded, for each wrapping choice.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 \
        tests/scripts/unsharded_after_forward.py --output_dir D [--reshard_last_block] [--no_embedding_group] \
        [--prefetch_blocks K]

Writes D/report.json (rank 0): unsharded_bytes (parameters still gathered between forward and backward),
full_param_bytes (the whole model), the bytes of the groups that matter (last block, final norm + output head,
input embedding), and the most decoder blocks held gathered at once at the start of a block's forward
(prefetching gathers the next blocks early). After training, an inference forward leaves groups gathered; it is
resharded once by the torch < 2.13 fallback (`wrapping.reshard_every_group`) and, after another inference
forward, once by `reset_iter_state`: "after_inference" holds, for each, the bytes still registered unsharded and
every parameter's FSDP2 sharded state.
"""

import argparse
import json
import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from zero_utils.assets import BUNDLED_MODEL
from zero_utils.model import wrapping
from zero_utils.model.loading import load_causal_lm
from zero_utils.run.accelerator import build_accelerator
from zero_utils.run.engine import Engine

parser = argparse.ArgumentParser()
parser.add_argument("--output_dir", required=True)
parser.add_argument("--reshard_last_block", action="store_true")
parser.add_argument("--no_embedding_group", action="store_true")
parser.add_argument("--prefetch_blocks", type=int, default=1)
args = parser.parse_args()

accelerator, _ = build_accelerator(per_device_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=1.0)
torch.manual_seed(0)
model = load_causal_lm(BUNDLED_MODEL, accelerator=accelerator)
sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
last_block = f"model.layers.{model.config.num_hidden_layers - 1}."
group_bytes = {
    "last_block_bytes": sum(b for n, b in sizes.items() if n.startswith(last_block)),
    "norm_and_head_bytes": sum(b for n, b in sizes.items() if n.startswith(("model.norm.", "lm_head."))),
    "embedding_bytes": sum(b for n, b in sizes.items() if n.startswith("model.embed_tokens.")),
}
wrapping.shard_model(model, accelerator, reshard_last_block=args.reshard_last_block,
                     embedding_group=not args.no_embedding_group, prefetch_blocks=args.prefetch_blocks)
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)

# FSDP2 registers its pre-forward hook first (prepend), so by the time this one runs the block and whatever it
# prefetches are gathered.
blocks = list(accelerator.unwrap_model(model).model.layers)
gathered_per_block_forward = []


def is_gathered(block) -> bool:
    """Registered unsharded, or its all-gather issued and not yet waited for (a prefetch: FSDP2 internals)."""
    group = block._get_fsdp_state()._fsdp_param_group
    return not isinstance(block.mlp.down_proj.weight, DTensor) or group._all_gather_result is not None


def count_gathered_blocks(module, inputs):
    gathered_per_block_forward.append(sum(is_gathered(b) for b in blocks))


for block in blocks:
    block.register_forward_pre_hook(count_gathered_blocks)

logits = model(input_ids=torch.randint(0, 100, (1, 16)), use_cache=False).logits
# Between forward and backward: what is registered unsharded (a plain tensor, not a DTensor shard) is gathered.
unsharded = sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))
logits.float().mean().backward()
optimizer.step()
optimizer.zero_grad()


def fsdp_state() -> dict:
    """Bytes registered unsharded, and each FSDPParam's sharded state (FSDP2 internals), in a fixed order."""
    from torch.distributed.fsdp import FSDPModule

    groups = {id(g): g for m in model.modules() if isinstance(m, FSDPModule)
              for g in m._get_fsdp_state()._fsdp_param_groups}
    return {"unsharded_bytes": sum(p.numel() * p.element_size() for p in model.parameters()
                                   if not isinstance(p, DTensor)),
            "states": [str(fp.sharded_state) for g in groups.values() for fp in g.fsdp_params]}


after_inference = {}
for name, reshard in (("reshard_every_group", wrapping.reshard_every_group),
                      ("reset_iter_state", lambda m: m.reset_iter_state())):
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (1, 16)), use_cache=False)
    after_inference[f"before_{name}"] = fsdp_state()
    reshard(model)
    after_inference[name] = fsdp_state()
if accelerator.is_main_process:
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    report = {"unsharded_bytes": unsharded, "full_param_bytes": sum(sizes.values()), **group_bytes,
              "max_blocks_gathered_in_forward": max(gathered_per_block_forward), "after_inference": after_inference,
              "engine": Engine.of(accelerator).name}
    (Path(args.output_dir) / "report.json").write_text(json.dumps(report))
accelerator.wait_for_everyone()
accelerator.end_training()
# Gloo's worker threads can still hold tensors at interpreter shutdown and abort the process ("terminate called
# without an active exception", pytorch/pytorch#179291): this probe has written its report, so skip finalization.
os._exit(0)
