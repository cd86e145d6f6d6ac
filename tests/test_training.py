"""Training behaviour: learning happens on the bundled data, and the default-config launch of docs/ENGINES.md is FSDP2.
(That world size, accumulation and the engine change nothing in the mathematics: tests/test_zero_math.py.)"""

from __future__ import annotations

import shutil

import pytest
from conftest import CONFIGS, isolated_env, launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_learning_on_the_bundled_data(sft_defaults):
    """The default run (150 steps on the bundled data, bf16, eval every 50): at the end both training and held-out
    loss are far below the first step's, and the held-out loss fell since the first evaluation."""
    metrics = sft_defaults.metrics()
    first, last = metrics[0]["loss"], metrics[-1]
    assert last["step"] == 150 and metrics[49]["step"] == 50
    assert last["loss"] < 0.5 * first
    assert last["eval_loss"] < 0.5 * first
    assert metrics[49]["eval_loss"] > last["eval_loss"]
    assert sft_defaults.summary()["perplexity"] == pytest.approx(2.718281828 ** last["eval_loss"], rel=1e-6)


def test_default_config_makes_the_bare_launch_fsdp2(session_root):
    """docs/ENGINES.md's way of making fsdp2.yaml the default accelerate config works."""
    root = session_root / "default-config"
    env = isolated_env(root)
    (root / "hf_home" / "accelerate").mkdir(parents=True)
    shutil.copy(CONFIGS / "fsdp2.yaml", root / "hf_home" / "accelerate" / "default_config.yaml")
    run = launch(root / "run", "--max_steps", "2", "--seq_len", "128", "--report_to", "none", "--max_new_tokens", "0",
                 "--per_device_batch_size", "2", num_processes=2, env=env).check()
    summary = run.summary()
    assert summary["engine"] == "fsdp2"
    # A fresh datasets cache: the main process tokenized and packed, the other rank only read its cache.
    written = summary["data_cache_files_written_per_rank"]
    assert written[0] > 0 and written[1] == 0


def test_the_readme_job_prints_no_fsdp2_view_warning(sft_defaults):
    """torch warns on every FSDP2 step when a unit returns a view ("FSDP2-wrapped module (FSDPLlamaRMSNorm,
    FSDPLinear) returned a view tensor ...": an in-place op on it would drop the pre-backward hook). The chunked head
    returned `view_as` of its concatenated losses, and the root model passed that view on; it returns a new tensor
    now, and the README's main job, run with Python's default warnings, prints none."""
    assert "UserWarning" in sft_defaults.output  # the launch shows warnings (transformers' own, at least one)
    assert "returned a view tensor" not in sft_defaults.output


def test_the_summary_and_the_tracker_config_keep_their_keys(sft_defaults):
    """Issue 71: the bookkeeping every recipe shares moved into the tracker; summary.json and the W&B config of the
    default run hold exactly the keys the recipe wrote itself before (tests/record_keys.py)."""
    from record_keys import assert_record_keys

    assert_record_keys(sft_defaults, "llama_zero3")
