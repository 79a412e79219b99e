"""The errors a user mends: a setting, a file, a row, or an earlier stage not yet run.

Their message names what to mend and how; `draftsmith <command>` prints it alone, without the
traceback Hydra would put above it. Any other exception is a bug or a library's failure and keeps
its traceback.
"""

from __future__ import annotations


class InputError(ValueError):
    """A bad setting, file or row; the message names it and what to do."""


class MissingInput(InputError, FileNotFoundError):
    """A file or folder a setting names, or an earlier stage's output, is not there."""
