"""Exceptions that map to mpilb's exit codes (DESIGN.md: 2 usage/config/data, 1 other)."""


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
