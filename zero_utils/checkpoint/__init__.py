"""Checkpoints: the policy of a run (policy: `Checkpointer`, resume, cadence, what a resume must match), where the
bytes go and how they come back (storage: DCP or DeepSpeed's own format) and a checkpoint as a Hugging Face folder
(export; `python -m zero_utils.checkpoint export ...`)."""
