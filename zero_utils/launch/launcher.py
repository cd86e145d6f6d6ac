"""`accelerate launch` command lines, built in one place for the tests, the benchmarks and the compare CLI.

`accelerate_launch_command` returns the argv list (run with `subprocess`); launcher options come first, in a fixed
order, then the script and its flags. `shown_command` turns that list into the line a user types. `free_port` gives
each launch a rendezvous port of its own: launches that share accelerate's default 29500 (two test sessions, or a
test and a run by hand) join each other's rendezvous.
Imports only zero_utils.launch.shipped (where the YAMLs are).
"""

from __future__ import annotations

import shlex
import socket
import sys
from pathlib import Path

from zero_utils.launch.shipped import shipped

# `python -m` of this module is `accelerate launch` run by a chosen interpreter (the console script may belong to
# another environment).
LAUNCH_MODULE = "accelerate.commands.launch"


def config_file(name: str) -> Path:
    """The shipped accelerate YAML `accelerate_configs/<name>.yaml` (no check that it exists), wherever the package
    was installed from (`shipped.shipped`)."""
    return shipped("accelerate_configs") / f"{name}.yaml"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no process listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelerate_launch_command(script: str | Path, script_args=(), *, config_file: str | Path | None = None,
                              num_processes: int | None = None, main_process_port: int | None = None,
                              mixed_precision: str | None = None, launch_args=(),
                              python: str = sys.executable) -> list[str]:
    """`python -m accelerate.commands.launch [--config_file F] [--num_processes N] [--main_process_port P]
    [--mixed_precision M] [launch_args...] script [script_args...]`, each option only when given.

    Args:
        script: the recipe (or any script) to launch; `script_args` its flags.
        config_file: an accelerate YAML (see `config_file(name)` for the shipped ones); None = accelerate's default.
        num_processes, main_process_port, mixed_precision: accelerate launch's options of the same names.
        launch_args: further accelerate launch options, e.g. ("--max_restarts", "1").
        python: the interpreter (default: this one, so the launch uses this environment's packages).
    """
    cmd = [python, "-m", LAUNCH_MODULE]
    if config_file is not None:
        cmd += ["--config_file", str(config_file)]
    if num_processes is not None:
        cmd += ["--num_processes", str(num_processes)]
    if main_process_port is not None:
        cmd += ["--main_process_port", str(main_process_port)]
    if mixed_precision:
        cmd += ["--mixed_precision", mixed_precision]
    return cmd + [str(a) for a in launch_args] + [str(script)] + [str(a) for a in script_args]


def shown_command(cmd: list[str]) -> str:
    """An `accelerate_launch_command` list as a user types it: `accelerate launch ...`, shell-quoted."""
    if cmd[1:3] != ["-m", LAUNCH_MODULE]:
        raise ValueError(f"not an accelerate_launch_command list: {cmd[:3]}")
    return shlex.join(["accelerate", "launch", *cmd[3:]])
