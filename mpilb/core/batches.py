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

from mpilb.errors import UsageError


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
    """A worker's assigned tasks: positions [start, end) of shards, the next one prefetching.

    A task's rows come from the rank's own shard reader, or (`remote`, with a node-local
    store) from another rank that holds them; either way the feed counts as I/O only the
    time spent waiting for rows that had not arrived yet.

    Args:
        reader: a ShardReader.
        backend: where batches live (numpy or cupy arrays).
    """

    def __init__(self, reader, backend):
        self.reader = reader
        self.backend = backend
        # queued tasks: [epoch, shard, start, end, remote]; remote has .wait() -> (x, y, seconds)
        self.queue: deque[list] = deque()
        self.current: Optional[tuple[int, int]] = None
        self.start = 0          # first position of the current task
        self.end = 0
        self.pos = 0
        self._offset = 0        # position of row 0 of the current arrays
        self._x = self._y = None
        self.io_s = 0.0

    def assign(self, epoch: int, shard: int, start: int = 0, end: Optional[int] = None,
               remote=None) -> None:
        """Queue positions [start, end) of `shard` (default: to its end)."""
        if end is None:
            end = self.reader.dataset.shard_sizes[shard]
        self.queue.append([epoch, shard, start, end, remote])
        self._prefetch()

    def truncate(self, epoch: int, shard: int, end: int) -> None:
        """Stop the task of `shard` whose positions contain `end` there: the rest was given
        to another worker. A worker may hold two tasks of one shard (two gaps of a requeued
        shard, or a stolen tail beside a remainder), so the cut is matched by position, not
        by shard alone: any other task of the shard is left whole.

        Raises:
            RuntimeError: the current task is already past `end` (the server's ledger let
                a cut fall behind what this worker may have computed: a bug, never a race).
        """
        if self.current == (epoch, shard) and self.start <= end < self.end:
            if self.pos > end:
                raise RuntimeError(f"shard {shard}: cut at {end} but already at {self.pos}")
            self.end = end
            return
        for task in self.queue:
            if task[0] == epoch and task[1] == shard and task[2] <= end < task[3]:
                task[3] = end
                break
        self.queue = deque(t for t in self.queue if t[3] > t[2])

    def drop(self) -> None:
        """Forget every task (the server gave what is left of them to other workers)."""
        if any(task[4] is not None for task in self.queue):
            raise RuntimeError("told to drop tasks whose rows are still to arrive from another rank")
        self.queue.clear()
        self.current = None
        self.pos = self.end = self.start = 0
        self._x = self._y = None

    def _prefetch(self) -> None:
        if self.queue and self.queue[0][4] is None:
            self.reader.prefetch(*self.queue[0][:2])

    @property
    def has_work(self) -> bool:
        return (self.current is not None and self.pos < self.end) or bool(self.queue)

    def _advance(self) -> bool:
        while self.current is None or self.pos >= self.end:
            if not self.queue:
                self.current = None
                return False
            epoch, shard, start, end, remote = self.queue.popleft()
            if remote is None:
                data, waited = self.reader.get(epoch, shard)
                x, y, offset = data.x, data.y, 0
            else:
                x, y, waited = remote.wait()
                offset = start
            self.io_s += waited
            self.current = (epoch, shard)
            self.start, self.end, self.pos, self._offset = start, end, start, offset
            self._x = self.backend.asarray(x)
            self._y = self.backend.asarray(y)
            self._prefetch()
        return True

    def next_range(self, batch: int) -> Optional[tuple[int, int, int, int]]:
        """(epoch, shard, lo, hi) of the batch `take(batch)` would return, without loading."""
        if self.current is not None and self.pos < self.end:
            return (*self.current, self.pos, min(self.end, self.pos + batch))
        if self.queue:
            epoch, shard, start, end, _ = self.queue[0]
            return epoch, shard, start, min(end, start + batch)
        return None

    def take(self, batch: int) -> Optional[Batch]:
        """The next batch of at most `batch` samples (a task's last batch may be smaller)."""
        if not self._advance():
            return None
        lo, hi = self.pos, min(self.end, self.pos + batch)
        self.pos = hi
        epoch, shard = self.current
        a, b = lo - self._offset, hi - self._offset
        return Batch(epoch, shard, lo, hi, self._x[a:b], self._y[a:b])

    def rows(self, epoch: int, shard: int, start: int, end: int):
        """Rows [start, end) of a shard's permuted order, for sending to another rank."""
        if self.current == (epoch, shard) and self._offset <= start and self._x is not None \
                and end - self._offset <= len(self._x):
            a, b = start - self._offset, end - self._offset
            return np.ascontiguousarray(self._host(self._x[a:b])), np.ascontiguousarray(self._host(self._y[a:b]))
        data, waited = self.reader.get(epoch, shard)
        # The read is this rank's I/O like any other: in its reports, so that a slow reader's
        # rate says what sending rows costs it (rank 0 picks senders by it: holder_for).
        self.io_s += waited
        return np.ascontiguousarray(data.x[start:end]), np.ascontiguousarray(data.y[start:end])

    def _host(self, a):
        return self.backend.to_host(a)

    def remaining(self) -> int:
        """Samples left in the current task and the queued ones."""
        left = (self.end - self.pos) if self.current is not None else 0
        return left + sum(end - start for _, _, start, end, _ in self.queue)


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
        inj = self.injector if self.injector is not None and self.injector.rules else None
        if inj is not None:
            inj.begin_step(time.monotonic())
        target = self.grad if out is None else out
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            # a diverging run is caught by the finiteness check, once, not by a warning per rank
            loss, grad = self.model.loss_and_grad(params, batch.x, batch.y, target)
        if grad is not target:   # returned its own array instead of writing `out`: take it
            grad = gradient_into(self.model, grad, target, self.backend)
        self.backend.synchronize()
        compute_s = time.perf_counter() - t0
        if inj is not None:
            extra = inj.compute_extra(time.monotonic(), compute_s)
            if extra > 0:
                t1 = time.perf_counter()
                time.sleep(extra)
                compute_s += time.perf_counter() - t1   # what the sleep really took
        return float(loss), grad, compute_s


def gradient_into(model, grad, target, backend):
    """A gradient the model returned instead of writing ``out``, copied into ``target``
    (what is sent is the message buffer), after checking it has one value per parameter.

    Raises:
        UsageError: a gradient of another length (one line, naming the model).
    """
    size = getattr(grad, "size", None)
    if size != target.size:
        label = type(model).__qualname__
        raise UsageError(f"--model: {label}.loss_and_grad returned a gradient of "
                         f"{size if size is not None else type(grad).__name__} values; "
                         f"num_params is {target.size}: return (loss, gradient) with one "
                         f"value per parameter, written into `out` when it is given")
    if isinstance(target, np.ndarray):   # a host message buffer
        target[...] = np.asarray(backend.to_host(grad), dtype=target.dtype).reshape(target.shape)
    else:
        target[...] = backend.xp.asarray(grad, dtype=target.dtype).reshape(target.shape)
    return target
