"""Training behaviour: learning happens, and world size / accumulation change nothing in the mathematics."""

from __future__ import annotations

import shutil

import pytest
from conftest import CONFIGS, isolated_env, launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# One global batch of 8 rows, fp32, laid out three ways (world size x per-device batch x accumulation).
EQUIV_ARGS = ("--max_steps", "6", "--seq_len", "128", "--report_to", "none", "--max_new_tokens", "0",
              "--eval_fraction", "0", "--warmup_steps", "2")


def losses(run):
    return [m["loss"] for m in run.metrics()]


@pytest.fixture(scope="module")
def reference(runs):
    """Single process, 8 rows as 4 x accumulation 2."""
    return runs("ref-single", *EQUIV_ARGS, "--per_device_batch_size", "4", "--gradient_accumulation_steps", "2",
                num_processes=1, mixed_precision="no").check()


@pytest.mark.parametrize("config", ["fsdp2", "ddp", "zero3"])
def test_loss_curve_matches_single_process(runs, reference, config):
    """2 ranks x 2 rows x accumulation 2 = the same 8 rows: the logged loss (mean over every answer token of the
    global batch) and hence the whole curve equal single-process training (fp32; 1e-4 relative leaves room
    for the different reduction order of 2 ranks)."""
    run = runs(f"equiv-{config}", *EQUIV_ARGS, "--per_device_batch_size", "2", "--gradient_accumulation_steps", "2",
               config=config, mixed_precision="no").check()
    assert losses(run) == pytest.approx(losses(reference), rel=1e-4)
    grad_norms = [m["grad_norm"] for m in run.metrics()]
    assert grad_norms == pytest.approx([m["grad_norm"] for m in reference.metrics()], rel=1e-4)


def test_learning_on_the_bundled_data(runs):
    """After 60 steps on the bundled data both training and held-out loss are far below the first step's."""
    run = runs("learn-fsdp2", "--max_steps", "60", "--eval_every", "30", "--report_to", "none", "--seq_len", "128",
               config="fsdp2", mixed_precision="no").check()
    metrics = run.metrics()
    first, last = metrics[0]["loss"], metrics[-1]
    assert last["loss"] < 0.5 * first
    assert last["eval_loss"] < 0.5 * first
    assert metrics[29]["eval_loss"] > last["eval_loss"]
    assert run.summary()["perplexity"] == pytest.approx(2.718281828 ** last["eval_loss"], rel=1e-6)


def test_default_config_makes_the_bare_launch_fsdp2(session_root):
    """The README's way of making fsdp2.yaml the default accelerate config works."""
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
