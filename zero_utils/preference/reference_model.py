"""The frozen reference model of a preference loss (DPO, IPO), held the way the engine holds the policy:

    engine            what each rank holds of the reference (compute dtype: bf16 under bf16 mixed precision)
    FSDP2 (both)      1/N, sharded block by block like the policy (wrapping.shard_frozen_model), every unit
                      resharded after its forward: at most two units gathered at once, never the whole model
    ZeRO-3            1/N, partitioned by DeepSpeed: an engine without an optimizer (as trl's `prepare_deepspeed`)
    DDP, ZeRO-1/2     a whole replica (these engines keep whole parameters anyway)
No gradients, no optimizer state: 2 Psi / N bytes sharded in bf16 (4 Psi / N in fp32), 2 Psi or 4 Psi as a
replica (`expected_state_bytes`; `state_bytes` measures what this rank holds).

A LoRA policy needs no second model (recipes/llama_dpo_lora.py): its reference is its own forward with the adapters
off (`adapters_off`), the base weights the adapters are added to: 0 bytes more under every engine.

The frozen copy is built from the same `--model` as the policy, after the same seed (a config-only model draws the same
weights), so it equals the policy's initial weights; `digest` (SHA-256 of its gathered weights) lets the recipe
check that at the start and that it never changes. A resume builds it again the same way: it is never saved.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from zero_utils.data.sft_examples import IGNORE_INDEX
from zero_utils.model.deepspeed_setup import size_deepspeed_buckets
from zero_utils.model.wrapping import reshard_after_inference, shard_frozen_model
from zero_utils.preference.loss import answer_log_probs
from zero_utils.run.distributed import max_over_ranks
from zero_utils.run.engine import Engine
from zero_utils.train.evidence import held_here, weights_digest
from zero_utils.train.token_loss import TokenLosses

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype forwards compute in under accelerate's `mixed_precision` ('no' -> fp32)."""
    return _DTYPES.get(mixed_precision, torch.float32)


class ReferenceModel:
    """A frozen model for forwards only: `reference.answer_log_probs(micro, answers, average)` runs `reference.module`
    like the policy (every rank, its own micro-batch) under `torch.no_grad()`, its head and loss over chunks of
    `loss_chunk_tokens` tokens (zero_utils.train.token_loss). Build it with `ReferenceModel.hold(model, accelerator,
    engine, loss_chunk_tokens)`; under ZeRO-3 it copies the resolved DeepSpeed config, so after an `accelerator.prepare`
    of the DeepSpeed plugin's kind (the policy's, or none yet: accelerate fills it at its first prepare). Engines:
    all."""

    def __init__(self, module, engine: Engine, dtype: torch.dtype, world_size: int, losses: TokenLosses):
        self.module, self.engine, self.dtype, self.world_size = module, engine, dtype, world_size
        self.losses = losses

    @classmethod
    def hold(cls, model: torch.nn.Module, accelerator, engine: Engine, loss_chunk_tokens: int) -> ReferenceModel:
        """Hold `model` (freshly built, fp32, on CPU) as the engine holds the policy (module table)."""
        dtype = compute_dtype(accelerator.mixed_precision)
        model.eval().requires_grad_(False)
        if engine.is_fsdp2:  # [FSDP2]
            module = shard_frozen_model(model, accelerator, dtype)
        elif engine.is_deepspeed and engine.zero_stage == 3:  # [ZeRO-3]
            import deepspeed

            config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
            for key in ("optimizer", "scheduler"):
                config.pop(key, None)
            size_deepspeed_buckets(accelerator, model, config)  # "auto" sizes, when no policy was prepared before
            module, *_ = deepspeed.initialize(model=model, config=config)
            module.eval()
        else:  # DDP, ZeRO-1/2, one process: a replica on the device
            module = model.to(device=accelerator.device, dtype=dtype)
        losses = TokenLosses(module, loss_chunk_tokens, IGNORE_INDEX, accelerator)
        return cls(module, engine, dtype, accelerator.num_processes, losses)

    def answer_log_probs(self, micro, answers: torch.Tensor, average: bool) -> torch.Tensor:
        """Each row's answer log-probability under the reference (rows,), summed or averaged over `answers` (the
        rows' answer-token mask) as `loss.answer_log_probs`; no gradients. Every rank must call it."""
        with torch.no_grad():
            return answer_log_probs(-self.losses(self.module, micro), answers, average)

    def parameters(self):
        return getattr(self.module, "module", self.module).parameters()

    def num_params(self) -> int:
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.parameters())

    def state_bytes(self) -> int:
        """Bytes of reference parameters this rank holds (its shards, its partition or the whole replica)."""
        return sum(held_here(p).numel() * held_here(p).element_size() for p in self.parameters())

    def expected_state_bytes(self) -> int:
        """The formula: compute-dtype bytes x parameters, divided by the world size where the engine shards."""
        total = self.num_params() * torch.tensor([], dtype=self.dtype).element_size()
        return -(-total // self.world_size) if self.engine.shards_params else total

    def describe(self) -> str:
        """One line for the start of a run: which reference, and what it costs."""
        return (f"reference: a frozen copy of the starting weights, held as the engine holds the policy: "
                f"{self.expected_state_bytes() / 1e6:.1f} MB per rank (expected), one more forward per micro-batch")

    def measured_state_bytes(self, accelerator) -> int:
        """`state_bytes`, the maximum over ranks (one small collective: every rank must call it)."""
        return max_over_ranks(accelerator, {"bytes": self.state_bytes()})["bytes"]

    def check_equals(self, policy) -> str:
        """The reference's digest, after checking that it equals the policy's weights in the compute dtype (call it
        before any update: the reference must start where the policy does). A mismatch is a bug: RuntimeError."""
        digest = self.digest()
        if weights_digest(policy, self.dtype) != digest:
            raise RuntimeError("the reference model's weights differ from the policy's starting weights")
        return digest

    def digest(self) -> str:
        """SHA-256 of the gathered weights (every rank must call it; parameters gathered one at a time)."""
        return weights_digest(self.module)

    def release(self) -> None:
        """Drop what the engine keeps of the reference outside this object, so that dropping the object frees its
        weights (call it when no forward is running). [ZeRO-3] DeepSpeed's parameter offload appends the engine's
        top module to a module-level stack (`deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK`) and never
        takes it off, and its parameter coordinator memoises which parameters to release in a class-level
        `functools.lru_cache` keyed by the coordinator and the submodules, never cleared: either kept the reference's
        module, partitions and engine alive for the whole run (the cache is a memo: the policy's entries are
        computed again)."""
        if self.engine.is_deepspeed and self.engine.zero_stage == 3:
            from deepspeed.runtime.zero import parameter_offload
            from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

            stack = parameter_offload.FWD_MODULE_STACK
            stack[:] = [m for m in stack if m is not self.module.module]
            memo = getattr(PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__params_to_release", None)
            for fn in (memo, *(cell.cell_contents for cell in getattr(memo, "__closure__", None) or ())):
                if hasattr(fn, "cache_clear"):  # under DeepSpeed's NVTX wrapper, which keeps no __wrapped__
                    fn.cache_clear()

    def free_gathered(self) -> None:
        """[FSDP2] Reshard whatever the last forwards left gathered (a no-op elsewhere)."""
        reshard_after_inference(self.module)


@contextlib.contextmanager
def adapters_off(model, accelerator):
    """The reference of a PEFT LoRA policy: inside this context, `model` (the prepared policy, called as in training,
    under `torch.no_grad()`) computes the base model's forward, adapters off (PEFT's `disable_adapter`). It runs
    through the engine's own wrapper: [FSDP2] the policy's root and units gather the base weights as for the policy's
    forward; [ZeRO-3] DeepSpeed gathers them; [DDP] no gradient hooks are armed under no_grad. Call it before the
    policy's forward of the same micro-batch, and reshard nothing in between: [FSDP2] the units kept gathered for
    backward serve the policy's forward, and a reshard mid-step would drop what accumulation holds.

    PEFT switches the adapters' `requires_grad` off and on again through the modules' attributes; under FSDP2 a unit
    still gathered on exit (the last block, the root) has its gathered copy there, so its shards, the parameters the
    optimizer steps and the adapter export selects, would stay frozen. Every parameter that required grad on entry
    requires it again on exit. Engines: all."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:
        with accelerator.unwrap_model(model).disable_adapter():
            yield
    finally:
        for param in trainable:
            param.requires_grad_(True)
