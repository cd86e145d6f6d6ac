"""Shared test helpers. One helper owns process spawning (`launch`); runs are cached per session so one launch
serves many assertions (launches are the CI budget: DESIGN.md section 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "accelerate_configs"
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


def launch(output_dir: Path, *recipe_args: str, config: str | None = None, num_processes: int | None = 2,
           mixed_precision: str | None = None, recipe: str = "recipes/llama_zero3.py", launch_args: tuple = (),
           env: dict | None = None, timeout: int = 600) -> Run:
    """Run a recipe the way users do: `accelerate launch [--config_file X] --num_processes N recipe flags...`."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if config:
        cmd += ["--config_file", str(CONFIGS / f"{config}.yaml")]
    if num_processes is not None:
        cmd += ["--num_processes", str(num_processes)]
    if mixed_precision:
        cmd += ["--mixed_precision", mixed_precision]
    cmd += list(launch_args) + [str(REPO / recipe), "--output_dir", str(output_dir), *recipe_args]
    proc = subprocess.run(cmd, cwd=REPO, env=env or isolated_env(output_dir.parent), capture_output=True, text=True,
                          timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr, output_dir)


@pytest.fixture(scope="session")
def session_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def runs(session_root):
    """Session cache of launches: `runs(name, **launch_kwargs)` launches once per name and returns the `Run`."""
    cache: dict[str, Run] = {}
    env = isolated_env(session_root)

    def get(name: str, *recipe_args: str, **kwargs) -> Run:
        if name not in cache:
            cache[name] = launch(session_root / name, *recipe_args, env=env, **kwargs)
        return cache[name]

    return get
