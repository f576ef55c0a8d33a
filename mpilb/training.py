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

from .config import Config
from .errors import UsageError

# Set by the SIGTERM handler (any rank; SIGUSR1 too in a one-rank run): checkpoint and stop.
PREEMPTED = threading.Event()
# Set by SIGUSR1 on a rank of a multi-rank job. Slurm's `--signal=USR1` means preemption, but
# MPICH's Hydra under `-disable-auto-cleanup` sends the same signal to the survivors when a
# rank dies; rank 0 tells them apart (server/chores.py): a preemption only when every worker
# present at the signal reports it too, none of them dying first.
USR1_NOTICE = threading.Event()

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


def check_world(cfg: Config, world_size: int, dataset) -> None:
    """Combinations that depend on the job size or the data."""
    workers = max(1, world_size - cfg.servers)
    if cfg.store == "local" and cfg.replicas > workers:
        raise UsageError(f"--replicas {cfg.replicas} exceeds the {workers} worker rank(s) of this job")
    if cfg.model == "cnn" and len(dataset.sample_shape) not in (1, 3):
        raise UsageError(f"--model cnn needs image-shaped samples (C,H,W); {dataset.root} has shape {tuple(dataset.sample_shape)}")
