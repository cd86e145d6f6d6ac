"""Activation offloading (--activation_offloading with --gradient_checkpointing; zero_utils.model.activation_offload).
In process: a checkpointed tiny Llama trains the same with and without it, every moved tensor comes back once, small
tensors and parameters stay; the flag without checkpointing and accelerate's own YAML key are one sentence each.
Launched (fp32, 2 ranks, the shared 8-step runs' settings, every saved tensor moved: tests/scripts/harness.py sets
the minimum size to 0): DDP, FSDP2 and ZeRO-3 train the eager runs' losses, each step moves every tensor out and
back exactly once and nothing saved stays on the device. Launches: 3."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import EIGHT_STEPS, isolated_env

from zero_utils.model.activation_offload import ActivationOffload
from zero_utils.run.errors import UserError


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def recording(offload, moved: list):
    """`offload.pack`, recording (weak reference, shape, a floating-point tensor it moves) for each call."""
    pack = offload.pack

    def recorded(tensor):
        moved.append((weakref.ref(tensor), tuple(tensor.shape), offload.moves(tensor) and tensor.is_floating_point()))
        return pack(tensor)
    return recorded


@pytest.mark.unit
def test_a_checkpointed_step_is_the_same_with_its_inputs_on_the_host():
    """Loss and every gradient equal bit for bit; five (4, 64, 128) tensors went out (the 3 blocks' inputs, the final
    norm's and the output head's inputs) and at least as many came back; after the forward no moved tensor is alive
    on the device (nothing but the host copy holds it); with a minimum above their size (1 TiB) nothing moves;
    parameters never do."""
    ids = torch.randint(0, 1000, (4, 64))
    results = {}
    for name, offload in (("kept", None), ("offloaded", ActivationOffload("cpu", min_bytes=1)),
                          ("too small", ActivationOffload("cpu", min_bytes=2**40))):
        model = tiny_llama()
        moved = []  # weak references to what was given to pack, with shapes and whether it is a moved activation
        if offload is not None:
            offload.pack = recording(offload, moved)
        with offload.hooks() if offload is not None else torch.enable_grad():
            loss = model(input_ids=ids, labels=ids).loss
            gc.collect()
            if name == "offloaded":  # on the host only: no activation's device copy is kept alive (the input ids are)
                assert [shape for ref, shape, moves in moved if moves and ref() is not None] == [], name
        loss.backward()
        results[name] = (loss, [p.grad for p in model.parameters()], offload, moved)
    loss, grads, _, _ = results["kept"]
    for name in ("offloaded", "too small"):
        assert torch.equal(results[name][0], loss)
        assert all(torch.equal(a, b) for a, b in zip(results[name][1], grads, strict=True)), name
    offload = results["offloaded"][2]
    hidden = [ref for ref, shape, moves in results["offloaded"][3] if moves and shape == (4, 64, 128)]
    assert len(hidden) >= 5 and offload.offloaded >= 5 and offload.restored >= offload.offloaded
    assert results["too small"][2].offloaded == 0
    assert not any(offload.moves(p) for p in tiny_llama().parameters())


@pytest.mark.unit
def test_the_flag_without_checkpointing_and_accelerates_own_key_are_one_sentence():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from test_fit_check import check_bundled

    from zero_utils.run.accelerator import check_fsdp_settings

    with pytest.raises(UserError, match=r"^--activation_offloading moves the checkpointed blocks' inputs to host "
                                        r"memory: add --gradient_checkpointing\.$"):
        check_bundled(device_memory="1TB", activation_offloading=True)
    with pytest.raises(UserError, match=r"^fsdp_activation_checkpointing_offload in the accelerate YAML is "
                                        r"accelerate's own offloading, .*pass --gradient_checkpointing "
                                        r"--activation_offloading to the recipe\.$"):
        check_fsdp_settings(FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True,
                                                           activation_checkpointing_offload=True))
    check_fsdp_settings(FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "zero3"])
def test_offloaded_runs_train_as_the_eager_run_and_move_each_tensor_once(runs, run_layout, small_model,
                                                                          session_root, engine):
    """The eager run (no checkpointing) and the checkpointed, offloaded one: the same losses and gradient norms
    (rel 1e-4, recomputation reorders nothing in fp32); at every step each tensor that went to the host came back
    exactly once, the 4 blocks' (4, 64, 256) inputs among them; the run counts 0 saved bytes on the device."""
    env = {**isolated_env(session_root), "ZERO_RECIPES_HARNESS_OFFLOAD_PROBE": "1"}
    run = runs(f"offloaded-{engine}", *EIGHT_STEPS, "--model", small_model, "--per_device_batch_size", "4",
               "--gradient_accumulation_steps", "1", "--gradient_checkpointing", "--activation_offloading",
               config=engine, num_processes=2, mixed_precision="no", env=env).check()
    eager = run_layout(engine, 2, 4, 1)
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in run.metrics()] == pytest.approx([m[key] for m in eager.metrics()], rel=1e-4), key
    assert "activation offloading: the checkpointed blocks' inputs copied to host memory and back" in run.output
    for moves in run.summary()["offload_moves_per_rank"]:
        assert sorted(moves, key=int) == [str(step) for step in range(1, 9)]
        for step in moves.values():
            assert step["out"] == step["back"] and step["out"]["4x64x256"] >= 4, step
    assert run.summary()["saved_activation_bytes"] == 0
