"""Epochs and stop rules, shared by the serial trainer and the parameter server.

Epochs are strict (docs/cli.md): an epoch ends when every one of its samples has been applied
exactly once. A batch is a range [lo, hi) of positions in one shard's permuted order in one
epoch, so the server can count coverage per sample with one small array per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from mpilb.config.sections import Config
from mpilb.run.evaluation import Evaluation

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
        """The summary's `coverage` (docs/logs.md) over completed epochs: `applied` counts distinct samples."""
        return {
            "expected": self.total * len(self.completed),
            "applied": sum(self.total - s.missing for s in self.completed),
            "duplicates": sum(s.duplicates for s in self.completed),
            "missing": sum(s.missing for s in self.completed),
        }


@dataclass
class StopRule:
    """--epochs, --max-seconds, --target-accuracy, --target-metric: whichever comes first.

    ``check`` takes the latest :class:`Evaluation` (or a plain accuracy, or None).
    """

    epochs: int
    max_seconds: Optional[float]
    target_accuracy: Optional[float]
    target_metric: Optional[float] = None
    reason: str = ""

    @property
    def waits_on_evaluations(self) -> bool:
        """A --target-* stop: an epoch's evaluation decides whether the run goes on."""
        return self.target_accuracy is not None or self.target_metric is not None

    def check(self, epochs_done: int, elapsed: float, evaluation=None) -> bool:
        if isinstance(evaluation, Evaluation):
            accuracy, metric = evaluation.decides
        else:
            accuracy, metric = evaluation, None
        if epochs_done >= self.epochs:
            self.reason = "epochs"
        elif self.max_seconds is not None and elapsed >= self.max_seconds:
            self.reason = "max_seconds"
        elif (self.target_accuracy is not None and accuracy is not None
              and accuracy >= self.target_accuracy):
            self.reason = "target_accuracy"
        elif (self.target_metric is not None and metric is not None
              and metric >= self.target_metric):
            self.reason = "target_metric"
        return bool(self.reason)


def build_stop_rule(cfg: Config) -> StopRule:
    return StopRule(cfg.epochs, cfg.max_seconds, cfg.target_accuracy, cfg.target_metric)
