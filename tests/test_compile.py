"""torch.compile as accelerate configures it (`accelerate launch --dynamo_backend inductor
--dynamo_use_regional_compilation`), applied by zero_utils.run.compiling: each decoder block compiled in place. In
process: the launch's settings, the refusal of a whole-model compile, names unchanged (a PEFT adapter's too). Launched
(fp32, 2 ranks, the shared 8-step runs' settings): DDP, FSDP2 and ZeRO-3 compiled train as their eager runs, with no
recompile from step to step; a compiled DDP run's checkpoint and export carry the eager run's keys and a resume
without compile continues it.

One inductor cache for the whole test run, one compile thread per process (2 cores); the model is the 3.3M-parameter
Llama of the shared runs. Launches: 4."""

from __future__ import annotations

import pytest
import torch
from conftest import EIGHT_STEPS, isolated_env
from safetensors.torch import load_file

from zero_utils.run import compiling
from zero_utils.run.errors import UserError

COMPILE = ("--dynamo_backend", "inductor", "--dynamo_use_regional_compilation")  # as a user launches it
DEEPSPEED_COMPILE = {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "true"}
DYNAMO_VARIABLES = ("BACKEND", "MODE", "USE_FULLGRAPH", "USE_DYNAMIC", "USE_REGIONAL_COMPILATION")


@pytest.fixture
def launch_env(monkeypatch):
    """Set accelerate's ACCELERATE_DYNAMO_* variables as `accelerate launch` would (the others cleared)."""
    for name in DYNAMO_VARIABLES:
        monkeypatch.delenv(f"ACCELERATE_DYNAMO_{name}", raising=False)

    def set_(**values):
        for name, value in values.items():
            monkeypatch.setenv(f"ACCELERATE_DYNAMO_{name.upper()}", value)
    return set_


@pytest.mark.unit
def test_the_launch_decides_and_a_whole_model_compile_is_one_sentence(launch_env):
    assert compiling.compile_settings() is None  # no dynamo settings: eager
    launch_env(backend="NO", use_regional_compilation="True")
    assert compiling.compile_settings() is None
    launch_env(backend="INDUCTOR", mode="default", use_fullgraph="False", use_dynamic="False",
               use_regional_compilation="True")  # what `accelerate launch` COMPILE sets
    assert compiling.compile_settings() == {"backend": "inductor", "dynamic": False}
    launch_env(use_regional_compilation="False")
    with pytest.raises(UserError, match=r"^the launch compiles the whole model \(dynamo backend inductor without "
                                        r"regional compilation\), .*add --dynamo_use_regional_compilation to "
                                        r"accelerate launch"):
        compiling.compile_settings()


@pytest.mark.unit
def test_a_deepspeed_launch_given_the_flags_is_one_sentence(launch_env, monkeypatch, tmp_path):
    """accelerate 1.15's DeepSpeed launcher drops the dynamo flags: a DeepSpeed process whose launch asked for a
    compile (flag or YAML) stops with the way that works; the exported variables do reach it and compile."""
    yaml_file = tmp_path / "zero3_compiled.yaml"
    yaml_file.write_text("distributed_type: DEEPSPEED\ndynamo_config:\n  dynamo_backend: INDUCTOR\n")
    plain = ["python", "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/zero3.yaml", "r.py"]
    assert not compiling.launch_asked_for_compile(plain)
    assert compiling.launch_asked_for_compile([*plain[:3], "--dynamo_backend", "inductor", *plain[3:]])
    assert not compiling.launch_asked_for_compile([*plain[:3], "--dynamo_backend", "no", *plain[3:]])
    assert compiling.launch_asked_for_compile([*plain[:4], str(yaml_file), "r.py"])
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setattr(compiling, "_launcher_command_line",
                        lambda: [*plain[:3], "--dynamo_backend", "inductor", *plain[3:]])
    with pytest.raises(UserError, match=r"^accelerate 1.15 does not pass --dynamo_backend to a DeepSpeed launch .* "
                                        r"export ACCELERATE_DYNAMO_BACKEND=INDUCTOR "
                                        r"ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=true before accelerate launch"):
        compiling.compile_settings()
    launch_env(backend="INDUCTOR", use_regional_compilation="true")  # exported: they reach the process
    assert compiling.compile_settings() == {"backend": "inductor"}


@pytest.mark.unit
def test_blocks_compile_in_place_and_no_name_changes():
    """The blocks of a tiny Llama (and of the same model with LoRA adapters) compiled in place: the same state-dict
    keys and adapter keys as before; the output head, embedding and norm are not compiled. Nothing runs (compiling
    happens at the first call)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    from zero_utils.model.wrapping import find_block_classes

    def tiny():
        config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2)
        return LlamaForCausalLM(config)

    model = tiny()
    keys = list(model.state_dict())
    line = compiling.compile_blocks(model, find_block_classes(model), {"backend": "inductor"})
    assert line.startswith("compile: 3 LlamaDecoderLayer blocks compiled in place with inductor")
    assert list(model.state_dict()) == keys and "_orig_mod" not in "".join(keys)
    compiled = [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert compiled == [f"model.layers.{i}" for i in range(3)]
    lora = get_peft_model(tiny(), LoraConfig(r=2, target_modules="all-linear"))
    adapter_keys = list(get_peft_model_state_dict(lora))
    compiling.compile_blocks(lora, find_block_classes(lora), {"backend": "inductor"})
    assert list(get_peft_model_state_dict(lora)) == adapter_keys and len(adapter_keys) > 0


# ---------------------------------------------------------------------------------------------- launched
LAYOUT = ("--per_device_batch_size", "4", "--gradient_accumulation_steps", "1")  # run_layout(engine, 2, 4, 1)


@pytest.fixture(scope="module")
def compiled_run(runs, small_model, session_root):
    """`compiled_run(engine)`: run_layout(engine, 2, 4, 1)'s run with accelerate's compile settings."""
    env = {**isolated_env(session_root), "TORCHINDUCTOR_CACHE_DIR": str(session_root / "inductor-cache"),
           "TORCHINDUCTOR_COMPILE_THREADS": "1", "ZERO_RECIPES_HARNESS_COMPILE_PROBE": "1"}

    def get(engine: str):
        if engine.startswith("zero"):  # accelerate 1.15's DeepSpeed launcher drops the flags: the variables go through
            return runs(f"compiled-{engine}", *EIGHT_STEPS, "--model", small_model, *LAYOUT, config=engine,
                        num_processes=2, mixed_precision="no", env={**env, **DEEPSPEED_COMPILE}, timeout=900).check()
        return runs(f"compiled-{engine}", *EIGHT_STEPS, "--model", small_model, *LAYOUT, config=engine,
                    num_processes=2, mixed_precision="no", launch_args=COMPILE, env=env, timeout=900).check()
    return get


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "zero3"])
def test_compiled_blocks_train_as_the_eager_run(compiled_run, run_layout, engine):
    """Per-step losses within 1e-4 and final weights within 1e-4 of the eager run (the repository's reduction-order
    tolerances: inductor fuses and reorders float sums); dynamo made no new graph after step 1 on any rank; the
    start-up line says what was compiled and the summary the first step's extra seconds."""
    compiled, eager = compiled_run(engine), run_layout(engine, 2, 4, 1)
    assert "compile: 4 LlamaDecoderLayer blocks compiled in place with inductor" in compiled.output
    assert [m["loss"] for m in compiled.metrics()] == pytest.approx([m["loss"] for m in eager.metrics()], rel=1e-4)
    weights, eager_weights = (load_file(run.output_dir / "final/model.safetensors") for run in (compiled, eager))
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, eager_weights[name], rtol=0, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    for graphs in compiled.summary()["unique_graphs_per_step_per_rank"]:
        assert graphs[0] > 0 and graphs[2] == graphs[0], graphs  # step 3 = step 1: no recompile per step
    assert compiled.summary()["first_step_extra_s"] > 0


@pytest.mark.distributed
@pytest.mark.slow
def test_a_compiled_runs_checkpoint_and_export_are_an_eager_runs(compiled_run, run_layout):
    """DDP, where accelerate's own compile_regions would rename the parameters: the step-4 checkpoint's keys and the
    export's keys equal the eager run's, and the export loads with `from_pretrained`."""
    from transformers import AutoModelForCausalLM

    from zero_utils.checkpoint.storage import DCP_DIR

    compiled, eager = compiled_run("ddp"), run_layout("ddp", 2, 4, 1)
    keys = [sorted(torch.distributed.checkpoint.FileSystemReader(str(run.output_dir / "checkpoints/step_4" / DCP_DIR))
                   .read_metadata().state_dict_metadata) for run in (compiled, eager)]
    assert keys[0] == keys[1] and not any("_orig_mod" in k for k in keys[0])
    assert load_file(compiled.output_dir / "final/model.safetensors").keys() == \
        load_file(eager.output_dir / "final/model.safetensors").keys()
    model = AutoModelForCausalLM.from_pretrained(compiled.output_dir / "final")
    assert sum(p.numel() for p in model.parameters()) > 3_000_000


@pytest.mark.distributed
@pytest.mark.slow
def test_a_compiled_run_resumes_without_compile(compiled_run, runs, small_model):
    """The compiled DDP run's step-4 checkpoint resumed by an eager launch: steps 5-8 repeat the compiled run's
    losses within 1e-4."""
    compiled = compiled_run("ddp")
    resumed = runs("compiled-ddp-resumed-eager", *EIGHT_STEPS, "--model", small_model, *LAYOUT, "--resume",
                   str(compiled.output_dir / "checkpoints/step_4"), config="ddp", num_processes=2,
                   mixed_precision="no").check()
    assert [m["step"] for m in resumed.metrics()] == [5, 6, 7, 8]
    assert [m["loss"] for m in resumed.metrics()] == pytest.approx([m["loss"] for m in compiled.metrics()[4:]],
                                                                   rel=1e-4)
