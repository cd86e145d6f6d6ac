"""zero_utils.run.engine: the typed engine every module asks instead of matching name prefixes, and the checkpoint
policy's settings check. The engine each launch really builds is checked end to end by tests/test_engines.py
(`summary["engine"]` for every shipped YAML); here the table itself, written out by hand."""

from __future__ import annotations

import pytest

from zero_utils.checkpoint import policy as checkpoint
from zero_utils.checkpoint import storage as checkpoint_storage
from zero_utils.run.engine import Engine

pytestmark = pytest.mark.unit

# name: (family, ZeRO stage, offload, shards parameters, checkpoint storage)
TABLE = {
    "single": ("single", 0, False, False, "dcp"),
    "ddp": ("ddp", 0, False, False, "dcp"),
    "zero1": ("deepspeed", 1, False, False, "deepspeed"),
    "zero2": ("deepspeed", 2, False, False, "deepspeed"),
    "zero3": ("deepspeed", 3, False, True, "deepspeed"),
    "zero3_offload": ("deepspeed", 3, True, True, "deepspeed"),
    "fsdp2": ("fsdp2", 3, False, True, "dcp"),
    "fsdp2_zero2": ("fsdp2", 2, False, True, "dcp"),
    "fsdp2_offload": ("fsdp2", 3, True, True, "dcp"),
}


@pytest.mark.parametrize("name", TABLE)
def test_every_engine_name_reads_back_as_what_it_is(name):
    family, stage, offload, shards, storage = TABLE[name]
    engine = Engine.parse(name)
    assert (engine.family, engine.zero_stage, engine.offload) == (family, stage, offload)
    assert engine.shards_params is shards and checkpoint_storage.storage_for(engine).name == storage
    assert engine.name == str(engine) == name
    assert checkpoint_storage.storage_for(engine).supports_async_save is (storage == "dcp")


def test_hsdp_and_unknown_names():
    assert Engine.parse("fsdp2_hsdp").hsdp and Engine.parse("fsdp2_hsdp_offload").offload
    for bad in ("zero4", "ddp_offload", "fsdp", "zero3_offload_offload"):
        with pytest.raises(ValueError):
            Engine.parse(bad)


def test_a_resume_from_another_model_is_refused(tmp_path):
    from zero_utils.run.errors import UserError

    saved = {"model": "runs/llama_zero3/final", "revision": ""}
    checkpoint.refuse_another_model(saved, dict(saved))
    (tmp_path / "final").mkdir()
    checkpoint.refuse_another_model({"model": str(tmp_path / "final")}, {"model": str(tmp_path / "x" / ".." / "final")})
    with pytest.raises(UserError, match=r"^--model 'Qwen/Qwen2.5-0.5B' is not the checkpoint's --model "
                                        r"'runs/llama_zero3/final': a resume continues the model it saved"):
        checkpoint.refuse_another_model(saved, {**saved, "model": "Qwen/Qwen2.5-0.5B"})
    with pytest.raises(UserError, match="--revision 'v2' is not the checkpoint's --revision ''"):
        checkpoint.refuse_another_model(saved, {**saved, "revision": "v2"})


def test_a_config_only_model_is_drawn_from_the_first_runs_seed_on_every_resume():
    """A reference model or a LoRA merge drawn again from the seed must be the model training started from: a resume
    with another --seed keeps the first run's, and so does a resume of that resume (and of a checkpoint written before
    `init_seed` was recorded: its `seed`)."""
    assert checkpoint.init_seed(None, 7) == 7  # a fresh start: this run's --seed
    assert checkpoint.init_seed({"seed": 42}, 7) == 42
    assert checkpoint.init_seed({"seed": 7, "init_seed": 42}, 3) == 42


def test_a_resume_names_each_changed_setting_but_not_run_control():
    saved = {"lr": 0.003, "seq_len": 256, "max_steps": 100, "output_dir": "a", "resume": ""}
    current = {"lr": 0.001, "seq_len": 256, "max_steps": 200, "output_dir": "b", "resume": "auto"}
    assert checkpoint.changed_settings(saved, current) == [
        "the run resumes with settings that differ from the checkpoint's: lr 0.003 -> 0.001."]
    assert checkpoint.changed_settings(saved, saved) == []
