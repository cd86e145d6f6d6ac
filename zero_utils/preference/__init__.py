"""Preference training (DPO, IPO, SimPO): one pair as tokens (examples), pairs prepared once per job (prepared_pairs), a
run's pairs (data: `PreferenceData`), the losses (loss), the frozen reference model held as the engine holds the policy
(reference_model) and the reference's log-probabilities precomputed before training (reference_logps)."""
