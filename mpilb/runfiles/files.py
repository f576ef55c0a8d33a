"""The names and the writing of the files a run leaves, shared by every part that touches
them: the checkpoint beside its log, and output files replaced in place (never written
through a link). Only the standard library."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mpilb.errors import UsageError


def default_checkpoint(log: str) -> str:
    """The checkpoint beside a log: `runs/003.h5` -> `runs/003.ckpt.h5`."""
    p = Path(log)
    stem = p.name[: -len(p.suffix)] if p.suffix in (".h5", ".hdf5") else p.name
    return str(p.with_name(stem + ".ckpt.h5"))


def replace_file(path, write, what: str, text: bool = False) -> None:
    """Write an output file (an export, a report's CSV or figure) beside ``path`` and rename
    it into place: a failure leaves what was there, and a symbolic link at ``path`` is
    replaced itself, never written through (an output directory someone else can write to
    could hold a link to any file of the user's).

    Args:
        path: the file to (re)write.
        write: ``write(fh)`` writes the contents into the open file.
        what: the file's name in a message (the option and path), e.g. ``"--csv out"``.
        text: open it as UTF-8 text (else binary).

    Raises:
        UsageError: the file cannot be written there (the message names ``what``).
    """
    p = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    except OSError as exc:
        raise UsageError(f"{what}: cannot write in {p.parent} ({exc.strerror or exc})") from None
    try:
        with (os.fdopen(fd, "w", newline="", encoding="utf-8") if text else os.fdopen(fd, "wb")) as fh:
            write(fh)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)   # mkstemp's 0600 -> what open() would have given
        os.replace(tmp, p)
    except OSError as exc:
        raise UsageError(f"{what}: cannot write {p.name} ({exc.strerror or exc})") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
