"""The full check of a dataset's files (:func:`verify_dataset`: checksums, labels, values), and
the records of the files that passed it, so that a start does not re-hash them.

Hashing every shard at every start costs about 3 s per GB (47 min per TB), paid again on
every requeue. A file whose full check passed (SHA-256 against the manifest, labels in
range, finite features) is recorded with its (path, size, mtime, inode); a later start
that finds the same four values, and the same manifest digest, trusts the record and skips
the check. ``mpilb data verify`` always checks everything (and refreshes the records).

A record is kept beside the dataset (``DIR/.mpilb-verified.json``) so that every user of
the dataset benefits, or, when that directory is not writable, under
``$MPILB_CACHE/verified/``. As in git's index, a file modified within ``RACY_S`` seconds
before it was hashed is not trusted later: file-system timestamps are coarse (up to 2 s),
so a second change in the same tick would leave (size, mtime, inode) as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Optional

from mpilb.config.options import default_cache_dir
from mpilb.data.dataset import (Dataset, _all_files, check_h5_layout, check_values, open_dataset,
                                open_h5, sha256_file)
from mpilb.errors import DataError

CACHE_NAME = ".mpilb-verified.json"
RACY_S = 2.0
# Rows read at a time in a file's value check: memory stays small whatever the file's size.
CHECK_BYTES = 16 << 20


def _user_cache_path(root: Path) -> Path:
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:24]
    return default_cache_dir() / "verified" / f"{digest}.json"


def _stat_key(path: Path) -> Optional[dict]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


class VerifiedFiles:
    """The verification records of one dataset directory.

    Args:
        root: the dataset directory.
    """

    def __init__(self, root):
        self.root = Path(root).resolve()
        self.paths = (self.root / CACHE_NAME, _user_cache_path(self.root))
        self.entries: dict[str, dict] = {}
        for p in reversed(self.paths):   # beside the dataset wins
            self.entries.update(self._read(p))
        self._pending: dict[str, tuple[dict, int]] = {}
        self.changed = False

    @staticmethod
    def _read(path: Path) -> dict:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        files = data.get("files") if isinstance(data, dict) else None
        return files if isinstance(files, dict) else {}

    def trusted(self, path: Path, sha256: str) -> bool:
        """True when `path` passed a full check and has not changed since."""
        entry = self.entries.get(str(Path(path).resolve()))
        key = _stat_key(path)
        if not entry or key is None or entry.get("sha256") != sha256:
            return False
        if any(entry.get(k) != v for k, v in key.items()):
            return False
        return key["mtime_ns"] < int(entry.get("verified_ns", 0)) - RACY_S * 1e9

    def begin(self, path: Path) -> None:
        """Note the file's identity before checking it (a change during the check shows)."""
        key = _stat_key(path)
        if key is not None:
            self._pending[str(Path(path).resolve())] = (key, time.time_ns())

    def passed(self, path: Path, sha256: str) -> None:
        """The full check of `path` (begun with :meth:`begin`) passed."""
        name = str(Path(path).resolve())
        key, started = self._pending.pop(name, (None, 0))
        if key is None or _stat_key(path) != key:
            return
        self.entries[name] = {"sha256": sha256, **key, "verified_ns": started}
        self.changed = True

    def save(self) -> Optional[Path]:
        """Write the records (beside the dataset, else in $MPILB_CACHE); None when neither
        is writable: the next start then checks again, which is slower but still right."""
        if not self.changed:
            return None
        mine = {k: v for k, v in self.entries.items() if Path(k).parent == self.root}
        text = json.dumps({"root": str(self.root), "files": mine}, indent=1, sort_keys=True)
        for path in self.paths:
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, path)   # atomic: concurrent starts never see half a file
                self.changed = False
                return path
            except OSError:
                try:
                    tmp.unlink()
                except OSError:
                    pass
        return None


def verify_dataset(root, cached: bool = False) -> Dataset:
    """Fully verify a dataset: manifest, layout, checksums, labels and feature values.

    Files are hashed in blocks and read chunk by chunk (memory stays small whatever the
    dataset's size); every file that passes is recorded (:class:`VerifiedFiles`).

    Args:
        root: the dataset directory.
        cached: skip every check of the files recorded as passed that have not changed since
            (same path, size, mtime, inode): `mpilb train`; `mpilb data verify` checks all.

    Returns: the :class:`Dataset` when everything checks out.

    Raises:
        DataError: naming the first bad file and its problem, e.g.
            ``shard-00003.h5: checksum mismatch (manifest sha256 ab12..., file cd34...)``.
    """
    ds = open_dataset(root, check_files=False)
    verify_files(ds, _all_files(ds), cached)
    return ds


def verify_files(ds: Dataset, files, cached: bool = False,
                 fix: str = "the file was modified or damaged, re-run `mpilb prepare`") -> None:
    """:func:`verify_dataset`'s checks of `files`, (name, samples, sha256) in `ds`'s directory
    (the checksum another manifest's, for a node-local copy); `fix`: what a mismatch advises."""
    records = VerifiedFiles(ds.root)
    rows = max(1, CHECK_BYTES // ds.row_nbytes)
    try:
        for name, samples, sha in files:
            path = ds.root / name
            if cached and records.trusted(path, sha):
                continue   # unchanged since it passed: layout, checksum and values
            records.begin(path)
            with open_h5(path) as f:
                check_h5_layout(f, path, samples, ds.sample_shape, ds.label_dtype, ds.target_shape)
            _check_file(ds, path, samples, sha, rows, fix)
            records.passed(path, sha)
    finally:
        records.save()   # what passed stays recorded, even when a later file fails


def _check_file(ds: Dataset, path: Path, samples: int, sha: str, rows: int, fix: str) -> None:
    """Checksum, then labels and feature values, of one file; DataError naming it."""
    actual = sha256_file(path)
    if actual != sha:
        raise DataError(f"{path}: checksum mismatch (manifest sha256 {sha[:12]}..., file "
                        f"{actual[:12]}...); {fix}")
    with open_h5(path) as f:
        x_ds, y_ds = f["x"], f["y"]
        for lo in range(0, samples, rows):
            hi = min(samples, lo + rows)
            try:
                x, y = x_ds[lo:hi], y_ds[lo:hi]
            except (OSError, RuntimeError) as exc:
                raise DataError(f"{path}: cannot read rows {lo}-{hi} ({exc}); truncated?") from exc
            check_values(path, x, y, ds.num_classes, first_row=lo)
