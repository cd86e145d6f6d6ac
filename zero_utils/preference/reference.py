"""A preference loss's reference, one object whatever the mode (`build_reference`), so that a recipe never branches
on the mode after building it:

    --reference   what it is                                                  what training holds of it
    model         a frozen copy of the starting weights (train.frozen_model:  2 Psi / N sharded (ZeRO-3, FSDP2) or
                  held as the engine holds the policy), one more forward per  2 Psi as a replica, in bf16
                  micro-batch
    precomputed   the log-probs of every pair, computed by that frozen model  8 bytes a pair
                  in one pass before the policy exists (reference_logps)
    model (LoRA)  a LoRA policy's own forward with its adapters off           0 bytes
                  (`adapters_off`): the base the adapters are added to
    none          no reference (SimPO)                                        0 bytes

Two calls: `build_reference(mode, ...)` before the policy is built (the precomputed pass runs there, so the pass's
reference is freed before the policy exists), then `reference.start(policy, token_losses)` once the policy is prepared
(the held copy is built there, sharded like the policy; every mode checks that the policy starts from the
reference's weights). Then each mode answers the same calls: `pair_log_probs(micro, answers, average)` (the chosen and
rejected rows' answer log-probs, or (None, None)), `describe()`, `summary()` (summary.json's reference keys, digests
included) and `release()`. Engines: all.
"""

from __future__ import annotations

import contextlib

import torch

from zero_utils.preference.loss import answer_log_probs
from zero_utils.train.frozen_model import FrozenModel


def build_reference(mode: str, accelerator, engine, pairs, *, model: str, seed: int, loss_chunk_tokens: int,
                    lora: bool = False, revision: str | None = None, attn_implementation: str | None = None,
                    trust_remote_code: bool = False):
    """The reference of `--reference` `mode` ('model', 'precomputed' or 'none'; 'model' of a `lora` policy: its
    adapters off) for the policy `--model` `model` (its starting weights: a config-only model draws them after `seed`,
    the run's initial seed). Call it before the policy is built; every rank must call it."""
    from zero_utils.preference.reference_logps import PrecomputedReference

    def load() -> FrozenModel:
        return FrozenModel.load(model, accelerator, engine, loss_chunk_tokens=loss_chunk_tokens, seed=seed,
                                revision=revision, attn_implementation=attn_implementation or None,
                                trust_remote_code=trust_remote_code)

    if mode == "precomputed":
        return PrecomputedReference.prepare(accelerator, pairs, load, model=model, revision=revision,
                                            attn_implementation=attn_implementation)
    if mode == "model":
        return AdaptersOffReference(accelerator) if lora else HeldReference(accelerator, load)
    if mode == "none":
        return NoReference()
    raise ValueError(f"unknown reference mode {mode!r}")


class NoReference:
    """No reference (SimPO): log-probs (None, None), 0 bytes, no digests."""

    mode = "none"

    def start(self, policy, token_losses) -> None:
        pass

    def pair_log_probs(self, micro, answers: torch.Tensor, average: bool):
        return None, None

    def describe(self) -> str:
        return ""

    def summary(self) -> dict:
        return {"reference": self.mode, "reference_logps": None, "reference_state_bytes": None,
                "reference_state_bytes_expected": None, "reference_digest_start": None, "reference_digest_end": None}

    def release(self) -> None:
        pass


class HeldReference(NoReference):
    """`--reference model`: a frozen copy of the starting weights, built at `start` (after the policy's prepare:
    under ZeRO-3 it copies the resolved DeepSpeed config), held as the engine holds the policy."""

    mode = "model"

    def __init__(self, accelerator, load):
        self.accelerator, self._load, self.frozen, self.start_digest = accelerator, load, None, None

    def start(self, policy, token_losses) -> None:
        """Build the frozen copy and check that it equals the policy's starting weights (a bug otherwise:
        RuntimeError). Every rank must call it, before any update."""
        self.frozen = self._load()
        self.start_digest = self.frozen.check_equals(policy)

    def pair_log_probs(self, micro, answers: torch.Tensor, average: bool):
        return answer_log_probs(self.frozen.token_log_probs(micro), answers, average).chunk(2)

    def describe(self) -> str:
        return (f"reference: a frozen copy of the starting weights, held as the engine holds the policy: "
                f"{self.frozen.expected_state_bytes() / 1e6:.1f} MB per rank (expected), one more forward per "
                "micro-batch")

    def summary(self) -> dict:
        """Every rank must call it (it gathers the weights for the end digest)."""
        return {**super().summary(), "reference": self.mode,
                "reference_state_bytes": self.frozen.measured_state_bytes(self.accelerator),
                "reference_state_bytes_expected": self.frozen.expected_state_bytes(),
                "reference_digest_start": self.start_digest, "reference_digest_end": self.frozen.digest()}

    def release(self) -> None:
        if self.frozen is not None:
            self.frozen.release()


class AdaptersOffReference(NoReference):
    """A LoRA policy's reference: its own forward with the adapters off (`adapters_off`), computed before the
    policy's forward of the same micro-batch. 0 bytes: no second model."""

    mode = "model"

    def __init__(self, accelerator):
        self.accelerator, self.policy, self.token_losses = accelerator, None, None

    def start(self, policy, token_losses) -> None:
        self.policy, self.token_losses = policy, token_losses

    def pair_log_probs(self, micro, answers: torch.Tensor, average: bool):
        with torch.no_grad(), adapters_off(self.policy, self.accelerator):
            return answer_log_probs(-self.token_losses(self.policy, micro), answers, average).chunk(2)

    def describe(self) -> str:
        return "reference: the base, adapters off (no second model: 0 bytes), one more forward per micro-batch"

    def summary(self) -> dict:
        return {**super().summary(), "reference": self.mode, "reference_state_bytes": 0}


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
