"""Checkpoints never lose work: exact resume for every engine, resume on another world size, crash during save,
async save, export to a Hugging Face folder, and refusals that are one sentence.

The interrupted runs are the 8-step, 2-rank runs of test_zero_math (fp32, checkpoints at steps 4 and 8): each
test here resumes from their step-4 checkpoint and compares steps 5-8 with the uninterrupted curve."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import EIGHT_STEPS, REPO, Run, isolated_env, launch
from safetensors.torch import load_file

from zero_utils.checkpoint import export as checkpoint_export
from zero_utils.checkpoint import policy as checkpoint
from zero_utils.checkpoint import storage as checkpoint_storage
from zero_utils.run.errors import UserError

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
EXACT_RTOL = 1e-6  # same world size: bitwise-equal states, so only summation-order noise (if any)
RESHARD_RTOL = 1e-5  # another world size: the same global batch reduced in another order


def losses(run: Run) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in run.metrics()}


@pytest.fixture(scope="module")
def resume(runs, small_model):
    def get(name, source: Run, *, engine, world=2, extra=(), **kwargs) -> Run:
        batch = str(8 // world)
        return runs(f"ck-{name}", *EIGHT_STEPS, "--model", small_model, "--per_device_batch_size", batch,
                    "--gradient_accumulation_steps", "1", "--resume", str(source.output_dir / "checkpoints/step_4"),
                    *extra, config=engine, num_processes=world, mixed_precision="no", **kwargs)
    return get


@pytest.mark.parametrize("engine", ["fsdp2", "ddp", "zero1", "zero2", "zero3"])
def test_resume_continues_exactly(run_layout, resume, engine):
    original = run_layout(engine, 2, 4, 1)
    resumed = resume(f"exact-{engine}", original, engine=engine).check()
    assert f"resumed from {original.output_dir / 'checkpoints/step_4'} at step 4" in resumed.output
    want, got = losses(original), losses(resumed)
    assert sorted(got) == [5, 6, 7, 8]  # the data order continues: no step is repeated or skipped
    assert [got[s] for s in got] == pytest.approx([want[s] for s in got], rel=EXACT_RTOL)
    meta = checkpoint_storage.read_metadata(original.output_dir / "checkpoints/step_4")
    assert meta["step"] == 4 and meta["examples_seen"] == 32 and meta["world_size"] == 2 and meta["engine"] == engine


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_resume_on_another_world_size(run_layout, resume, engine, world):
    """A 2-rank checkpoint resumes on 1 and on 4 ranks (DCP reshards) and continues the same curve: the global
    batch is kept, and the data position is counted in global rows."""
    original = run_layout(engine, 2, 4, 1)
    resumed = resume(f"elastic-{engine}-{world}", original, engine=engine if world > 1 else None, world=world).check()
    want, got = losses(original), losses(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    assert [got[s] for s in got] == pytest.approx([want[s] for s in got], rel=RESHARD_RTOL)


def test_deepspeed_resumes_on_another_world_size_through_a_universal_checkpoint(run_layout, resume):
    """ZeRO-3, 2 -> 4 ranks via DeepSpeed's ds_to_universal. The weights come back exactly (step 5's loss, taken
    before any update, is equal); the curve then continues within 1% but not exactly: DeepSpeed 0.19.8's universal
    loader does not restore the Adam moments bit for bit (docs/CHECKPOINTS.md)."""
    original = run_layout("zero3", 2, 4, 1)
    resumed = resume("universal-zero3-4", original, engine="zero3", world=4).check()
    want, got = losses(original), losses(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    assert got[5] == pytest.approx(want[5], rel=EXACT_RTOL)
    assert [got[s] for s in got] == pytest.approx([want[s] for s in got], rel=1e-2)
    assert (original.output_dir / "checkpoints/step_4/universal/state").is_dir()


def test_resume_auto_with_more_steps_follows_the_new_schedule(run_layout, session_root, small_model):
    from zero_utils.train.optim import lr_at

    original = run_layout("fsdp2", 2, 4, 1)
    copy = session_root / "ck-extend"
    shutil.copytree(original.output_dir, copy)
    run = launch(copy, *EIGHT_STEPS, "--max_steps", "10", "--model", small_model, "--per_device_batch_size", "4",
                 "--resume", "auto", config="fsdp2", mixed_precision="no", env=isolated_env(session_root)).check()
    metrics = run.metrics()
    assert [m["step"] for m in metrics] == list(range(1, 11))  # one record, continued
    assert metrics[8]["lr"] == pytest.approx(lr_at(9, max_steps=10, peak_lr=2e-3, warmup_steps=2))
    assert [p.name for _, p in checkpoint_storage.list_complete(copy)] == ["step_8", "step_10"]


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_usable(runs, run_layout, small_model):
    """Rank 1 dies (SIGKILL) in the middle of writing the step-8 checkpoint: the job fails, step_4 stays
    complete, the half-written step 8 never counts, and --resume auto finishes the run on the same curve."""
    args = (*EIGHT_STEPS, "--model", small_model, "--per_device_batch_size", "4")
    env_name = "ZERO_RECIPES_HARNESS_KILL_RANK_DURING_SAVE"  # tests/scripts/harness.py
    out = run_layout("fsdp2", 2, 4, 1).output_dir.parent / "ck-crash"
    env = {**isolated_env(out.parent), env_name: "1:8"}
    crashed = launch(out, *args, config="fsdp2", mixed_precision="no", env=env)
    assert crashed.returncode != 0
    assert [p.name for _, p in checkpoint_storage.list_complete(out)] == ["step_4"]
    assert (out / "checkpoints/.tmp_step_8").exists() and not (out / "checkpoints/step_8").exists()
    resumed = launch(out, *args, "--resume", "auto", config="fsdp2", mixed_precision="no",
                     env=isolated_env(out.parent)).check()
    want = losses(run_layout("fsdp2", 2, 4, 1))
    assert [m["loss"] for m in resumed.metrics()] == pytest.approx([want[s] for s in range(1, 9)], rel=EXACT_RTOL)


def test_async_save_trains_on_while_writing_and_writes_the_same_checkpoint(runs, run_layout, small_model):
    sync = run_layout("fsdp2", 2, 4, 1)
    run = runs("ck-async", *EIGHT_STEPS, "--model", small_model, "--per_device_batch_size", "4", "--async_save",
               config="fsdp2", mixed_precision="no").check()
    assert [m["loss"] for m in run.metrics()] == [m["loss"] for m in sync.metrics()]
    meta = checkpoint_storage.read_metadata(run.output_dir / "checkpoints/step_4")
    assert meta["async"] and meta["finalized_after_step"] > 4  # steps 5.. ran before the save was finalized
    exported = [checkpoint_export.export(r.output_dir / "checkpoints/step_4", r.output_dir / "export4")
                for r in (run, sync)]
    a, b = (load_file(d / "model.safetensors") for d in exported)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_export_reproduces_the_trained_models_logits(run_layout, session_root, engine):
    """The CLI exports a 2-rank checkpoint in one process on CPU; plain from_pretrained loads it with no missing
    keys, and its logits equal those the sharded model computed at the end of training."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zero_utils.data import sft_examples

    run = run_layout(engine, 2, 4, 1)
    out = session_root / f"export-{engine}"
    cli = subprocess.run([sys.executable, "-m", "zero_utils.checkpoint", "export",
                          str(run.output_dir / "checkpoints/step_8"), str(out), "--max_shard_size", "5MB"],
                         cwd=REPO, capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert (out / "model.safetensors.index.json").exists()  # 13 MB of fp32 weights in 5 MB shards
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = sft_examples.render_prompt(tokenizer, [{"role": "user", "content": run.summary()["prompt"]}])
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, -1]
    torch.testing.assert_close(logits, load_file(run.output_dir / "probe_logits.safetensors")["logits"],
                               rtol=1e-5, atol=1e-5)


def test_deepspeed_checkpoint_stays_readable_by_deepspeeds_own_tools(run_layout, session_root):
    run = run_layout("zero3", 2, 4, 1)
    ds_dir = run.output_dir / "checkpoints/step_8/deepspeed"
    out = session_root / "zero_to_fp32"
    proc = subprocess.run([sys.executable, str(ds_dir / "zero_to_fp32.py"), str(ds_dir), str(out), "--tag", "state",
                           "--safe_serialization"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours = load_file(run.output_dir / "final" / "model.safetensors")
    theirs = {}
    for f in out.glob("*.safetensors"):
        theirs.update(load_file(f))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_checkpoint_is_as_small_as_its_contents(run_layout):
    """FSDP2 at 2 ranks: each rank's shard files hold its half of params and Adam moments (12 bytes/param / 2),
    no full-model copy per rank, and the summary reports it."""
    summary = run_layout("fsdp2", 2, 4, 1).summary()
    per_rank = summary["checkpoint_bytes"]["max_per_rank"]
    assert per_rank == pytest.approx(12 * summary["num_params"] / 2, rel=0.05)


def test_not_a_checkpoint_is_refused_before_anything_is_read(runs, tmp_path):
    (tmp_path / "model_optim").mkdir()
    run = runs("ck-refuse-path", "--max_steps", "1", "--resume", str(tmp_path), "--report_to", "none",
               num_processes=1)
    assert run.returncode != 0 and "is not a complete zero-recipes checkpoint" in run.stderr
    assert not re.search(r'File ".*/(zero_utils|recipes)/', run.stderr)  # the launcher's traceback only
    cli = subprocess.run([sys.executable, "-m", "zero_utils.checkpoint", "export", str(tmp_path), str(tmp_path / "o")],
                         cwd=REPO, capture_output=True, text=True)
    assert cli.returncode == 2 and "is not a complete zero-recipes checkpoint" in cli.stderr


def test_checkpoint_of_another_model_is_refused(runs, run_layout):
    source = run_layout("fsdp2", 2, 4, 1).output_dir / "checkpoints/step_4"
    run = runs("ck-refuse-model", "--max_steps", "5", "--resume", str(source), "--report_to", "none",
               "--seq_len", "64", config="fsdp2", mixed_precision="no")  # the bundled tiny model, not the small one
    assert run.returncode != 0 and "another architecture" in run.stderr


def test_new_run_never_deletes_another_runs_checkpoints(tmp_path):
    (tmp_path / "checkpoints/step_4").mkdir(parents=True)
    (tmp_path / "checkpoints/step_4" / checkpoint_storage.META_FILE).write_text(json.dumps({"step": 4}))
    with pytest.raises(UserError, match="--resume auto .* --overwrite"):
        checkpoint.resolve_resume(str(tmp_path), "", overwrite=False)
    assert checkpoint.resolve_resume(str(tmp_path), "", overwrite=True) is None
    assert checkpoint.resolve_resume(str(tmp_path), "auto", overwrite=False).name == "step_4"
    (tmp_path / "checkpoints/.tmp_step_8").mkdir()  # an interrupted save never counts
    (tmp_path / "checkpoints/step_9").mkdir()  # nor a folder without metadata
    assert checkpoint.resolve_resume(str(tmp_path), "auto", overwrite=False).name == "step_4"
