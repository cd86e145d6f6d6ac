"""recipes/llama_lora.py: PEFT LoRA under DDP, FSDP2 and DeepSpeed ZeRO-3. Only the adapters train (their
gradients and optimizer state are all the model states add), and the saved adapter and merged model reproduce
the trained model's logits."""

from __future__ import annotations

import pytest
import torch
from conftest import WHOLE_LOGITS, assert_chunked_equals_whole
from safetensors.torch import load_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


LORA_ARGS = ("--max_steps", "6", "--save_every", "4", "--seq_len", "64", "--lora_dropout", "0", "--eval_fraction", "0",
             "--max_new_tokens", "0", "--report_to", "none", "--merge", "--device_memory", "1TB")


def lora_run(runs, base_model: str, engine: str, *extra: str, name: str | None = None):
    """6 steps of LoRA on 2 ranks, fp32, a checkpoint at step 4 (and the final one at 6), its fit check planned for
    1 TB per rank."""
    return runs(name or f"lora-{engine}", "--model", base_model, *LORA_ARGS, *extra, recipe="recipes/llama_lora.py",
                config=engine, mixed_precision="no").check()


@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "zero3"])
def test_lora_trains_only_adapters_and_reloads_to_the_same_logits(runs, base_model, engine):
    """ZeRO-3: accelerate's 'auto' persistence threshold (10 x hidden = 1280 elements) is below every LoRA matrix
    (16 x 128 = 2048), so the adapters are partitioned like any parameter: an adapter saved without gathering
    would be empty (DeepSpeed's known failure), which the logits check would catch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zero_utils.data import sft_examples

    run = lora_run(runs, base_model, engine)
    summary = run.summary()
    assert 0 < summary["num_params"] < 0.2 * summary["frozen_params"]  # only the adapters are trainable
    assert summary["model_state_bytes"] == pytest.approx(summary["model_state_bytes_expected"], rel=0.01)
    adapter = load_file(run.output_dir / "final" / "adapter_model.safetensors")
    assert adapter and all(t.numel() > 0 for t in adapter.values())

    tokenizer = AutoTokenizer.from_pretrained(run.output_dir / "final")
    prompt = sft_examples.render_prompt(tokenizer, [{"role": "user", "content": summary["prompt"]}])
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    expected = load_file(run.output_dir / "probe_logits.safetensors")["logits"]
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), run.output_dir / "final")
    merged = AutoModelForCausalLM.from_pretrained(run.output_dir / "final" / "merged")
    with torch.no_grad():
        for model in (reloaded, merged):
            logits = model.eval()(input_ids=ids, use_cache=False).logits[0, -1]
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_lora_resumed_at_step_4_continues_as_if_never_stopped(runs, base_model, engine):
    """Sharded adapters are saved and restored whole: a known failure elsewhere (accelerate PR #4206) saves only
    rank 0's slice, so after a resume (N-1)/N of each adapter silently reverts. Here every adapter element differs
    per rank's slice after 4 steps (B starts at zero and trains); resumed from step 4, steps 5-6 and the final
    adapter equal the uninterrupted run's."""
    whole = lora_run(runs, base_model, engine)
    resumed = lora_run(runs, base_model, engine, "--resume", str(whole.output_dir / "checkpoints" / "step_4"),
                       name=f"lora-{engine}-resumed-at-4")
    assert [m["step"] for m in resumed.metrics()] == [5, 6]
    assert [m["loss"] for m in resumed.metrics()] == pytest.approx([m["loss"] for m in whole.metrics()[4:]],
                                                                   rel=1e-6)
    adapter = load_file(whole.output_dir / "final" / "adapter_model.safetensors")
    resumed_adapter = load_file(resumed.output_dir / "final" / "adapter_model.safetensors")
    assert adapter.keys() == resumed_adapter.keys()
    for name, tensor in adapter.items():
        if "lora_B" in name:
            assert tensor.abs().min() > 0, name  # trained everywhere: a reverted slice would be zeros again
        torch.testing.assert_close(resumed_adapter[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_lora_chunked_loss_trains_as_the_whole_logits(runs, base_model):
    """LoRA under ZeRO-3 with the loss in chunks (PEFT wraps the model; the head is the base's, frozen and
    partitioned) trains the adapters as the whole logits do: the same losses, gradient norms and final adapter."""
    chunked = lora_run(runs, base_model, "zero3")
    whole = lora_run(runs, base_model, "zero3", *WHOLE_LOGITS, name="lora-zero3-whole")
    assert_chunked_equals_whole(chunked, whole, weights="final/adapter_model.safetensors")


def test_lora_fit_check_trains_only_the_adapters_in_its_estimate(runs, base_model, capsys):
    """The fit check's estimate of a LoRA run (kept in summary.json) is `python -m zero_utils.memory` with
    --lora_fraction = the adapters' parameters over the base's, counted here on a real PEFT model; the run started
    under the generous --device_memory 1TB."""
    import json

    from conftest import LOSS_CHUNK
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from zero_utils.memory import command as memory

    summary = lora_run(runs, base_model, "fsdp2").summary()
    base = AutoModelForCausalLM.from_pretrained(base_model)
    base_params = sum(p.numel() for p in base.parameters())
    peft_model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    fraction = sum(p.numel() for p in peft_model.parameters() if p.requires_grad) / base_params
    assert 0 < fraction < 0.2
    assert memory.main(["--model", base_model, "--num_gpus", "2", "--dtype", "fp32", "--seq_len", "64",
                        "--micro_batch_size", "4", "--loss_chunk_tokens", LOSS_CHUNK[1], "--lora_fraction",
                        repr(fraction), "--engines", "fsdp2", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)["engines"][0]["total_bytes"]
    assert summary["peak_mem_bytes_estimated"] == expected
    assert summary["fit_check"]["capacity_bytes"] == 10**12 and summary["fit_check"]["status"] == "fits"
    assert summary["fit_check"]["capacity_source"] == "--device_memory"


def test_merge_of_a_config_only_base_is_the_trained_model(runs, tmp_path):
    """The bundled model holds only a config, so the run draws its base from the seed; --merge must merge the
    adapters into that base, not into another draw: final/merged/, loaded with transformers alone, gives the run's
    held-out rows (computed here) the run's own final eval loss (FSDP2, fp32)."""
    import plain_loop
    from transformers import AutoModelForCausalLM

    from zero_utils.assets import BUNDLED_MODEL

    run = runs("lora-fsdp2-config-only-merge", "--max_steps", "3", "--seq_len", "64", "--lora_dropout", "0",
               "--max_new_tokens", "0", "--report_to", "none", "--merge", "--per_device_batch_size", "4",
               recipe="recipes/llama_lora.py", config="fsdp2", mixed_precision="no").check()
    merged_dir = str(run.output_dir / "final" / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    _, eval_rows = plain_loop.bundled_rows(BUNDLED_MODEL, merged, 64, 42, 0.05, tmp_path / "rows")
    assert plain_loop.mean_token_loss(merged, eval_rows) == pytest.approx(run.summary()["eval_loss"], rel=1e-5)


def test_the_summary_and_the_tracker_config_keep_their_keys(runs, base_model):
    """Issue 71: summary.json and the W&B config of a LoRA run hold exactly the keys the recipe wrote itself before
    the bookkeeping moved into the tracker (tests/record_keys.py)."""
    from record_keys import assert_record_keys

    assert_record_keys(lora_run(runs, base_model, "fsdp2"), "llama_lora")
