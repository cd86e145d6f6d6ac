"""ZERO_RECIPES_HARNESS_ACCUMULATION_PROBE=1 (tests/scripts/harness.py): what each rank holds between the
micro-batches of a step, seen from outside the recipe.

After every micro-batch's forward and backward in the first two steps (the recipe's `meter.micro_batch()` block has
ended: before the step's update under DDP and FSDP2), it records, walking FSDP2's own objects:
    step, micro_batch                        1-based
    unsharded_grads                          FSDPParams holding a whole gradient while gradient sync is off: their
                                             `unsharded_accumulated_grad` (when the reduce dtype differs), or the
                                             unsharded parameter's own `.grad` (fp32: FSDP2 keeps it there)
    unsharded_grad_bytes                     their bytes
    partial_reduce_outputs                   param groups holding an HSDP partial sum (`_partial_reduce_output`:
                                             the all-reduce across replicas was skipped)
    groups_with_sharded_grads                param groups whose sharded parameters have a `.grad`
    model_state_bytes                        `zero_utils.train.measurement.measure_model_state_bytes` at that moment
`result()` is what the harness adds to summary.json as "accumulation_probe_per_rank".
"""

from __future__ import annotations

_state: dict = {"step": 0, "micro_batch": 0, "records": []}

MEASURED_STEPS = 2


def start_step() -> None:
    _state["step"] += 1
    _state["micro_batch"] = 0


def after_micro_batch(model, optimizer) -> None:
    from torch.distributed.fsdp import FSDPModule

    from zero_utils.train.measurement import measure_model_state_bytes

    _state["micro_batch"] += 1
    if _state["step"] > MEASURED_STEPS:
        return
    groups = list({id(group): group for module in model.modules() if isinstance(module, FSDPModule)
                   for group in module._get_fsdp_state()._fsdp_param_groups}.values())  # [norm, head] share one
    unsharded = []
    for fsdp_param in (p for group in groups for p in group.fsdp_params):
        whole = fsdp_param.unsharded_accumulated_grad
        if whole is None and hasattr(fsdp_param, "_unsharded_param"):
            whole = fsdp_param._unsharded_param.grad
        if whole is not None:
            unsharded.append(whole)
    _state["records"].append({
        "step": _state["step"], "micro_batch": _state["micro_batch"],
        "unsharded_grads": len(unsharded),
        "unsharded_grad_bytes": sum(t.numel() * t.element_size() for t in unsharded),
        "partial_reduce_outputs": sum(group._partial_reduce_output is not None for group in groups),
        "groups_with_sharded_grads": sum(any(p.sharded_param.grad is not None for p in group.fsdp_params)
                                         for group in groups),
        "param_groups": len(groups),
        "model_state_bytes": measure_model_state_bytes(model, optimizer)["total"],
    })


def result() -> list[dict]:
    return _state["records"]
