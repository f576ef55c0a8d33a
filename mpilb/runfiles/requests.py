"""Requests to a running job through files beside its run log: `mpilb leave` and `mpilb
join` write them, rank 0 answers among its chores (server/roster.py, server/admission.py).
No MPI: the commands reach the job from any shell that sees the log's directory."""

from __future__ import annotations

import os
from typing import Optional

LEAVE_PREFIX = "leave-"     # a request file: leave-R (its answer: leave-R.answer)
JOIN_PREFIX = "join-"       # join-PID (see server/admission.py for the handshake)
ANSWER_SUFFIX = ".answer"


def requests_dir(log_path: str) -> str:
    """Where requests to a running job go: a directory beside its run log (owner only)."""
    return f"{log_path}.requests"


def write_atomically(path: str, text: str) -> None:
    """Write `text` to `path` (owner-only permissions) so that a reader never sees half."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def answer_of(path: str) -> Optional[str]:
    """The answer to the request at `path`, if rank 0 gave it."""
    try:
        with open(path + ANSWER_SUFFIX) as fh:
            return fh.read().strip()
    except OSError:
        return None
