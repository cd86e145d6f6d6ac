"""The training step's parts: AdamW and the learning-rate schedule (optim), the chunked per-token loss (token_loss),
what a run measures on itself next to the formulas (measurement), evidence that an engine holds what it claims
(evidence) and the run's records: metrics.jsonl, summary.json, W&B (tracking)."""
