"""The exceptions a recipe prints as one line, without a traceback: `UserError` for mistakes a user can fix (a
path, a column, a flag), `TrainingStopped` for a run that stopped on purpose. No imports."""


class UserError(Exception):
    """A problem in the user's input: the message names the value and the fix, and is printed without a traceback."""


class TrainingStopped(Exception):
    """Training stopped on purpose (e.g. the loss diverged): the message says why and what was kept."""


def non_finite_loss(loss: float, step: int, bad_steps: int, max_bad_steps: int, newest_checkpoint) -> TrainingStopped:
    """The `TrainingStopped` of a run whose loss stayed non-finite past `--max_bad_steps`: what happened, what was
    kept (`newest_checkpoint`, a path or None) and what to do."""
    return TrainingStopped(
        f"the loss became {loss} at step {step} ({bad_steps} non-finite step(s), --max_bad_steps {max_bad_steps}); "
        f"stopped without saving, the last good checkpoint is {newest_checkpoint or 'none'}. Lower --lr or check "
        "the data, then --resume auto.")
