"""Shared test helpers. One helper owns process spawning (`launch`); runs are cached per session so one launch
serves many assertions (launches are the CI budget: docs/ARCHITECTURE.md)."""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Variables a user's shell or cluster often sets that change what the tests see: the suite runs as CI runs it
# whatever the caller set (a test, or `isolated_env` for launched runs, sets what it needs). Removed here, before
# anything imports huggingface_hub (which reads HF_HUB_OFFLINE once, at import), and kept out of every test by the
# autouse fixture `without_the_callers_variables`.
CALLER_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "WANDB_MODE", "TOKENIZERS_PARALLELISM")
for _name in CALLER_VARIABLES:
    os.environ.pop(_name, None)

import plain_loop  # noqa: E402
import pytest  # noqa: E402

# The launch ledger's hooks: every launch counted per test file against its budget in docs/TESTING.md, and every
# temporary and cache folder of the tests' processes under pytest's root (tests/launch_ledger.py).
from launch_ledger import (  # noqa: E402, F401
    RUN_NAME,
    note_shared_run,
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
)

from zero_utils.launch.launcher import accelerate_launch_command, config_file, free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "accelerate_configs"
HARNESS = REPO / "tests" / "scripts" / "harness.py"  # runs a recipe with probes attached (its docstring lists them)
ENGINE_CONFIGS = ["ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp2", "fsdp2_zero2", "fsdp2_offload"]


@dataclass
class Run:
    """A finished launch: its exit code, output and run directory."""

    returncode: int
    stdout: str
    stderr: str
    output_dir: Path

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.output_dir / "metrics.jsonl").read_text().splitlines()]

    def summary(self) -> dict:
        return json.loads((self.output_dir / "summary.json").read_text())

    def check(self) -> "Run":
        assert self.returncode == 0, f"launch failed ({self.returncode}):\n{self.output[-6000:]}"
        return self


def isolated_env(tmp_root: Path) -> dict:
    env = dict(os.environ)
    env.update({
        # An isolated HF home: no user default accelerate config, no Hub access, a private datasets cache.
        "HF_HOME": str(tmp_root / "hf_home"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore", "TQDM_MININTERVAL": "5",
        # The launched recipes import zero_utils from this checkout, whatever is installed.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    })
    env.pop("WANDB_API_KEY", None)
    return env


# Every recipe launch of the tests computes its loss in chunks of 40 tokens, unless the test passes its own
# --loss_chunk_tokens: fewer tokens than any micro-batch of the tests and no divisor of their row lengths (64, 128,
# 256), so each shared run goes through the chunked output head (the default 1024 would hold their rows whole).
LOSS_CHUNK = ("--loss_chunk_tokens", "40")
WHOLE_LOGITS = ("--loss_chunk_tokens", "0")  # the twin of a chunked run: the whole logits at once
LOSS_PROBE = {"ZERO_RECIPES_HARNESS_LOSS_PROBE": "1"}  # tests/scripts/loss_probe.py
# A CPU without native bf16 runs a bf16 launch in fp32 (zero_utils.run.accelerator.cpu_mixed_precision): the launches
# whose checks are about bf16 force it, so they check bf16 on every host (and cost more on an AVX2-only one). Every
# launch given mixed_precision="bf16" gets it; a test reading the shipped YAMLs' bf16 adds it.
CPU_BF16 = {"ZERO_RECIPES_CPU_BF16": "1"}


def sync_probe(step: int) -> dict:
    """The environment that probes optimizer step `step` for host syncs (tests/scripts/sync_probe.py): a step past
    the model-state measurements of steps 1-2, with a step after it, so that the window is one whole step."""
    return {"ZERO_RECIPES_HARNESS_SYNC_PROBE": str(step)}


def assert_one_host_sync(run: Run, forwards: int) -> None:
    """On every rank, the probed step made the one documented host sync (`distributed.reduce_step_values`: loss,
    gradient norm, peaks and stop flag cross to the host together), none other in our code, accelerate's or
    torch's, and no blocking host-to-device copy. transformers' model forward reads one value of its own per call,
    to find packed rows (`masking_utils.find_packed_sequence_indices`, even for plain position ids): `forwards`
    such calls in the step. DeepSpeed's own syncs are not counted (its engine's, not ours)."""
    from collections import Counter

    for rank, probed in enumerate(run.summary()["host_syncs_in_step_per_rank"]):
        assert probed["complete"], rank
        ours = [(s["call"], s["where"].split()[-1]) for s in probed["syncs"]
                if not s["where"].startswith(("transformers/", "deepspeed/"))]
        assert ours == [("tolist", "reduce_step_values")], (rank, probed["syncs"])
        theirs = Counter(s["where"].split()[-1] for s in probed["syncs"] if s["where"].startswith("transformers/"))
        assert theirs == {"find_packed_sequence_indices": forwards}, (rank, probed["syncs"])
        assert probed["host_to_device_copies"]["blocking"] == 0 and probed["host_to_device_copies"]["non_blocking"]


def launch(output_dir: Path, *recipe_args: str, config: str | None = None, num_processes: int | None = 2,
           mixed_precision: str | None = None, recipe: str = "recipes/llama_zero3.py", launch_args: tuple = (),
           env: dict | None = None, timeout: int = 600) -> Run:
    """Run a recipe the way users do: `accelerate launch [--config_file X] --num_processes N recipe flags...`;
    a recipe under recipes/ runs through tests/scripts/harness.py, which adds per-rank evidence to its summary."""
    env = env or isolated_env(output_dir.parent)
    if mixed_precision == "bf16":
        env = {**env, **CPU_BF16}
    script = REPO / recipe
    if recipe.startswith("recipes/"):  # a recipe runs unchanged, with the tests' probes attached from outside
        env, script = {**env, "ZERO_RECIPES_HARNESS_RECIPE": recipe}, HARNESS
        recipe_args = (*LOSS_CHUNK, *recipe_args)  # a flag the test gives comes later and wins
    cmd = accelerate_launch_command(script, ["--output_dir", output_dir, *recipe_args],
                                    config_file=config_file(config) if config else None, num_processes=num_processes,
                                    main_process_port=free_port(), mixed_precision=mixed_precision,
                                    launch_args=launch_args)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr, output_dir)


@pytest.fixture(scope="session", autouse=True)
def without_the_callers_variables():
    with pytest.MonkeyPatch.context() as patch:
        for name in CALLER_VARIABLES:
            patch.delenv(name, raising=False)
        yield


@contextmanager
def exclusive(path: Path):
    """One pytest process at a time inside (an advisory lock on `path`): under pytest-xdist, what the session
    fixtures write under `session_root` is written once, by the first worker that needs it, and read by the others."""
    import fcntl

    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_root(tmp_path_factory) -> Path:
    """This pytest run's temporary root, the same for every xdist worker (a worker's own is a folder inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def session_root(tmp_path_factory) -> Path:
    """The run-wide folder of shared launches and models, under `run_root`."""
    root = run_root(tmp_path_factory) / "runs"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def runs(session_root):
    """Run-wide cache of launches: `runs(name, **launch_kwargs)` launches once per name and returns the `Run`; under
    pytest-xdist the first worker to ask launches it and the others read what it saved (`<name>.run.json`)."""
    cache: dict[str, Run] = {}
    env = isolated_env(session_root)

    def get(name: str, *recipe_args: str, **kwargs) -> Run:
        if name in cache:
            note_shared_run(name)  # the ledger counts the run in every file that reads it
            return cache[name]
        saved = session_root / f"{name}.run.json"
        with exclusive(session_root / f"{name}.lock"):
            if saved.exists():
                note_shared_run(name)
                cache[name] = Run(**json.loads(saved.read_text()), output_dir=session_root / name)
            else:
                kwargs["env"] = {**kwargs.get("env", env), RUN_NAME: name}  # the ledger checks it launches once
                run = cache[name] = launch(session_root / name, *recipe_args, **kwargs)
                saved.write_text(json.dumps({"returncode": run.returncode, "stdout": run.stdout,
                                             "stderr": run.stderr}))
        return cache[name]

    return get


# The 8-step fp32 runs on a 3.3M-parameter model that the memory, equivalence and checkpoint tests share: global
# batch 8 rows of 64 tokens, checkpoints at steps 4 and 8, clipping at 0.5 active on every step; the plain loop
# (tests/plain_loop.py) trains the same steps in process (`layout_plain`).
EIGHT_STEPS_HYPER = plain_loop.Hyper(steps=8, global_batch=8, lr=2e-3, warmup=2, clip=0.5)
EIGHT_STEPS = (*EIGHT_STEPS_HYPER.flags(), "--save_every", "4")


def llama_from_config(path: Path, **sizes) -> str:
    """A Llama model folder with the bundled tokenizer and a config of `sizes` (hidden_size, ...), no weights (the
    recipes initialise them from the seed); written once per path, untied head, the tokenizer's vocabulary."""
    from transformers import AutoTokenizer, LlamaConfig

    with exclusive(path.with_name(path.name + ".lock")):
        if path.exists():
            return str(path)
        tokenizer = AutoTokenizer.from_pretrained(REPO / "zero_utils/assets/tiny-llama")
        LlamaConfig(vocab_size=len(tokenizer), **sizes, tie_word_embeddings=False,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def small_model(session_root) -> str:
    """A 3.3M-parameter Llama (hidden 256, 4 layers): big enough that engine buffers are noise."""
    return llama_from_config(session_root / "small-llama", hidden_size=256, intermediate_size=688,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=512)


@pytest.fixture(scope="session")
def layout_plain(small_model, tmp_path_factory):
    """The plain loop's (losses, gradient norms, trained model) for the shared 8-step runs, in process: the small
    model's folder holds only a config, so the weights are drawn from the seed as the recipe draws them."""
    return plain_loop.train(small_model, EIGHT_STEPS_HYPER, tmp_path_factory.mktemp("layout-plain-rows"))


@pytest.fixture(scope="session")
def run_layout(runs, small_model, session_root):
    """`run_layout(engine, world, per_device_batch, accumulation)`: the shared 8-step run of that layout
    ('single' = one process, no config); step 5 is probed for host syncs (`LAYOUT_SYNC_PROBE_STEP`)."""
    env = {**isolated_env(session_root), **sync_probe(LAYOUT_SYNC_PROBE_STEP)}

    def get(engine: str, world: int, batch: int, accumulation: int) -> Run:
        args = (*EIGHT_STEPS, "--model", small_model, "--per_device_batch_size", str(batch),
                "--gradient_accumulation_steps", str(accumulation))
        if engine == "single":
            return runs(f"zm-single-{batch}x{accumulation}", *args, num_processes=1, mixed_precision="no",
                        env=env).check()
        return runs(f"zm-{engine}-{world}-{batch}x{accumulation}", *args, config=engine, num_processes=world,
                    mixed_precision="no", env=env).check()
    return get


@pytest.fixture(scope="session")
def sft_defaults(runs, session_root) -> Run:
    """recipes/llama_zero3.py as the README runs it, fsdp2.yaml as shipped (bf16, 2 processes) and every flag at its
    default (150 steps on the bundled data, eval every 50) but no generation and no tracker, with Python's warnings
    shown as a user sees them: the learning and warning checks (tests/test_training.py) and the SFT half of the
    SFT-then-DPO flow (tests/test_dpo.py) read it."""
    return runs("sft-defaults", "--report_to", "none", "--max_new_tokens", "0", config="fsdp2",
                env={**isolated_env(session_root), "PYTHONWARNINGS": "default"}).check()


LAYOUT_SYNC_PROBE_STEP = 5  # of EIGHT_STEPS: no checkpoint (4, 8), no model-state measurement (1, 2)


def assert_chunked_equals_whole(chunked: Run, whole: Run, weights: str = "final/model.safetensors") -> None:
    """A run with the loss in chunks (`LOSS_CHUNK`) and its `--loss_chunk_tokens 0` twin trained alike (fp32).

    Chunking changes one thing: the head's weight gradient sums its tokens chunk by chunk, in another order. At step
    1 (the same weights) the gradient norms agree to 1e-7 (measured: <= 5e-9) and the losses to 2e-6 at every step
    (<= 8.5e-7). Over 8 Adam steps that rounding grows as any reduction order's does (tests/test_zero_math.py's
    engines against one process): later gradient norms within 1e-4 (4.8e-5 at a step whose norm doubles), final
    weights within 1e-4 (2.8e-5); a lost or double-counted chunk moves them by percents."""
    import torch
    from safetensors.torch import load_file

    got, want = chunked.metrics(), whole.metrics()
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=2e-6)
    assert got[0]["grad_norm"] == pytest.approx(want[0]["grad_norm"], rel=1e-7)
    assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in want], rel=1e-4)
    tensors, ref_tensors = load_file(chunked.output_dir / weights), load_file(whole.output_dir / weights)
    assert tensors.keys() == ref_tensors.keys()
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor, ref_tensors[name], rtol=0, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="session")
def base_model(session_root) -> str:
    """The bundled tiny Llama with saved (random) weights: a base that reloads identically, for LoRA runs whose
    adapter is reloaded on it (tests/test_lora.py, tests/test_dpo_lora.py)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = session_root / "lora-base"
    with exclusive(session_root / "lora-base.lock"):
        if path.exists():
            return str(path)
        torch.manual_seed(0)
        bundled = REPO / "zero_utils/assets/tiny-llama"
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(bundled)).save_pretrained(path)
        AutoTokenizer.from_pretrained(bundled).save_pretrained(path)
    return str(path)
