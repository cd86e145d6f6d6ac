"""Preference training (DPO, IPO, SimPO): one pair as tokens (examples), the pairs' row maker of the preparation
pipeline (pair_rows), a run's pairs (data: `PreferenceData`), the losses (loss), the reference in every mode, one
object whatever the mode (reference: a frozen copy held as the engine holds the policy, a LoRA policy's adapters
off, or none), the reference's log-probabilities precomputed before training (reference_logps) and a reward model's
Bradley-Terry loss (reward)."""
