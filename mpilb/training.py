"""Pieces shared by the serial trainer and the parameter server.

Epochs are strict (DESIGN.md): an epoch ends when every one of its samples has been applied
exactly once. A batch is a range [lo, hi) of positions in one shard's permuted order in one
epoch, so the server can count coverage per sample with one small array per epoch.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .config import Config, default_cache_dir
from .errors import UsageError

# Set by the SIGTERM/SIGUSR1 handler (any rank); the training loops poll it.
PREEMPTED = threading.Event()

DEFAULT_DATASET = dict(samples=24000, features=64, classes=10, shards=12, noise=0.0,
                       test_fraction=0.2, seed=0)


def default_dataset_dir() -> str:
    """The built-in dataset, generated once into $MPILB_CACHE (used when --data is not given)."""
    from .dataset import open_dataset

    root = default_cache_dir() / "default-synthetic-v1"
    try:
        open_dataset(root)
        return str(root)
    except Exception:  # noqa: BLE001 - absent or half-written: (re)generate it
        pass
    try:
        return _generate_default(root)
    except OSError as exc:
        raise UsageError(f"cannot write the built-in dataset into {root.parent} "
                         f"({exc.strerror or exc}): set MPILB_CACHE to a writable directory, "
                         f"or pass --data DIR") from None


def _generate_default(root) -> str:
    import shutil

    from .dataset import prepare_synthetic

    if root.exists():
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.with_name(root.name + f".tmp{time.time_ns()}")
    try:
        prepare_synthetic(tmp, **DEFAULT_DATASET)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(root)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return str(root)


def epoch_order(seed: int, epoch: int, num_shards: int) -> list[int]:
    """The epoch's shard order, shuffled from the seed."""
    rng = np.random.default_rng([seed, epoch, 0x5EED])
    return [int(s) for s in rng.permutation(num_shards)]


@dataclass
class EpochStats:
    epoch: int
    t_start: float
    t_end: float
    samples: int
    applied: int
    duplicates: int
    missing: int


class EpochTracker:
    """Counts, per sample, how often its gradient was applied in the current epoch.

    Args:
        shard_sizes: samples per shard.
    """

    def __init__(self, shard_sizes: list[int]):
        self.shard_sizes = list(shard_sizes)
        self.offsets = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self.total = int(self.offsets[-1])
        self.counts = np.zeros(self.total, dtype=np.uint16)
        self.epoch = -1
        self.t_start = 0.0
        self.distinct = 0
        self.stray = 0   # samples of gradients dropped unapplied (not the current epoch)
        self.completed: list[EpochStats] = []

    def begin(self, epoch: int, t: float, counts: Optional[np.ndarray] = None) -> None:
        self.epoch = epoch
        self.t_start = t
        if counts is None:
            self.counts[:] = 0
        else:
            self.counts[:] = counts
        self.distinct = int(np.count_nonzero(self.counts))

    def record(self, epoch: int, shard: int, lo: int, hi: int) -> int:
        """Count samples [lo, hi) of `shard` as applied; returns how many were new."""
        if epoch != self.epoch:
            self.stray += hi - lo
            return 0
        if not (0 <= shard < len(self.shard_sizes)) or not (0 <= lo <= hi <= self.shard_sizes[shard]):
            raise ValueError(f"batch outside the dataset: shard {shard} [{lo}, {hi})")
        seg = self.counts[self.offsets[shard] + lo: self.offsets[shard] + hi]
        new = int(seg.size - np.count_nonzero(seg))
        seg += 1
        self.distinct += new
        return new

    @property
    def complete(self) -> bool:
        return self.distinct == self.total

    def end(self, t: float) -> EpochStats:
        applied = int(self.counts.sum(dtype=np.int64))
        stats = EpochStats(self.epoch, self.t_start, t, applied, applied,
                           int(np.count_nonzero(self.counts > 1)),
                           int(np.count_nonzero(self.counts == 0)))
        self.completed.append(stats)
        return stats

    def coverage(self) -> dict:
        """DESIGN.md's `coverage` over completed epochs: `applied` counts distinct samples."""
        return {
            "expected": self.total * len(self.completed),
            "applied": sum(self.total - s.missing for s in self.completed),
            "duplicates": sum(s.duplicates for s in self.completed),
            "missing": sum(s.missing for s in self.completed),
        }


class Evaluator:
    """Test-set evaluation on rank 0 (NumPy), with the time it takes accounted."""

    def __init__(self, model, x: np.ndarray, y: np.ndarray):
        self.model = model
        self.x = x
        self.y = y
        self.seconds = 0.0

    def __call__(self, params: np.ndarray) -> tuple[float, float]:
        t0 = time.perf_counter()
        loss, acc = self.model.evaluate(params, self.x, self.y)
        self.seconds += time.perf_counter() - t0
        return float(loss), float(acc)


@dataclass
class StopRule:
    """--epochs, --max-seconds, --target-accuracy: whichever comes first."""

    epochs: int
    max_seconds: Optional[float]
    target_accuracy: Optional[float]
    reason: str = ""

    def check(self, epochs_done: int, elapsed: float, accuracy: Optional[float]) -> bool:
        if epochs_done >= self.epochs:
            self.reason = "epochs"
        elif self.max_seconds is not None and elapsed >= self.max_seconds:
            self.reason = "max_seconds"
        elif (self.target_accuracy is not None and accuracy is not None
              and accuracy >= self.target_accuracy):
            self.reason = "target_accuracy"
        return bool(self.reason)


def batch_ranges(size: int, start: int, batch: int):
    """The next batch [lo, hi) of a shard of `size` samples from position `start`."""
    hi = min(size, start + batch)
    return start, hi


def config_model(cfg: Config, dataset):
    from .models import build_model

    return build_model(cfg.model, tuple(dataset.sample_shape), dataset.num_classes,
                       cfg.hidden_sizes)


def config_optimizer(cfg: Config, num_params: int, xp=np):
    from .optimizers import build_optimizer

    return build_optimizer(cfg.optimizer, num_params, lr=cfg.lr, momentum=cfg.momentum,
                           nesterov=cfg.nesterov, weight_decay=cfg.weight_decay, xp=xp)


def resolve_data(cfg: Config) -> str:
    if cfg.data:
        return cfg.data
    return default_dataset_dir()


def check_world(cfg: Config, world_size: int, dataset) -> None:
    """Combinations that depend on the job size or the data."""
    workers = max(1, world_size - 1)
    if cfg.store == "local" and cfg.replicas > workers:
        raise UsageError(f"--replicas {cfg.replicas} exceeds the {workers} worker rank(s) of this job")
    if cfg.model == "cnn" and len(dataset.sample_shape) not in (1, 3):
        raise UsageError(f"--model cnn needs image-shaped samples (C,H,W); {dataset.root} has shape {tuple(dataset.sample_shape)}")


RUNS_DIR = "runs"


def next_run_log(directory: str = RUNS_DIR) -> str:
    """Reserve and return `runs/NNN.h5`, the next free number (created empty, exclusively,
    so two runs started at once in one folder never get the same file)."""
    import os
    from pathlib import Path

    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {d.resolve()} for the run log ({exc.strerror}): "
                         f"pass --log RUN.h5") from None
    taken = [int(p.stem) for p in d.glob("*.h5") if p.stem.isdigit()]
    n = max(taken, default=0) + 1
    while True:
        path = d / f"{n:03d}.h5"
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return str(path)
        except FileExistsError:
            n += 1
        except OSError as exc:
            raise UsageError(f"cannot create {path} ({exc.strerror}): pass --log RUN.h5") from None


def default_checkpoint(log: str) -> str:
    """The checkpoint beside a log: `runs/003.h5` -> `runs/003.ckpt.h5`."""
    from pathlib import Path

    p = Path(log)
    stem = p.name[: -len(p.suffix)] if p.suffix in (".h5", ".hdf5") else p.name
    return str(p.with_name(stem + ".ckpt.h5"))


def check_paths(cfg: Config, dataset, config_file=None) -> None:
    """Decide the log and checkpoint files (DESIGN.md, "Run log") and refuse names that would
    destroy something: an existing log or checkpoint (unless --resume or --overwrite), or one
    file named twice among --log, --checkpoint, the config file and the dataset's files.
    Fills in `cfg.log` (a new `runs/NNN.h5`) and `cfg.checkpoint` when they were not given.
    """
    import os
    from pathlib import Path

    if cfg.log:
        check_writable_dir(cfg.log, "--log")
    if cfg.checkpoint:
        check_writable_dir(cfg.checkpoint, "--checkpoint")
    keep = cfg.resume or cfg.overwrite
    named = [("--log", cfg.log)] + ([("--checkpoint", cfg.checkpoint)] if cfg.checkpoint else [])
    if not cfg.checkpoint and cfg.log:
        named.append(("the checkpoint beside --log", default_checkpoint(cfg.log)))
    for what, path in named:
        if path and not keep and Path(path).exists():
            raise UsageError(f"{what} {path} exists (an earlier run's file): pass --overwrite "
                             f"to replace it, --resume to continue that run, or another name")
    others = [("the config file", config_file)] if config_file else []
    others += [("the dataset's manifest", str(Path(dataset.root) / "manifest.json")),
               ("the dataset's test set", str(dataset.test_path))]
    others += [("a shard of the dataset", str(dataset.shard_path(i)))
               for i in range(len(dataset.shards))]
    seen: list[tuple[str, str]] = []
    for what, path in named + others:
        if not path:
            continue
        for prior, prior_path in seen:
            if _same_file(path, prior_path):
                raise UsageError(f"{prior} {prior_path} and {what} {path} are the same file: "
                                 f"give the log and the checkpoint names of their own")
        seen.append((what, path))
    if not cfg.log:
        cfg.values["log"] = next_run_log(os.path.join(os.getcwd(), RUNS_DIR))
        cfg.values["log"] = os.path.relpath(cfg.values["log"])
    if not cfg.checkpoint:
        cfg.values["checkpoint"] = default_checkpoint(cfg.log)


def _same_file(a: str, b: str) -> bool:
    import os

    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_writable_dir(path: str, option: str) -> None:
    """Fail at start-up, not an hour in, when a file cannot be written where asked."""
    import os
    import tempfile
    from pathlib import Path

    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: directory {parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".mpilb-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot write in {parent} ({exc.strerror})") from None
