"""Exceptions that map to mpilb's exit codes (docs/cli.md: 2 usage/config/data, 1 other)."""

import os
import traceback


class MpilbError(Exception):
    """Base class for errors mpilb reports as one clear line."""

    exit_code = 1


class UsageError(MpilbError):
    """Bad command line, config file or option value (exit code 2)."""

    exit_code = 2


class DataError(UsageError):
    """A dataset that is missing, corrupt or inconsistent (exit code 2).

    The message names the offending file.
    """


def report_exception(exc: BaseException, rank: int) -> str:
    """One line for an unexpected exception (the traceback with MPILB_DEBUG=1)."""
    if os.environ.get("MPILB_DEBUG"):
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    return f"{type(exc).__name__}: {exc}"
