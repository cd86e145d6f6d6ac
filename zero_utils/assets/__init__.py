"""The files the package ships, and their paths: a tiny Llama's config and tokenizer without weights (tiny-llama: the
recipes draw its weights from the seed), 4,000 instruction examples (sft_tiny.jsonl) and 2,000 preference pairs
(dpo_tiny.jsonl), written by tools/make_assets.py. A leaf of the folders' tiers: it imports nothing of zero_utils, so
a module that needs only a path (`zero_utils.compare.runner`'s default --model) loads no torch."""

from pathlib import Path

_HERE = Path(__file__).resolve().parent
BUNDLED_MODEL = str(_HERE / "tiny-llama")  # no download: the recipes' default --model
BUNDLED_DATASET = str(_HERE / "sft_tiny.jsonl")  # the SFT recipes' default --dataset (chat messages)
BUNDLED_PREFERENCES = str(_HERE / "dpo_tiny.jsonl")  # the DPO recipes' default --dataset (prompt, chosen, rejected)
