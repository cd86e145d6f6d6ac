"""Fine-tuning pretrained weights, the path users take: every engine loads the same saved fp32 checkpoint the way it
loads a Hub model (DeepSpeed ZeRO-3 through `zero.Init`, FSDP2 by rank 0 reading and broadcasting) and trains
exactly as one process does, and one process trains exactly as a plain PyTorch loop written here does.

The checkpoint's tokenizer holds a pad token outside the model's embedding (as transformers' Qwen2 tokenizer adds
one), and weight decay is 1.0, so a matrix left out of the decay group moves the curve by percents."""

from __future__ import annotations

import time

import plain_loop
import pytest
import torch
from conftest import isolated_env
from safetensors.torch import load_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ENGINES = ["ddp", "zero1", "zero2", "zero3", "fsdp2"]
HYPER = plain_loop.Hyper(steps=4, global_batch=8, lr=2e-3, warmup=2, clip=0.5, weight_decay=1.0)
ARGS = HYPER.flags()
# The same tolerances as tests/test_zero_math.py (fp32, another reduction order across ranks).
LOSS_RTOL, WEIGHT_ATOL = 1e-4, 1e-4


@pytest.fixture(scope="module")
def pretrained(session_root, small_model):
    """A saved fp32 checkpoint (safetensors) of the 3.3M-parameter Llama, random weights, and a tokenizer whose
    pad token lies outside its embedding."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = session_root / "pretrained-llama"
    if not path.exists():
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(small_model), dtype=torch.float32)
        model.save_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(small_model)
        tokenizer.add_special_tokens({"pad_token": "<|pad_outside|>"})
        assert tokenizer.pad_token_id == model.config.vocab_size  # one past the last embedding row
        tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def fine_tune(runs, pretrained):
    def get(engine: str):
        if engine == "single":
            return runs("pt-single", *ARGS, "--model", pretrained, "--per_device_batch_size", "8", num_processes=1,
                        mixed_precision="no").check()
        return runs(f"pt-{engine}", *ARGS, "--model", pretrained, "--per_device_batch_size", "4", config=engine,
                    num_processes=2, mixed_precision="no").check()
    return get


def test_fsdp2_rank0_reading_past_the_collective_timeout_trains(fine_tune, runs, pretrained, session_root):
    """FSDP2 reads pretrained weights on rank 0 alone; its read here takes 15 s (the harness delays rank 0's
    `from_pretrained`), longer than --collective_timeout_s 10. The other rank waits outside any collective
    instead of in the broadcast that follows: the job trains as the undelayed run does."""
    env = {**isolated_env(session_root), "ZERO_RECIPES_HARNESS_SLOW_RANK0_LOAD_S": "15"}
    start = time.monotonic()
    slow = runs("pt-fsdp2-slow-rank0-load", *ARGS, "--model", pretrained, "--per_device_batch_size", "4",
                "--collective_timeout_s", "10", config="fsdp2", num_processes=2, mixed_precision="no",
                env=env).check()
    assert time.monotonic() - start > 15
    assert losses(slow) == losses(fine_tune("fsdp2"))


def losses(run) -> list[float]:
    return [m["loss"] for m in run.metrics()]


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_fine_tunes_pretrained_weights_as_one_process_does(fine_tune, engine):
    run, reference = fine_tune(engine), fine_tune("single")
    assert losses(run) == pytest.approx(losses(reference), rel=LOSS_RTOL)
    weights = load_file(run.output_dir / "final" / "model.safetensors")
    ref_weights = load_file(reference.output_dir / "final" / "model.safetensors")
    assert weights.keys() == ref_weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, ref_weights[name], rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.parametrize("engine", ["single", *ENGINES])
def test_every_matrix_decays_under_every_engine(fine_tune, pretrained, engine):
    """The decay group holds every 2-D weight of the checkpoint (counted here from its file), the no-decay group
    every norm weight: under ZeRO-3's zero.Init too, where a parameter's data is an empty 1-D partition."""
    checkpoint = load_file(f"{pretrained}/model.safetensors")
    matrices = [t for t in checkpoint.values() if t.dim() >= 2]
    vectors = [t for t in checkpoint.values() if t.dim() < 2]
    groups = fine_tune(engine).summary()["optimizer_param_groups"]
    assert groups == [
        {"weight_decay": HYPER.weight_decay, "tensors": len(matrices), "elements": sum(t.numel() for t in matrices)},
        {"weight_decay": 0.0, "tensors": len(vectors), "elements": sum(t.numel() for t in vectors)}]


def test_one_process_trains_as_a_plain_pytorch_loop(fine_tune, pretrained, tmp_path):
    """An independent reference for a bug every engine would share: the recipe's losses and final weights equal a
    plain loop over the same packed rows (transformers model, torch AdamW, mean token cross-entropy, clipping)."""
    plain_losses, _, model = plain_loop.train(pretrained, HYPER, tmp_path / "rows")
    recipe = fine_tune("single")
    assert losses(recipe) == pytest.approx(plain_losses, rel=1e-5)
    exported = load_file(recipe.output_dir / "final" / "model.safetensors")
    for name, param in model.named_parameters():
        torch.testing.assert_close(exported[name], param.detach(), rtol=0, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def bf16_lr0(runs, pretrained):
    """One bf16 step with lr 0 from the checkpoint, 2 ranks x 2 micro-batches of 2 rows; FSDP2 with its non-default
    wrapping (the last block resharded after forward, two blocks prefetched: when parameters are gathered, never
    their values)."""
    def get(engine: str):
        wrapping = ("--fsdp_reshard_last_block", "--fsdp_prefetch_blocks", "2") if engine == "fsdp2" else ()
        return runs(f"pt-bf16-lr0-{engine}", *ARGS, *wrapping, "--model", pretrained, "--per_device_batch_size", "2",
                    "--gradient_accumulation_steps", "2", "--lr", "0", "--max_steps", "1", "--warmup_steps", "0",
                    config=engine, num_processes=2, mixed_precision="bf16").check()
    return get


@pytest.mark.parametrize("engine", ["zero2", "zero3", "fsdp2"])
def test_bf16_starts_from_the_checkpoints_fp32_weights(bf16_lr0, pretrained, engine):
    """In bf16 DeepSpeed builds its fp32 master from the weights cast to bf16 (ZeRO-3 under zero.Init already at
    load time); the recipe sets it from the checkpoint's fp32 weights, as FSDP2 and DDP keep them. With lr 0 the
    exported master after one step must be the checkpoint bit for bit (bf16-rounded it is ~1e-3 off). FSDP2 loads
    through rank 0 (it reads, the shards are broadcast), with its non-default wrapping flags."""
    run = bf16_lr0(engine)
    assert run.summary()["mixed_precision"] == "bf16"
    exported = load_file(run.output_dir / "final" / "model.safetensors")
    original = load_file(f"{pretrained}/model.safetensors")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_bf16_zero3_and_fsdp2_clip_the_same_gradient(bf16_lr0):
    """From the same weights bf16 ZeRO-3 and FSDP2 compute the same 16-bit gradients per micro-batch; the gradient
    they clip must be the same too: both reduce over ranks and accumulate micro-batches in fp32 and sum its norm in
    fp64. DeepSpeed's defaults (reduction in bf16, a bf16 gradient partition) round every element of it, and torch's
    fp32-summed `clip_grad_norm_` is 1e-5 off at 10^8 parameters (docs/PRECISION.md): either puts the two step-1
    norms apart by far more than this tolerance."""
    zero3, fsdp2 = (bf16_lr0(engine).metrics()[0]["grad_norm"] for engine in ("zero3", "fsdp2"))
    assert fsdp2 == pytest.approx(zero3, rel=1e-9, abs=0)
