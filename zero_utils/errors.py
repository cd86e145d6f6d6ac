"""The one exception type for mistakes a user can fix (a path, a column, a flag): recipes print it as one line."""


class UserError(Exception):
    """A problem in the user's input: the message names the value and the fix, and is printed without a traceback."""


class TrainingStopped(Exception):
    """Training stopped on purpose (e.g. the loss diverged): the message says why and what was kept."""
