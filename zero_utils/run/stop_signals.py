"""Stop signals: SIGTERM (preemption), SIGINT (Ctrl-C) and SIGUSR1 (SLURM's --signal warning) become a request to
stop at the next step boundary: the checkpoint manager (zero_utils.checkpoint.policy.Checkpointer.save) saves and tells
the loop to end. Catching is local to a process; the ranks agree on a stop through the step's one collective
(zero_utils.train.measurement.RunMeasurements.end_step).

torchrun forwards a signal sent to the launcher to every worker and kills them after its 30 s grace period, so
the save that follows must fit in that time (docs/CPU.md). No zero_utils imports.
"""

from __future__ import annotations

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
_received: list[str] = []


def catch_stop_signals() -> None:
    """From now on, SIGTERM, SIGINT and SIGUSR1 are recorded (see `received`) instead of ending the process."""
    import signal

    def handler(signum, _frame):
        _received.append(signal.Signals(signum).name)

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), handler)


def received() -> str | None:
    """The name of the first stop signal this process received, or None. Local: no collective."""
    return _received[0] if _received else None
