"""Collective helpers every recipe needs: one reduction of a step's numbers, every rank's figures, work on the main
process (or each node's) alone while the others wait outside the collective timeout, one parameter gathered whole.

Every function here must be called by every rank at the same point, unless its docstring says otherwise.
It imports only zero_utils.run.errors and zero_utils.run.transfer.
"""

from __future__ import annotations

import os

import torch

from zero_utils.run.errors import UserError
from zero_utils.run.transfer import to_device


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
    """A (ranks x len(values)) float64 tensor of every rank's scalars, from one all-gather. The Python numbers
    among `values` travel to the device together, in one copy that does not block (`transfer.to_device`)."""
    numbers = iter(to_device(torch.tensor([float(v) for v in values if not isinstance(v, torch.Tensor)],
                                          dtype=torch.float64), accelerator.device).unbind())
    local = torch.stack([to_device(v.to(torch.float64), accelerator.device).reshape(())
                         if isinstance(v, torch.Tensor) else next(numbers) for v in values])
    return accelerator.gather(local).reshape(-1, len(values)) if accelerator.num_processes > 1 else local[None]


_main_process_works = [0]  # calls of run_on_main_process so far: the same count on every rank
_wait_limit_s = [0.0]  # --wait_limit_s (set_wait_limit): 0 = a rank waits as long as the work takes
WAIT_LINE_EVERY_S = 60.0  # a waiting node says what it waits for this often


def set_wait_limit(seconds: float) -> None:
    """Bound every wait of `run_on_main_process` to `seconds` (the --wait_limit_s flag; 0 = no limit): a rank that
    has waited longer stops with a `UserError` naming what it waited for. Call it once, on every rank, before the
    first wait (`accelerator.build_accelerator` does)."""
    _wait_limit_s[0] = float(seconds)


def run_on_main_process(accelerator, work, *, what: str = "the main process's work", poll_s: float = 1.0,
                        share_result: bool = False, per_node: bool = False):
    """Run `work()` on the main process alone while every other rank waits for it, for as long as it takes; with
    `per_node`, on each node's local main process while every rank waits until every node's has finished.

    Host-side work of one rank (data preparation: hours for a big corpus; reading a checkpoint; a download; the
    final export; a LoRA merge) must not be bounded by the collective timeout (`--collective_timeout_s`): a rank
    waiting in a barrier or broadcast for longer fails the job, and on several nodes a node that finishes its own
    share first would wait in the next collective for the slowest. Every rank therefore waits outside any
    collective, on every node, polling the process group's key-value store (the rendezvous TCPStore) every `poll_s`
    seconds at most; each node's local main process prints every WAIT_LINE_EVERY_S what it is waiting for (`what`,
    in words: "rank 0 reading the weights"), and a wait longer than `set_wait_limit`'s seconds (--wait_limit_s)
    stops that rank with a `UserError`. When every rank returns, all of them are past the work: the next
    collective waits on no one's work.

    An exception in `work()` reaches every rank of every node: a `UserError` with the same sentence, anything else
    as a `RuntimeError` naming it (the process that raised re-raises the original). The main process, which holds
    the store, raises only once every other rank has read the failure (at most `ACK_WAIT_S`): leaving first would
    turn the others' sentence into a dead peer. If a working process dies instead, the launcher ends every rank.
    Returns `work()`'s result where it ran and None elsewhere, or with `share_result` on every rank (each rank
    gets its own node's result with `per_node`; it must be JSON-serialisable and small: it travels through the
    store). Every rank must call it. Engines: all.
    """
    import json

    import torch.distributed as dist

    if accelerator.num_processes == 1 or not dist.is_initialized():
        return work()
    _main_process_works[0] += 1
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"zero_recipes/main_process_work/{attempt}/{_main_process_works[0]}"
    store = dist.distributed_c10d._get_default_store()
    nodes, node = (num_nodes(accelerator), node_index(accelerator)) if per_node else (1, 0)
    leader = accelerator.is_local_main_process if per_node else accelerator.is_main_process
    error = None
    if leader:
        try:
            result = work()
            outcome = {"result": result} if share_result else {}
        except UserError as exc:
            error, outcome = exc, {"user_error": str(exc)}
        except BaseException as exc:
            error, outcome = exc, {"failed": f"{type(exc).__name__}: {exc}"}
        store.set(f"{key}/node{node}", json.dumps(outcome))
        if error is not None:
            store.add(f"{key}/failures", 1)
        store.add(f"{key}/done", 1)
    elsewhere = "every node's local main process" if per_node else "the main process"
    _wait_for_count(store, f"{key}/done", nodes, accelerator, f"{what} ({elsewhere})", poll_s)
    if store.add(f"{key}/failures", 0):
        failed = next(o for o in (json.loads(store.get(f"{key}/node{n}")) for n in range(nodes))
                      if "user_error" in o or "failed" in o)
        store.add(f"{key}/read", 1)
        if accelerator.is_main_process:  # the store's host leaves last
            _wait_for_reads(store, f"{key}/read", accelerator.num_processes)
        if error is not None:
            raise error
        if "user_error" in failed:
            raise UserError(failed["user_error"])
        raise RuntimeError(f"{elsewhere} failed in work the other ranks waited for: {failed['failed']}")
    if leader:
        return result
    return json.loads(store.get(f"{key}/node{node}")).get("result") if share_result else None


ACK_WAIT_S = 60.0


def _wait_for_count(store, key: str, count: int, accelerator, what: str, poll_s: float) -> None:
    """Poll the store until its counter `key` reaches `count` (a read: `add` of 0), backing off from 10 ms to
    `poll_s`; a line every WAIT_LINE_EVERY_S from each node's local main process; `UserError` past the wait
    limit."""
    import time

    start = time.monotonic()
    next_line, wait_s, limit = start + WAIT_LINE_EVERY_S, 0.01, _wait_limit_s[0]
    while store.add(key, 0) < count:
        now = time.monotonic()
        if limit and now - start > limit:
            raise UserError(f"rank {accelerator.process_index} waited more than --wait_limit_s {limit:g} s for "
                            f"{what}; raise --wait_limit_s (0 = no limit) if that work needs longer.")
        if now >= next_line:
            next_line += WAIT_LINE_EVERY_S
            if accelerator.is_local_main_process:
                print(f"[rank {accelerator.process_index}] waiting {(now - start) / 60:.0f} min for {what}"
                      + (f" (--wait_limit_s {limit:g})" if limit else ""), flush=True)
        time.sleep(wait_s)
        wait_s = min(2 * wait_s, poll_s)


def _wait_for_reads(store, key: str, world_size: int) -> None:
    """Wait (at most ACK_WAIT_S) until every rank has counted itself in `key`."""
    import time

    deadline = time.monotonic() + ACK_WAIT_S
    while store.add(key, 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)


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


def num_nodes(accelerator) -> int:
    """Nodes (machines) of the job: processes / processes per node (accelerate launches the same number on each)."""
    return max(1, accelerator.num_processes // local_world_size(accelerator))


def node_index(accelerator) -> int:
    """This process's node, 0 .. num_nodes - 1 (torchrun numbers ranks node by node)."""
    return accelerator.process_index // local_world_size(accelerator)


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
