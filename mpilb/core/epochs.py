"""Epochs and their coverage: the shard order of each epoch and the counter of applied samples.

Epochs are strict (docs/cli.md): an epoch ends when every one of its samples has been applied
exactly once. A batch is a range [lo, hi) of positions in one shard's permuted order in one
epoch, so the server can count coverage per sample with one small array per epoch. Pure
(NumPy only): the server, the serial trainer and the simulator count with the same tracker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


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

    def stats(self, t: float) -> EpochStats:
        """The current epoch's figures, were it to end at `t`."""
        applied = int(self.counts.sum(dtype=np.int64))
        return EpochStats(self.epoch, self.t_start, t, applied, applied,
                          int(np.count_nonzero(self.counts > 1)),
                          int(np.count_nonzero(self.counts == 0)))

    def end(self, t: float) -> EpochStats:
        stats = self.stats(t)
        self.completed.append(stats)
        return stats

    def completed_at(self, t: float) -> list[EpochStats]:
        """The finished epochs as a checkpoint taken at `t` records them: with the current
        one when all its samples are applied but it has not been ended yet (a checkpoint
        taken between the last push of an epoch and its end, e.g. the rescue checkpoint of a
        run whose log failed on that push): the checkpoint says the next epoch comes next,
        so this one's record must be in it or a resume never counts it."""
        if self.complete and not any(s.epoch == self.epoch for s in self.completed):
            return [*self.completed, self.stats(t)]
        return list(self.completed)

    def coverage(self) -> dict:
        """The summary's `coverage` (docs/logs.md) over completed epochs: `applied` counts distinct samples."""
        return {
            "expected": self.total * len(self.completed),
            "applied": sum(self.total - s.missing for s in self.completed),
            "duplicates": sum(s.duplicates for s in self.completed),
            "missing": sum(s.missing for s in self.completed),
        }
