"""The compute side of a worker, free of MPI: shard feed and gradient step.

Used by the MPI worker and by the one-rank serial trainer, so both consume the same
batches (shard by shard, positions [lo, hi) of the shard's permuted order) and compute the
same gradients.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass
class Batch:
    epoch: int
    shard: int
    lo: int
    hi: int
    x: object   # backend array
    y: object

    @property
    def size(self) -> int:
        return self.hi - self.lo


class ShardFeed:
    """A worker's assigned shards: the current one plus those queued, the next prefetching.

    The feed counts as I/O only the time spent waiting for shard data that the prefetch
    thread had not delivered yet.

    Args:
        store: a ShardStore.
        backend: where batches live (numpy or cupy arrays).
    """

    def __init__(self, store, backend):
        self.store = store
        self.backend = backend
        self.queue: deque[tuple[int, int, int]] = deque()   # (epoch, shard, start) assigned, not current
        self.current: Optional[tuple[int, int]] = None
        self.size = 0
        self.pos = 0
        self._x = self._y = None
        self.io_s = 0.0

    def assign(self, epoch: int, shard: int, start: int = 0) -> None:
        """Queue `shard` of `epoch`, to be consumed from position `start` on."""
        self.queue.append((epoch, shard, start))
        self._prefetch()

    def _prefetch(self) -> None:
        if self.queue:
            self.store.prefetch(*self.queue[0][:2])

    @property
    def has_work(self) -> bool:
        return (self.current is not None and self.pos < self.size) or bool(self.queue)

    def _advance(self) -> bool:
        while self.current is None or self.pos >= self.size:
            if not self.queue:
                self.current = None
                return False
            epoch, shard, start = self.queue.popleft()
            data, waited = self.store.get(epoch, shard)
            self.io_s += waited
            self.current = (epoch, shard)
            self.size = len(data.y)
            self.pos = start
            self._x = self.backend.asarray(data.x)
            self._y = self.backend.asarray(data.y)
            self._prefetch()
        return True

    def next_range(self, batch: int) -> Optional[tuple[int, int, int, int]]:
        """(epoch, shard, lo, hi) of the batch `take(batch)` would return, without loading."""
        if self.current is not None and self.pos < self.size:
            return (*self.current, self.pos, min(self.size, self.pos + batch))
        if self.queue:
            epoch, shard, start = self.queue[0]
            return epoch, shard, start, min(self.store.dataset.shard_sizes[shard], start + batch)
        return None

    def take(self, batch: int) -> Optional[Batch]:
        """The next batch of at most `batch` samples (a shard's last batch may be smaller)."""
        if not self._advance():
            return None
        lo, hi = self.pos, min(self.size, self.pos + batch)
        self.pos = hi
        epoch, shard = self.current
        return Batch(epoch, shard, lo, hi, self._x[lo:hi], self._y[lo:hi])

    def remaining(self) -> int:
        """Samples left in the current shard and the queued ones."""
        left = (self.size - self.pos) if self.current is not None else 0
        sizes = self.store.dataset.shard_sizes
        return left + sum(sizes[s] - start for _, s, start in self.queue)


class GradientStep:
    """loss_and_grad on the backend, timed, with injected slowdowns applied.

    Args:
        model: the Model.
        backend: the Backend.
        injector: an Injector or None.
    """

    def __init__(self, model, backend, injector=None):
        self.model = model
        self.backend = backend
        self.injector = injector
        self.grad = backend.xp.zeros(model.num_params, dtype=np.float32)

    def __call__(self, params, batch: Batch, out=None) -> tuple[float, object, float]:
        """Returns (loss sum, gradient sum (backend array), compute seconds incl. injected).

        `out`: where to write the gradient (e.g. straight into a host message buffer on
        the CPU, which saves a copy per step); default an internal buffer.
        """
        t0 = time.perf_counter()
        inj = self.injector
        if inj is not None:
            inj.begin_step(time.monotonic())
        loss, grad = self.model.loss_and_grad(params, batch.x, batch.y,
                                              self.grad if out is None else out)
        self.backend.synchronize()
        compute_s = time.perf_counter() - t0
        if inj is not None:
            extra = inj.compute_extra(time.monotonic(), compute_s)
            if extra > 0:
                time.sleep(extra)
                compute_s += extra
        return float(loss), grad, compute_s
