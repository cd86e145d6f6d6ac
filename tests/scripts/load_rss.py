"""Probe for tests/test_wrapping.py: how much CPU RAM each rank needs to load a pretrained model.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 \
        tests/scripts/load_rss.py --model DIR --output_dir D [--naive]

Loads the model the way the recipes do (`model.loading.load_causal_lm`, then `wrapping.shard_model` under FSDP2) and
writes D/report.json (rank 0): per rank, the rise of the peak RSS (VmHWM, reset just before loading) over the RSS
just before loading, the model's fp32 bytes, and whether the loaded weights equal the file. `--naive` switches
rank-0 loading off (every rank reads the whole checkpoint), the baseline the bound must beat.
Under a DeepSpeed ZeRO-3 YAML the model is built partitioned (`zero3_init_flag`) and no shard_model runs (a naive
load there is lazy: safetensors pages are only read when `prepare` partitions them, so it has no comparable point).
"""

import argparse
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import gather_object
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from zero_utils.assets import BUNDLED_MODEL
from zero_utils.model import wrapping
from zero_utils.model.loading import count_parameters, load_causal_lm
from zero_utils.run.accelerator import build_accelerator
from zero_utils.run.engine import Engine


def proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--output_dir", required=True)
parser.add_argument("--naive", action="store_true")
args = parser.parse_args()

accelerator, _ = build_accelerator(per_device_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=1.0)
engine = Engine.of(accelerator)
fsdp = engine.is_fsdp2
if args.naive:
    accelerator.state.fsdp_plugin.cpu_ram_efficient_loading = False
# Warm-up on the bundled tiny model: imports, allocator arenas and communication buffers are paid before measuring.
torch.manual_seed(0)
warm = load_causal_lm(BUNDLED_MODEL, accelerator=accelerator)
if fsdp:
    wrapping.shard_model(warm, accelerator)
del warm
gc.collect()
accelerator.wait_for_everyone()

Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux, proc(5))
rss_before = proc_status_bytes("VmRSS")
model = load_causal_lm(args.model, accelerator=accelerator)
if fsdp:
    wrapping.shard_model(model, accelerator)
peak_rise_bytes = proc_status_bytes("VmHWM") - rss_before
accelerator.wait_for_everyone()

# The weights each rank now holds must be the file's.
file_state = load_file(Path(args.model) / "model.safetensors") if accelerator.is_main_process else {}
matches = True
if fsdp:
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if accelerator.is_main_process:
        matches = all(torch.equal(full[k], v) for k, v in file_state.items()) and set(full) >= set(file_state)
else:  # [ZeRO-3] gather parameter by parameter
    import deepspeed

    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            if accelerator.is_main_process and name in file_state:
                matches &= torch.equal(param.data, file_state[name])
per_rank = gather_object([{"rank": accelerator.process_index, "peak_rss_rise_bytes": peak_rise_bytes,
                           "rss_before_bytes": rss_before}])
if accelerator.is_main_process:
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    report = {"engine": engine.name, "world_size": accelerator.num_processes, "naive": args.naive,
              "model_bytes": count_parameters(model) * 4, "weights_match_file": bool(matches), "ranks": per_rank}
    (Path(args.output_dir) / "report.json").write_text(json.dumps(report, indent=1))
accelerator.wait_for_everyone()
dist.destroy_process_group()
os._exit(0)  # the report is written; skip interpreter finalization (gloo shutdown abort, pytorch#179291)
