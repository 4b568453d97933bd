"""Refusals that name the options they concern. `options` are option names (a
DLLMProcessorConfig field or a keyword of run_offline: "model", "output", "id_column");
str() adds them as the command line's flags, which is what the CLI prints; a library
caller reads `message` and `options` and never sees a flag. Also `UserFunctionError`:
the caller's own preprocess or postprocess raised (pipeline/failures.py counts both as
the user's to fix, not as bugs in blockray)."""
from __future__ import annotations

import re


def flag(option: str) -> str:
    """The command line's flag of an option name."""
    return "--" + option.replace("_", "-")


class OptionError(Exception):
    def __init__(self, message: str, *options: str):
        super().__init__(message, *options)
        self.message, self.options = message, options

    def __str__(self) -> str:
        flags = [f for f in map(flag, self.options)  # unless the message names it (--input, not --input-format)
                 if not re.search(re.escape(f) + r"(?![\w-])", self.message)]
        return f"{self.message} ({', '.join(flags)})" if flags else self.message


class JobError(OptionError, RuntimeError):
    """The job cannot run (or did not finish); the message says why and what to change."""


class CheckpointRefused(OptionError, ValueError):
    """A one-line reason the model (or adapter) cannot be served as given."""


class UserFunctionError(RuntimeError):
    """The caller's own `preprocess` or `postprocess` function raised; the message names
    which one and what it raised (the original is its __cause__ and, past Ray, in the
    remote traceback), so that it reads as the caller's to fix, not as blockray's."""
