"""The run log: one HDF5 file per run, written by rank 0 (schema in docs/logs.md).

Rows are buffered in memory and appended to chunked, resizable 1-D column datasets at most
every `flush_interval` seconds, so logging costs a few numpy appends per update. The file is
written in SWMR mode: HDF5 then orders its metadata writes so that a run killed at any moment
(even with SIGKILL) leaves a file that h5py opens, with every row up to the last flush.
Root attributes that change at the end (status, summary) are written after the SWMR writer
is closed, by reopening the file normally.
"""

from __future__ import annotations

import csv
import fcntl
import json
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import h5py
import numpy as np

from mpilb import __version__
from mpilb.errors import LogWriteError, MpilbError, UsageError
from mpilb.runfiles.files import default_checkpoint, replace_file

SCHEMA: dict[str, dict[str, str]] = {
    "updates": {"t": "f8", "worker": "i4", "version": "i8", "staleness": "i4", "batch": "i4",
                "loss": "f4", "lr_scale": "f4", "epoch": "i4", "shard": "i4", "lo": "i4",
                "hi": "i4"},
    "workers": {"t": "f8", "worker": "i4", "samples": "i8", "compute_s": "f8", "io_s": "f8",
                "comm_s": "f8", "idle_s": "f8", "batch": "i4", "rate": "f8",
                "predicted_rate": "f8", "throughput": "f8"},
    "eval": {"t": "f8", "version": "i8", "epoch": "i4", "test_loss": "f8", "test_accuracy": "f8",
             "test_metric": "f8", "val_metric": "f8"},
    "shards": {"t": "f8", "epoch": "i4", "shard": "i4", "src": "i4", "dst": "i4", "event": "S10",
               "bytes": "i8"},
    "epochs": {"epoch": "i4", "t_start": "f8", "t_end": "f8", "samples": "i8",
               "utilization": "f8", "imbalance_s": "f8"},
    "servers": {"t": "f8", "server": "i4", "updates": "i8", "bytes_in": "i8", "bytes_out": "i8",
                "apply_s": "f8", "cpu_s": "f8"},
    "members": {"t": "f8", "worker": "i4", "node": "i4", "event": "S8"},
}

MEMBER_EVENTS = ("join", "leave", "lost", "respawn")

SHARD_EVENTS = ("assign", "move", "start", "done", "reassign")
STATUSES = ("running", "finished", "degraded", "preempted", "failed")


# columns whose absence must not read as a value (a metric of 0 would be a real result)
_NOT_GIVEN = {"test_metric": float("nan"), "val_metric": float("nan")}


class RunLog:
    """Append-only HDF5 run log.

    Args:
        path: file to create (replaced if it exists: the caller decides whether it may be,
            see `paths.check_paths`); refused while another run holds its lock.
        attrs: root attributes to write at creation (config, world_size, ...).
        flush_interval: seconds between flushes to disk.
        resume_at: when resuming from a checkpoint taken at this many training seconds,
            continue the existing log at `path` (rows after that time are dropped: their
            work is done again) instead of starting a new one.
    """

    def __init__(self, path: str, attrs: dict, flush_interval: float = 2.0,
                 resume_at: Optional[float] = None, checkpoint: Optional[str] = None,
                 completed: Optional[list] = None):
        self.path = str(path)
        self.flush_interval = flush_interval
        self.run_id = str(attrs.get("run_id", ""))
        parent = Path(self.path).resolve().parent
        if not parent.is_dir():
            raise UsageError(f"--log {self.path}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise UsageError(f"--log {self.path}: directory {parent} is not writable")
        self._locks: list[int] = []
        self._lock_files: list[str] = []
        if checkpoint:          # one run per checkpoint (first: a refusal creates no log)
            self._lock(_lock_file(checkpoint), f"--checkpoint {checkpoint}", "checkpoint")
        self._lock(self.path)   # before anything is read or written: one writer per log
        carried = self._carry_over(resume_at, completed) if resume_at is not None else None
        self.carried_samples = int(np.sum(carried[1]["updates"]["batch"])) if carried else 0
        if carried is None and checkpoint and Path(checkpoint).is_file():
            _discard_replaced(checkpoint)   # --overwrite: the replaced run's weights go too
        # A resumed run's log is rebuilt beside the old one and renamed over it, so that a
        # kill during the rebuild leaves the old log intact.
        target = self.path if carried is None else f"{self.path}.resume{os.getpid()}"
        if carried is not None:
            self._lock(target)
        try:
            self._file = h5py.File(target, "w", libver="latest", locking=False)
        except OSError as exc:
            raise UsageError(f"--log {self.path}: cannot create the run log ({exc})") from None
        f = self._file
        f.attrs["mpilb_version"] = __version__
        f.attrs["start_time"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        for key, value in attrs.items():
            f.attrs[key] = value
        if carried is not None:   # keep the first start time, count the resumptions
            f.attrs["start_time"] = carried[0].get("start_time", f.attrs["start_time"])
            f.attrs["resumed"] = int(carried[0].get("resumed", 0)) + 1
            f.attrs["resumed_at"] = json.dumps(json.loads(carried[0].get("resumed_at", "[]")) + [resume_at])
        f.attrs["status"] = "running"
        for group, columns in SCHEMA.items():
            g = f.create_group(group)
            for col, dtype in columns.items():
                data = carried[1][group][col] if carried is not None else np.zeros(0)
                g.create_dataset(col, data=np.asarray(data).astype(dtype), maxshape=(None,),
                                 dtype=np.dtype(dtype), chunks=(4096,))
        self._start_swmr()
        if carried is not None:   # (in SWMR mode first: a log killed in between, open for
            os.replace(target, self.path)   # writing without it, opened for no SWMR reader)

    def _lock(self, path: str, what: Optional[str] = None, noun: str = "log") -> None:
        """Hold an exclusive lock on `path` (created if absent) until the summary is written
        or this process ends: a second run naming the same log (or checkpoint) is refused at
        start-up instead of both writing one file. HDF5's own locking is off (SWMR readers,
        parallel file systems), so the lock is a separate flock on the file; a checkpoint,
        replaced by a rename at each write, is locked through a file beside it."""
        what = what or f"--log {path}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            self.release()
            raise UsageError(f"{what}: cannot create the run {noun} ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self.release()
            raise UsageError(f"{what}: another mpilb run is writing this {noun} now (it holds "
                             f"its lock): wait for it to end or give another {what.split()[0]}") from None
        except OSError:   # a file system without locks: nothing to hold
            pass
        self._locks.append(fd)
        if noun != "log":
            self._lock_files.append(path)

    def release(self) -> None:
        """Let another run open this log (after the summary; also at process exit)."""
        while self._lock_files:
            try:
                os.unlink(self._lock_files.pop())
            except OSError:
                pass
        while self._locks:
            os.close(self._locks.pop())

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _carry_over(self, resume_at: float, completed: Optional[list] = None):
        """Rows of the log being resumed up to the checkpoint (later work is done again);
        epochs the checkpoint completed that the log lacks (its last rows could not be
        written: a full disk) get their `epochs` row from the checkpoint's record.

        The old file is read, not edited: a run that was killed leaves its file marked as
        open for writing, which HDF5 refuses to open for writing again.
        """
        try:
            attrs, cols = read_columns(self.path)
        except OSError as exc:   # (refused at start-up: paths.run_identity)
            self.release()
            raise UsageError(f"--resume: cannot read the run log {self.path} ({exc}): its "
                             f"coverage cannot be continued") from None
        for group in SCHEMA:
            tcol = "t_end" if group == "epochs" else "t"
            keep = int(np.searchsorted(cols[group][tcol], resume_at, side="right"))
            cols[group] = {c: v[:keep] for c, v in cols[group].items()}
        ep = cols["epochs"]
        lacking = [e for e in completed or () if int(e["epoch"]) not in set(ep["epoch"].tolist())]
        if lacking:
            span = f"{lacking[0]['epoch']}..{lacking[-1]['epoch']}" if len(lacking) > 1 else lacking[0]["epoch"]
            print(f"mpilb: warning: the run log {self.path} lacks the rows of {len(lacking)} "
                  f"epoch(s) ({span}; they could not be written): their epochs/ rows come from "
                  f"the checkpoint", file=sys.stderr, flush=True)
            for col in ep:
                ep[col] = np.concatenate([ep[col], [e.get(col, np.nan) for e in lacking]])
            order = np.argsort(ep["epoch"], kind="stable")
            cols["epochs"] = {c: np.asarray(v)[order] for c, v in ep.items()}
        return attrs, cols

    def _start_swmr(self) -> None:
        f = self._file
        self._buffers: dict[str, dict[str, list]] = {}
        self._dsets: dict[str, dict[str, h5py.Dataset]] = {}
        for group, columns in SCHEMA.items():
            self._dsets[group] = {c: f[group][c] for c in columns}
            self._buffers[group] = {c: [] for c in columns}
        f.swmr_mode = True
        self._last_flush = time.monotonic()
        self.closed = False

    def append(self, group: str, **row) -> None:
        """Buffer one row; columns not given are written as 0 (a metric not given: NaN)."""
        buf = self._buffers[group]
        for col, values in buf.items():
            values.append(row.get(col, _NOT_GIVEN.get(col, 0)))
        if time.monotonic() - self._last_flush > self.flush_interval:
            self.flush()

    def maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush > self.flush_interval:
            self.flush()

    def flush(self) -> None:
        """Write buffered rows and flush the file.

        Raises:
            LogWriteError: the file cannot be written (a full disk, a lost file system).
        """
        if self.closed:
            return
        try:
            self._write_rows()
        except (OSError, RuntimeError) as exc:   # h5py reports a full disk as either
            self.closed = True   # HDF5's state is unknown now: nothing more is written
            raise LogWriteError(self.path, exc) from None
        self._last_flush = time.monotonic()

    def _write_rows(self) -> None:
        for group, buf in self._buffers.items():
            n = len(next(iter(buf.values())))
            if n == 0:
                continue
            for col, values in buf.items():
                ds = self._dsets[group][col]
                old = ds.shape[0]
                ds.resize((old + n,))
                ds[old:] = np.asarray(values, dtype=ds.dtype)
                values.clear()
            for ds in self._dsets[group].values():
                ds.flush()
        self._file.flush()

    def close(self, status: str, attrs: Optional[dict] = None) -> None:
        """Flush, end SWMR writing, then record the final status and `attrs` at the root."""
        if self.closed:
            return
        assert status in STATUSES, status
        self.flush()
        removed = self._removed()
        self._file.close()
        self.closed = True
        if removed is not None:
            self._write_back(removed)
        try:
            with h5py.File(self.path, "a", locking=False) as f:
                f.attrs["status"] = status
                f.attrs["end_time"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
                for key, value in (attrs or {}).items():
                    f.attrs[key] = value
        except (OSError, RuntimeError) as exc:
            raise LogWriteError(self.path, exc) from None

    def _removed(self):
        """The open file when the log was deleted (or replaced) at its path while the run
        wrote it, else None. Its rows still live in the open file: :meth:`close` writes
        them back to the path, so that the summary and the report read the run's rows."""
        fd = self._file.id.get_vfd_handle()
        try:
            if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                return None
        except FileNotFoundError:
            pass
        return open(f"/proc/self/fd/{fd}", "rb")   # keeps the deleted file once closed

    def _write_back(self, src) -> None:
        tmp = f"{self.path}.restore{os.getpid()}"
        try:
            with src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(tmp, self.path)
        except OSError as exc:
            raise MpilbError(f"--log {self.path}: the run log was deleted during the run and "
                             f"cannot be written again ({exc.strerror})") from None
        print(f"mpilb: warning: the run log {self.path} was deleted or replaced during the "
              f"run; written again from the open file", file=sys.stderr, flush=True)

    def write_summary(self, summary: dict) -> None:
        """Store the summary object (docs/logs.md: `summary` with attribute `json`)."""
        with h5py.File(self.path, "a", locking=False) as f:
            f.require_group("summary").attrs["json"] = json.dumps(summary)
        self.release()


def file_kind(attrs) -> str:
    """What an mpilb HDF5 file is, from its root attributes: "log" (a run log),
    "checkpoint", or "other" (e.g. a dataset shard)."""
    if "status" in attrs:
        return "log"
    if "model" in attrs and "format" in attrs:
        return "checkpoint"
    return "other"


def checkpoint_of_log(path: str, attrs) -> Optional[str]:
    """The checkpoint a run log's run wrote, if it exists: the one in its config, else the
    default beside the log (`runs/003.h5` -> `runs/003.ckpt.h5`)."""
    candidates = []
    try:
        recorded = json.loads(attrs["config"]).get("checkpoint")
        if recorded:
            candidates.append(str(recorded))
    except (KeyError, ValueError, TypeError, AttributeError):
        pass
    candidates.append(default_checkpoint(path))
    return next((c for c in candidates if Path(c).is_file()), None)


def open_for_reading(path: str) -> h5py.File:
    """Open a run log read-only. A log left by a killed run is still marked as open by its
    SWMR writer and only opens as a SWMR reader; every other file is opened plainly first,
    because a SWMR reader retries a damaged file's checksums for many minutes (a hang)."""
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as exc:
        if "already open for write" not in str(exc):
            raise
    return h5py.File(path, "r", locking=False, swmr=True)


def holds_updates(path) -> bool:
    """Whether the run log at `path` holds an applied update yet (start-up is over).

    False while the file is missing or being created: a run's writer may hold it half made.
    """
    try:
        return bool(read_columns(str(path))[1]["updates"]["t"].size)
    except (OSError, KeyError, RuntimeError):
        return False


def read_columns(path: str) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    """Open a run log: (root attributes, {group: {column: array}}). OSError passes up.

    Every column of :data:`SCHEMA` is there (empty when the file lacks it), plus any other
    1-D column the file holds (groups added by a newer mpilb). Event names are `str`.
    A log still being written, or left by a killed run (which a plain ``h5py.File(path)``
    refuses), opens too (:func:`open_for_reading`).
    """
    with open_for_reading(path) as f:
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        groups: dict[str, dict[str, np.ndarray]] = {}
        names = list(SCHEMA) + sorted(g for g in f if g not in SCHEMA and g != "summary")
        for group in names:
            cols = dict.fromkeys(SCHEMA.get(group, ()))
            if isinstance(f.get(group), h5py.Group):
                cols.update(dict.fromkeys(c for c, d in f[group].items()
                                          if isinstance(d, h5py.Dataset) and d.ndim == 1))
            groups[group] = {}
            for col in cols:
                if group in f and col in f[group]:
                    arr = f[group][col][()]
                    if arr.dtype.kind == "S":
                        arr = arr.astype(str)
                    groups[group][col] = arr
                else:
                    groups[group][col] = np.zeros(0)
            present = [v.size for c, v in groups[group].items() if group in f and c in f[group]]
            if present and min(present) != max(present):   # a kill in the middle of a flush
                groups[group] = {c: v[:min(present)] for c, v in groups[group].items()}
        if "summary" in f and "json" in f["summary"].attrs:
            attrs["summary"] = json.loads(f["summary"].attrs["json"])
    return attrs, groups


def read(path: str) -> dict:
    """A run log as pandas DataFrames: {group: DataFrame}, one column per log column.

    Each frame's ``.attrs`` holds the log's root attributes (``config`` and the
    summary decoded from JSON). Works on a finished, a live or a killed run's log.

    Example:
        >>> import mpilb.runfiles.runlog
        >>> logs = mpilb.runfiles.runlog.read("run.h5")
        >>> logs["updates"].groupby("worker")["loss"].mean()

    Raises:
        ImportError: pandas is not installed (``pip install pandas``).
    """
    import pandas as pd   # optional: only this reader needs it

    attrs, cols = read_columns(path)
    meta = dict(attrs)
    for key in ("config", "hostnames", "coverage", "lost_workers"):
        if isinstance(meta.get(key), str):
            try:
                meta[key] = json.loads(meta[key])
            except ValueError:
                pass
    frames = {}
    for group, columns in cols.items():
        frame = pd.DataFrame({c: v for c, v in columns.items()})
        frame.attrs = dict(meta)
        frames[group] = frame
    return frames


def write_csv(cols: dict[str, dict[str, np.ndarray]], out_dir) -> list[str]:
    """Write one CSV per log group (`updates.csv`, ...) into `out_dir` (created if missing).

    A header line with the column names, then one line per row; floats are written in full
    precision (``repr``), events as text. Returns the paths written.
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--csv {out_dir}: cannot create the directory ({exc.strerror})") from None
    written = []
    for group, columns in cols.items():
        path = out / f"{group}.csv"
        lists = [np.asarray(v).tolist() for v in columns.values()]

        def write(fh, columns=columns, lists=lists):
            w = csv.writer(fh)
            w.writerow(list(columns))
            w.writerows(zip(*lists))

        replace_file(path, write, f"--csv {out_dir}", text=True)   # never through a link
        written.append(str(path))
    return written


def _lock_file(checkpoint: str) -> str:
    p = Path(checkpoint)
    return str(p.with_name(f".{p.name}.lock"))


def _discard_replaced(checkpoint: str) -> None:
    """Remove the checkpoint of the run a new one replaces (``--overwrite``), so that no
    file beside the new log holds another run's weights; only an mpilb checkpoint."""
    try:
        with h5py.File(checkpoint, "r", locking=False) as f:
            kind = file_kind(f.attrs)
    except OSError:
        return
    if kind == "checkpoint":
        os.unlink(checkpoint)
