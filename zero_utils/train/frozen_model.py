"""A frozen model for forwards only, held the way the engine holds the policy: DPO's reference, a distillation
teacher, an RL reference or reward model. Built from a model id or folder that may differ from the policy's (a larger
teacher), which must then share the policy's vocabulary.

    engine            what each rank holds (compute dtype: bf16 under bf16 mixed precision)
    FSDP2 (both)      1/N, sharded block by block like the policy (wrapping.shard_frozen_model), every unit
                      resharded after its forward: at most two units gathered at once, never the whole model
    ZeRO-3            1/N, partitioned by DeepSpeed: an engine without an optimizer (as trl's `prepare_deepspeed`)
    DDP, ZeRO-1/2     a whole replica (these engines keep whole parameters anyway)
No gradients, no optimizer state: 2 Psi / N bytes sharded in bf16 (4 Psi / N in fp32), 2 Psi or 4 Psi as a replica
(`expected_state_bytes`, the formula `formulas.model_states.reference_model_bytes` gives; `state_bytes` measures
what this rank holds). Its head and loss run over chunks of tokens as the policy's (zero_utils.train.token_loss).
`digest` (SHA-256 of its gathered weights) shows it never changes; `release` lets dropping it free its weights.
Engines: all.
"""

from __future__ import annotations

import copy

import torch

from zero_utils.data.sft_examples import IGNORE_INDEX
from zero_utils.model import loading
from zero_utils.model.deepspeed_setup import size_deepspeed_buckets
from zero_utils.model.wrapping import reshard_after_inference, shard_frozen_model
from zero_utils.run.distributed import max_over_ranks
from zero_utils.run.engine import Engine
from zero_utils.run.errors import UserError
from zero_utils.train.evidence import held_here, weights_digest
from zero_utils.train.token_loss import TokenLosses

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype forwards compute in under accelerate's `mixed_precision` ('no' -> fp32)."""
    return _DTYPES.get(mixed_precision, torch.float32)


def check_same_vocabulary(frozen_config, policy_config, *, flag: str, name: str, policy_name: str) -> None:
    """A frozen model scores the policy's tokens: its vocabulary (`config.vocab_size`) must be the policy's, else
    one `UserError` naming both sizes."""
    if frozen_config.vocab_size != policy_config.vocab_size:
        raise UserError(f"{flag} {name!r} has a vocabulary of {frozen_config.vocab_size} tokens and the policy "
                        f"--model {policy_name!r} one of {policy_config.vocab_size}; a frozen model must share the "
                        "policy's tokenizer: pick one of the same model family.")


class FrozenModel:
    """`frozen.token_log_probs(micro)`: each token's log-probability of its label under the frozen model (rows x
    seq_len; 0 where the label is ignored), every rank its own micro-batch, under `torch.no_grad()`. Build it with
    `FrozenModel.load(...)` (a model id or folder) or `FrozenModel.hold(model, ...)` (a model already built). Under
    ZeRO-3 it copies the resolved DeepSpeed config, so after an `accelerator.prepare` of the DeepSpeed plugin's kind
    (the policy's, or none yet: accelerate fills it at its first prepare). Engines: all."""

    def __init__(self, module, engine: Engine, dtype: torch.dtype, world_size: int, losses: TokenLosses):
        self.module, self.engine, self.dtype, self.world_size = module, engine, dtype, world_size
        self.losses = losses

    @classmethod
    def hold(cls, model: torch.nn.Module, accelerator, engine: Engine, loss_chunk_tokens: int) -> FrozenModel:
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

    @classmethod
    def load(cls, name_or_path: str, accelerator, engine: Engine, *, loss_chunk_tokens: int, seed: int,
             policy_config=None, policy_name: str = "", flag: str = "--model", revision: str | None = None,
             attn_implementation: str | None = None, trust_remote_code: bool = False) -> FrozenModel:
        """Load `name_or_path` (a Hub id or folder; a config-only folder draws its weights after `seed`, as the
        policy's do) and hold it. With `policy_config`, its vocabulary must be the policy's (`check_same_vocabulary`,
        `flag` naming the setting in the sentence). Every rank must call it."""
        from accelerate.utils import set_seed

        if policy_config is not None:
            config = loading.load_config(name_or_path, trust_remote_code, revision, accelerator=accelerator)
            check_same_vocabulary(config, policy_config, flag=flag, name=name_or_path, policy_name=policy_name)
        set_seed(seed)
        model = loading.load_causal_lm(name_or_path, accelerator=accelerator, attn_implementation=attn_implementation,
                                       trust_remote_code=trust_remote_code, revision=revision)
        return cls.hold(model, accelerator, engine, loss_chunk_tokens)

    def token_log_probs(self, micro) -> torch.Tensor:
        """(rows, seq_len) float32: each token's log-probability of its label, 0 where it is ignored; no gradients.
        Every rank must call it (the engine gathers)."""
        with torch.no_grad():
            return -self.losses(self.module, micro)

    def parameters(self):
        return getattr(self.module, "module", self.module).parameters()

    def num_params(self) -> int:
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.parameters())

    def state_bytes(self) -> int:
        """Bytes of parameters this rank holds (its shards, its partition or the whole replica)."""
        return sum(held_here(p).numel() * held_here(p).element_size() for p in self.parameters())

    def expected_state_bytes(self) -> int:
        """The formula: compute-dtype bytes x parameters, divided by the world size where the engine shards."""
        total = self.num_params() * torch.tensor([], dtype=self.dtype).element_size()
        return -(-total // self.world_size) if self.engine.shards_params else total

    def measured_state_bytes(self, accelerator) -> int:
        """`state_bytes`, the maximum over ranks (one small collective: every rank must call it)."""
        return max_over_ranks(accelerator, {"bytes": self.state_bytes()})["bytes"]

    def digest(self) -> str:
        """SHA-256 of the gathered weights (every rank must call it; parameters gathered one at a time)."""
        return weights_digest(self.module)

    def check_equals(self, model) -> str:
        """This model's digest, after checking that `model`'s weights, in this model's compute dtype, are the same
        (a reference must start where the policy does: a mismatch is a bug, RuntimeError). Every rank must call it."""
        digest = self.digest()
        if weights_digest(model, self.dtype) != digest:
            raise RuntimeError("the frozen model's weights differ from the policy's starting weights")
        return digest

    def release(self) -> None:
        """Drop what the engine keeps of this model outside the object, so that dropping the object frees its
        weights (call it when no forward is running). [ZeRO-3] DeepSpeed's parameter offload appends the engine's
        top module to a module-level stack (`deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK`) and never
        takes it off, and its parameter coordinator memoises which parameters to release in a class-level
        `functools.lru_cache` keyed by the coordinator and the submodules, never cleared: either kept the module,
        partitions and engine alive for the whole run (the cache is a memo: the policy's entries are computed
        again)."""
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
