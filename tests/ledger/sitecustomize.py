"""The launch ledger's recorder, in every Python process a test starts (tests/launch_ledger.py puts this folder first
on PYTHONPATH, so Python imports it at start-up, before the process's own code).

It does nothing unless ZERO_RECIPES_LAUNCH_LEDGER names a file. Then:
- a launcher (`accelerate launch`, `python -m accelerate.commands.launch`, `torchrun`, `python -m
  torch.distributed.run`) appends a `launch` line when it starts and an `end` line with its seconds when it exits,
  and tells its children who it is (ZERO_RECIPES_LAUNCH_ID, ZERO_RECIPES_LAUNCHER_PID);
- a process that launcher started (a rank, or the one process of a single-process launch) appends a `process` line.
Whoever started the launcher (a test, a benchmark, the compare CLI, a copied recipe's launch) needs no change: the
variables reach every process a test starts. Lines are single `write`s to a file opened for appending, so the
processes of one launch never interleave within a line. Standard library only, and only when the ledger is on.
"""

import os
import sys


def _is_launcher() -> bool:
    """Whether this process is a launcher, from its command line."""
    if sys.argv and sys.argv[0] == "-m":  # `python -m module`: the module is in the original command line
        argv = getattr(sys, "orig_argv", [])
        module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
        return module in ("accelerate.commands.launch", "torch.distributed.run", "torch.distributed.launch")
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return script == "accelerate" and sys.argv[1:2] == ["launch"] or script in ("accelerate-launch", "torchrun")


def _append(record: dict) -> None:
    import json

    line = (json.dumps(record) + "\n").encode()
    fd = os.open(os.environ["ZERO_RECIPES_LAUNCH_LEDGER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _record() -> None:
    import time

    if _is_launcher():
        import atexit

        started, launch_id = time.time(), f"{os.getpid()}-{time.time_ns()}"
        _append({"event": "launch", "id": launch_id, "time": started,
                 "run": os.environ.get("ZERO_RECIPES_LEDGER_RUN"), "argv": sys.argv[1:]})
        os.environ.update(ZERO_RECIPES_LAUNCH_ID=launch_id, ZERO_RECIPES_LAUNCHER_PID=str(os.getpid()))
        atexit.register(lambda: _append({"event": "end", "id": launch_id, "seconds": time.time() - started}))
    elif os.environ.get("ZERO_RECIPES_LAUNCHER_PID") == str(os.getppid()):
        _append({"event": "process", "launch": os.environ["ZERO_RECIPES_LAUNCH_ID"], "pid": os.getpid()})


if os.environ.get("ZERO_RECIPES_LAUNCH_LEDGER"):
    _record()
