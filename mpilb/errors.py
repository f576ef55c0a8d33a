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


class LogWriteError(MpilbError):
    """The run log cannot be written (a full disk, a lost file system): the run ends, after
    a checkpoint where one can be written (its disk may have room where the log's has none)."""

    def __init__(self, path: str, exc: BaseException):
        import os
        import re
        from pathlib import Path

        try:
            st = os.statvfs(Path(path).resolve().parent)
            free = f"; {st.f_bavail * st.f_frsize / 1e6:.1f} MB free there"
        except OSError:
            free = ""
        text = str(exc)   # h5py's RuntimeError quotes the system's message deep inside
        quoted = re.search(r"error message = '([^']+)'", text)
        reason = getattr(exc, "strerror", None) or (quoted.group(1) if quoted else
                                                   text.splitlines()[0] if text else repr(exc))
        super().__init__(f"--log {path}: cannot write the run log ({reason}{free})")
