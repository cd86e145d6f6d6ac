"""Data, from where it comes to the rows a rank trains on: the layouts and splits users keep (sources), weighted
mixtures (mixture), one SFT example as tokens (sft_examples), packing (packing), how packed rows keep examples apart
under each attention implementation (attention), the one preparation pipeline, once per job (preparation: a source
stream, source_stream, times a row maker: SFT rows, sft_rows; prompts for generation, prompt_rows), the
cache of prepared folders, listed and pruned (cache: `python -m zero_utils.data cache`) and a run's training data
(training: `TrainingData`)."""
