"""`accelerate launch ... tests/scripts/clip_probe.py OUT.json`: zero_utils.train.optim.clip_gradients on the engine the
YAML names, against math.fsum. The bundled tiny Llama, parallelized and prepared as the recipes do, one forward and
backward of a different batch on each rank (the engine reduces the gradients); then every gradient is gathered whole
(`distributed.gathered`), its fp64 squares summed with `math.fsum` (the reference norm), and `clip_gradients` runs at a
`max_norm` of a quarter of that norm. The main process writes {"engine", "norm", "fsum_norm", "largest_scale_error"}:
the largest |clipped / unclipped - DeepSpeed's factor| over every gathered element."""

from __future__ import annotations

import json
import math
import sys

import torch


def main(out: str) -> None:
    from accelerate.utils import set_seed

    from zero_utils.assets import BUNDLED_MODEL
    from zero_utils.model.loading import load_causal_lm
    from zero_utils.model.parallelize import FSDPWrapping, after_prepare, parallelize
    from zero_utils.run.accelerator import build_accelerator
    from zero_utils.run.distributed import gathered
    from zero_utils.train.optim import build_adamw, clip_gradients

    accelerator, engine = build_accelerator(per_device_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=1.0)
    set_seed(0)
    model = load_causal_lm(BUNDLED_MODEL, accelerator=accelerator)
    parallelize(model, accelerator, engine, activation_checkpointing=False, fsdp=FSDPWrapping())
    optimizer = build_adamw(model, 1e-3, 0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    after_prepare(model, accelerator, engine, None)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    ids = torch.randint(0, 800, (2, 32), generator=generator).to(accelerator.device)
    accelerator.backward(model(input_ids=ids, labels=ids).loss)

    def whole_gradients():
        module = getattr(model, "module", model)
        return [gathered(p.grad).double().flatten() for p in module.parameters() if p.grad is not None]

    before = whole_gradients()
    fsum_norm = math.sqrt(math.fsum(math.fsum(g.square().tolist()) for g in before))
    max_norm = fsum_norm / 4
    norm = clip_gradients(accelerator, model, max_norm)
    factor = 1.0 / max(1.0, (fsum_norm + 1e-6) / max_norm)
    after = whole_gradients()
    error = max(float((a - b * factor).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(after, before,
                                                                                                    strict=True))
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump({"engine": engine.name, "norm": float(norm), "fsum_norm": fsum_norm,
                       "largest_scale_error": error}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
