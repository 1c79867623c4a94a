"""The one base class of every expected failure, carrying the exit code it ends a command with.

An expected failure is bad input or a state of the world the user can fix: the
message says what is wrong and what to do, and the command exits with
``exit_code`` and no traceback. Anything else is a bug and keeps its traceback.
The host tasks (tasks.py) and the trainer (astrai/trainer/run/loop.py) each catch
this one class.
"""

from __future__ import annotations

import os
import sys


class AstraiError(Exception):
    """An expected failure; ``exit_code`` is what the command exits with: ``code`` if given, else the class's (1)."""

    exit_code = 1
    prefix = "error: "
    """How the message is shown: configuration problems name their file and key themselves."""

    def __init__(self, message: str = "", code: int | None = None):
        super().__init__(message)
        if code is not None:
            self.exit_code = code

    def show(self) -> str:
        return f"{self.prefix}{self}"


def detach_stdout() -> None:
    """After a BrokenPipeError (``... | head -1``): point stdout at nothing, so that Python's own flush at exit
    does not report the closed pipe again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
