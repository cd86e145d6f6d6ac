"""A preference loss's reference, precomputed (recipes/llama_dpo.py --reference precomputed): the frozen reference
model's log-probabilities of every train and eval pair computed in one pass before training, kept with the prepared
pairs, and the reference freed before the policy is built, so training holds the policy alone.

The pass: the reference held as zero_utils.train.frozen_model holds it (sharded under FSDP2 and ZeRO-3, a
replica otherwise), its head and loss over chunks of tokens, no gradients; the pairs strided over the ranks in
micro-batches of --per_device_batch_size (`PreferenceData.strided_batches`); each row's summed answer log-probability
gathered to every rank. The file: `reference_logps-<key>.safetensors` in the pairs' folder
(zero_utils.preference.pair_rows), tensors `train` (pairs, 2) and `eval` float32 (column 0 the chosen answer's, 1
the rejected one's), one row per pair in the pairs' order, written by each node's local main process. The key hashes
what the log-probs depend on beyond the pairs (whose folder already keys the data, tokenizer and --seq_len): the
reference's weights (`model.loading.weights_identity`: a Hub commit, or a local folder's weight files with sizes and
modification times; for a config-only model, the SHA-256 of its built weights), the compute dtype, the attention
implementation and LOGPS_VERSION. A relaunch or a resume with the same key reads the file and builds no reference at all
(a config-only model is built to be digested, then freed).

The file also stores the digest of the reference's weights in the compute dtype: `start(policy, ...)` checks the
policy starts from them, as the held reference's check does. Averaged log-probs (ipo) are the stored sums divided by
each row's answer tokens, as `loss.answer_log_probs` does. Engines: all.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from zero_utils.model.loading import weights_identity
from zero_utils.preference.loss import answer_log_probs
from zero_utils.run.distributed import count_over_ranks, max_over_ranks
from zero_utils.train.evidence import weights_digest
from zero_utils.train.frozen_model import FrozenModel, compute_dtype

LOGPS_VERSION = 1


class PrecomputedReference:
    """The reference's answer log-probs of every pair, read from the micro-batches (`PairMicroBatch.reference_logps`,
    attached to the pairs by `prepare`); the calls of every reference mode (zero_utils.preference.reference). Engines:
    all."""

    mode = "precomputed"

    def __init__(self, digest: str, dtype: torch.dtype, path: Path, pairs: int, *, reused: bool, seconds: float,
                 pass_state_bytes: int, built: bool, accelerator=None):
        self._digest, self.dtype, self.path, self.pairs, self.reused = digest, dtype, path, pairs, reused
        self.built = built  # whether a reference model was built (on reuse: only a config-only one, to digest it)
        self.seconds, self.pass_state_bytes = seconds, pass_state_bytes
        self.start_digest, self.accelerator = None, accelerator

    @classmethod
    def prepare(cls, accelerator, pairs, build_reference, *, model: str, revision: str | None,
                attn_implementation: str | None) -> PrecomputedReference:
        """Read the log-probs of `pairs` (a `PreferenceData`) for the reference `--model` names, or compute them in
        one pass of `build_reference()` (-> a held `FrozenModel`, zero_utils.preference.reference's loader) and write
        them; attach them to `pairs`. The reference is freed before this returns. Call it before the policy is built.
        Every rank must call it."""
        dtype = compute_dtype(accelerator.mixed_precision)
        started, reference, identity = time.perf_counter(), None, weights_identity(model, revision)
        built = identity is None
        if identity is None:  # a config-only model: its weights are drawn from the seed, so digest them
            reference = build_reference()
            identity = f"weights:{reference.digest()}"
        fields = {"weights": identity, "dtype": str(dtype), "attn_implementation": attn_implementation or "default",
                  "version": LOGPS_VERSION}
        key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]
        path = Path(pairs.info["folder"]) / f"reference_logps-{key}.safetensors"
        reused = count_over_ranks(accelerator, not path.is_file()) == 0
        pass_state_bytes = 0
        if reused:
            train, evaluation, digest = _read(path)
        else:
            reference = reference or build_reference()
            pass_state_bytes = reference.measured_state_bytes(accelerator)
            train = _log_probs(reference, pairs, "train", accelerator)
            evaluation = _log_probs(reference, pairs, "eval", accelerator) if pairs.has_eval else None
            digest = reference.digest()
            if accelerator.is_local_main_process:
                _write(path, train, evaluation, {**fields, "digest": digest})
        if reference is not None:
            reference.release()
        del reference
        gc.collect()  # the reference's module, engine and hooks form cycles: free them now, not at some later gc
        pairs.attach_reference_logps(train, evaluation)
        return cls(digest, dtype, path, len(train) + (len(evaluation) if evaluation is not None else 0), reused=reused,
                   seconds=time.perf_counter() - started, pass_state_bytes=pass_state_bytes, built=built or not reused,
                   accelerator=accelerator)

    def start(self, policy, token_losses) -> None:
        """Check that the policy starts from the weights the log-probs were computed with (every rank must call it,
        before any update: it gathers). A mismatch is a `RuntimeError`."""
        if weights_digest(policy, self.dtype) != self._digest:
            raise RuntimeError(f"the precomputed reference log-probs in {self.path} were computed from other weights "
                               "than the policy's starting weights")
        self.start_digest = self._digest

    def pair_log_probs(self, micro, answers: torch.Tensor, average: bool):
        """The chosen and rejected rows' answer log-probabilities: the stored sums, or with `average` their mean over
        each row's answer tokens (`answers`: the rows' answer-token mask), as `loss.answer_log_probs`."""
        logps = micro.reference_logps / answers.sum(-1).clamp(min=1) if average else micro.reference_logps
        return logps.chunk(2)

    def digest(self) -> str:
        return self._digest

    def expected_state_bytes(self) -> int:
        """What training holds of the reference: its log-probs, 2 float32 per pair (the model is freed)."""
        return 8 * self.pairs

    def measured_state_bytes(self, accelerator) -> int:
        """The log-probs' bytes this rank holds, the maximum over ranks (every rank must call it)."""
        return max_over_ranks(accelerator, {"bytes": 8 * self.pairs})["bytes"]

    def logps_summary(self) -> dict:
        """Where the log-probs are, whether they were reused, the pass's seconds and the bytes per rank the reference
        held during it (0 when reused)."""
        return {"path": str(self.path), "pairs": self.pairs, "reused": self.reused, "seconds": self.seconds,
                "pass_state_bytes": self.pass_state_bytes, "reference_built": self.built}

    def summary(self) -> dict:
        """summary.json's reference keys (every rank must call it)."""
        return {"reference": self.mode, "reference_logps": self.logps_summary(),
                "reference_state_bytes": self.measured_state_bytes(self.accelerator),
                "reference_state_bytes_expected": self.expected_state_bytes(),
                "reference_digest_start": self.start_digest, "reference_digest_end": self._digest}

    def release(self) -> None:
        pass

    def describe(self) -> str:
        """One line for the start of a run: which reference, and what it cost."""
        if self.reused:
            built = ("the config-only model built to digest its weights, then freed" if self.built
                     else "no reference model built")
            return (f"reference: precomputed log-probs of {self.pairs} pairs reused from {self.path} ({built}: 0 bytes "
                    "during training)")
        return (f"reference: log-probs of {self.pairs} pairs precomputed in {self.seconds:.1f} s by the reference "
                f"({self.pass_state_bytes / 1e6:.1f} MB per rank during the pass, freed before the policy was built: "
                f"0 bytes during training), kept in {self.path}")


def _log_probs(reference: FrozenModel, pairs, split: str, accelerator) -> torch.Tensor:
    """(pairs of `split`, 2) float32 on CPU, on every rank: each pair's summed answer log-probs under `reference`,
    chosen then rejected. Each rank scores pairs rank, rank + N, ...; one all-gather puts them together."""
    total = len(pairs.train if split == "train" else pairs.evaluation)
    world, per_rank = accelerator.num_processes, -(-total // accelerator.num_processes)
    mine, filled = torch.full((per_rank, 2), float("nan"), device=accelerator.device), 0
    for micro, indices in pairs.strided_batches(split):
        sums = answer_log_probs(reference.token_log_probs(micro), micro.labels != pairs.ignore_index,
                                average=False).float()
        scored = torch.stack(sums.chunk(2), dim=1)[[k for k, i in enumerate(indices) if i is not None]]
        mine[filled:filled + len(scored)] = scored
        filled += len(scored)
    every_rank = accelerator.gather(mine).reshape(world, per_rank, 2).cpu()  # rank r's rows r, r + N, ...
    result = torch.empty(total, 2)
    for rank in range(world):
        result[rank::world] = every_rank[rank, :len(range(rank, total, world))]
    return result


def _write(path: Path, train: torch.Tensor, evaluation: torch.Tensor | None, metadata: dict) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # then renamed: a reader never sees half a file
    tensors = {"train": train.contiguous(), **({"eval": evaluation.contiguous()} if evaluation is not None else {})}
    save_file(tensors, str(tmp), metadata={k: str(v) for k, v in metadata.items()})
    os.replace(tmp, path)


def _read(path: Path) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        return (f.get_tensor("train"), f.get_tensor("eval") if "eval" in names else None,
                f.metadata()["digest"])
