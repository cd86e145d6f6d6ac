"""Collective helpers every recipe needs: one reduction of a step's numbers, every rank's figures, work on the main
process alone (outside the collective timeout), one parameter gathered whole.

Every function here must be called by every rank at the same point, unless its docstring says otherwise.
This module is a bottom layer: it imports only zero_utils.errors.
"""

from __future__ import annotations

import os

import torch

from zero_utils.errors import UserError


def max_over_ranks(accelerator, values: dict[str, int]) -> dict[str, int]:
    """Element-wise maximum over all ranks of a dict of integers (bytes), in one small collective
    (`reduce_step_values`; float64 holds integers exactly up to 2**53)."""
    return {k: int(v) for k, v in reduce_step_values(accelerator, sums={}, maxes=values).items()}


def per_rank(accelerator, values: dict[str, int]) -> dict[str, list[int]]:
    """Every rank's value of each integer in `values` (bytes), in one small collective: {name: [rank 0's, rank 1's,
    ...]} on every rank (float64 holds integers exactly up to 2**53). Engines: all."""
    every_rank = _every_rank(accelerator, list(values.values()))
    return {k: [int(v) for v in column] for k, column in zip(values, every_rank.T.tolist(), strict=True)}


def _every_rank(accelerator, values: list) -> torch.Tensor:
    """A (ranks x len(values)) float64 tensor of every rank's scalars, from one all-gather."""
    local = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(accelerator.device).reshape(()) for v in values])
    return accelerator.gather(local).reshape(-1, len(values)) if accelerator.num_processes > 1 else local[None]


_main_process_works = [0]  # calls of run_on_main_process so far: the same count on every rank


def run_on_main_process(accelerator, work, *, poll_s: float = 1.0, share_result: bool = False,
                        per_node: bool = False):
    """Run `work()` on the main process alone while every other rank waits for it, for as long as it takes; with
    `per_node`, on each node's local main process while the other ranks of its node wait for it.

    Host-side work of one rank (data preparation: hours for a big corpus; the final export; a LoRA merge) must not
    be bounded by the collective timeout (`--collective_timeout_s`): a rank waiting in a barrier or broadcast for
    longer fails the job. The others therefore wait outside any collective, polling a key in the process group's
    key-value store (the rendezvous TCPStore) every `poll_s` seconds at most. An exception on the main process
    reaches every rank: a `UserError` with the same sentence, anything else as a `RuntimeError` naming it (the
    main process re-raises the original), and the main process raises only once every other rank has read it (at
    most `ACK_WAIT_S`): the store lives in the main process, so leaving first would turn the others' sentence into
    a dead peer. If the main process dies instead, the launcher ends every rank.
    Returns `work()`'s result on the main process and None on the others, or with `share_result` on every rank (it
    must then be JSON-serialisable and small: it travels through the store). Every rank must call it. Engines: all.
    """
    import json
    import time

    import torch.distributed as dist

    if accelerator.num_processes == 1 or not dist.is_initialized():
        return work()
    _main_process_works[0] += 1
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"zero_recipes/main_process_work/{attempt}/{_main_process_works[0]}"
    leader, waiting = accelerator.is_main_process, accelerator.num_processes
    if per_node:  # the node is named by its local main process's global rank
        key += f"/node{accelerator.process_index - accelerator.local_process_index}"
        leader, waiting = accelerator.is_local_main_process, local_world_size(accelerator)
    store = dist.distributed_c10d._get_default_store()
    if leader:
        try:
            result = work()
        except UserError as exc:
            _tell_and_wait(store, key, {"user_error": str(exc)}, waiting)
            raise
        except BaseException as exc:
            _tell_and_wait(store, key, {"failed": f"{type(exc).__name__}: {exc}"}, waiting)
            raise
        store.set(key, json.dumps({"result": result} if share_result else {}))
        return result
    wait_s = 0.01
    while not store.check([key]):
        time.sleep(wait_s)
        wait_s = min(2 * wait_s, poll_s)
    outcome = json.loads(store.get(key))
    if "user_error" in outcome or "failed" in outcome:
        store.add(f"{key}/read", 1)  # the main process may now leave
    if "user_error" in outcome:
        raise UserError(outcome["user_error"])
    if "failed" in outcome:
        raise RuntimeError(f"the main process failed in work the other ranks waited for: {outcome['failed']}")
    return outcome.get("result")


ACK_WAIT_S = 60.0


def count_over_ranks(accelerator, flag: bool) -> int:
    """How many ranks pass `flag` True: one small all-reduce (torch.distributed, so a bare accelerate `PartialState`
    will do); 0 or 1 in a single process. Every rank must call it."""
    import torch.distributed as dist

    if accelerator.num_processes == 1 or not dist.is_initialized():
        return int(flag)
    count = torch.tensor([int(flag)], device=accelerator.device)
    dist.all_reduce(count)
    return int(count.item())


def local_world_size(accelerator) -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, else all of them (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))


def _tell_and_wait(store, key: str, outcome: dict, world_size: int) -> None:
    """Publish a failure under `key`, then wait (at most ACK_WAIT_S) until every other rank has read it."""
    import json
    import time

    store.set(key, json.dumps(outcome))
    deadline = time.monotonic() + ACK_WAIT_S
    while store.add(f"{key}/read", 0) < world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.01)


def reduce_step_values(accelerator, *, sums: dict[str, torch.Tensor | float],
                       maxes: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Sum `sums` and take the maximum of `maxes` over all ranks in one small collective, and bring the results to
    the host in one sync: a training step's bookkeeping (loss, memory peaks, a stop flag) costs one all-gather of
    a (ranks x values) float64 tensor instead of one all-reduce and one `.item()` each. Values are scalars
    (0-dim tensors on any device, or Python numbers). Returns {name: float} for every key of both dicts."""
    keys = [*sums, *maxes]
    every_rank = _every_rank(accelerator, [*sums.values(), *maxes.values()])
    reduced = torch.cat([every_rank[:, :len(sums)].sum(0), every_rank[:, len(sums):].amax(0)])
    return dict(zip(keys, reduced.tolist(), strict=True))  # the one host sync


def local_scalar(value) -> torch.Tensor | float:
    """A scalar for `reduce_step_values` from what engines return: FSDP2's `clip_grad_norm_` gives a replicated
    DTensor (its local value is the full norm), DeepSpeed may give a float or None (-> nan)."""
    if value is None:
        return float("nan")
    if hasattr(value, "full_tensor"):  # [FSDP2]
        return value.full_tensor()
    return value


def gathered(param: torch.Tensor) -> torch.Tensor:
    """The whole of one parameter on this rank's CPU, however the engine holds it: a ZeRO-3 partition is gathered
    (`GatheredParameters`), an FSDP2 DTensor shard is all-gathered (`full_tensor`), a whole tensor is copied as is.
    A collective for sharded parameters: every rank must call it for the same parameters in the same order.
    Engines: all."""
    from torch.distributed.tensor import DTensor

    if hasattr(param, "ds_id"):  # [ZeRO-3] partitioned parameter
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().cpu().clone()
    if isinstance(param, DTensor):  # [FSDP2] sharded parameter
        return param.full_tensor().detach().cpu()
    return param.detach().cpu()
