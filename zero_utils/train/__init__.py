"""The training step's parts: AdamW and the learning-rate schedule (optim), the chunked per-token loss (token_loss),
what a run measures on itself next to the formulas (measurement), evidence that an engine holds what it claims
(evidence), the run's records: metrics.jsonl, summary.json, W&B (tracking), and a frozen model for forwards only,
held as the engine holds the policy: a reference, a teacher (frozen_model)."""
