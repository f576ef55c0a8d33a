"""The task ledger the simulator drives: the live server's own (:mod:`mpilb.core.tasks`).

:class:`Ledger` wraps :class:`~mpilb.core.tasks.TaskLedger` (assign, top up, part-way moves,
take back) and the server's coverage counter (:class:`mpilb.core.epochs.EpochTracker`) in the
few calls the engine makes, at the moments the server makes them: plan and begin an epoch,
top a worker up after its push (or when it is woken), tell a worker its reply (its batch;
a cut reaches it there), advance its current task, count applied samples, take back a lost
or benched worker's tasks. Nothing of the ledger's logic lives here.
"""

from __future__ import annotations

from mpilb.core.holdings import Holding
from mpilb.core.tasks import TaskLedger


class Ledger:
    """The server's task ledger and coverage, for simulated workers.

    Args:
        balancer: the :class:`mpilb.core.balancer.Balancer` (shard queues and rates).
        tracker: the server's coverage counter, a :class:`mpilb.core.epochs.EpochTracker`.
        shard_sizes: samples per shard.
        ranks: the workers.
        part_way: split a started task for an idle worker (every policy but static and
            round-robin, as the server does).
        pipeline: the workers compute a batch ahead (--pipeline 1): the ledger's cuts keep
            clear of it, as the server's do.
    """

    def __init__(self, balancer, tracker, shard_sizes: list[int], ranks: list[int],
                 part_way: bool = True, pipeline: bool = False):
        self.balancer = balancer
        self.tasks_ledger = TaskLedger(balancer, shard_sizes, ranks, split=part_way,
                                       pipeline=pipeline)
        self.tracker = tracker
        self.moved = 0    # shard moves: the balancer's, part-way ones, reassignments

    # -- epochs -------------------------------------------------------------------------
    def begin_epoch(self, epoch: int, order: list[int], t: float) -> None:
        """Plan ``epoch`` (``order``: the shuffled shards) and start counting its coverage."""
        self.tracker.begin(epoch, t)
        self.balancer.plan_epoch(epoch, order)
        self.tasks_ledger.begin_epoch(epoch)

    def end_epoch(self, t: float) -> None:
        """The epoch is over: its coverage counts (see :meth:`coverage`)."""
        self.tracker.end(t)

    def coverage(self) -> dict:
        """The summary's ``coverage`` (docs/logs.md) over completed epochs."""
        return self.tracker.coverage()

    @property
    def complete(self) -> bool:
        """Every sample of the epoch applied."""
        return self.tracker.complete

    def record(self, epoch: int, shard: int, lo: int, hi: int) -> None:
        """Samples [lo, hi) of ``shard`` were applied (counted for coverage)."""
        self.tracker.record(epoch, shard, lo, hi)

    # -- tasks --------------------------------------------------------------------------
    def tasks(self, worker: int):
        """The tasks ``worker`` holds (its current one first)."""
        return self.tasks_ledger.tasks(worker)

    def remaining(self, worker: int) -> int:
        """Samples ``worker`` still has to do in the tasks it holds."""
        return self.tasks_ledger.of[worker].remaining

    def top_up(self, worker: int, batch: int) -> None:
        """Hand ``worker`` shards until it holds two tasks; with none left, split another's."""
        self.tasks_ledger.top_up(worker, batch)

    def reply(self, worker: int, batch: int) -> None:
        """A reply reaches ``worker``: its assignments, any cut, the batch it is to use."""
        self.tasks_ledger.take_reply(worker, batch)

    def note_next(self, worker: int, shard: int, hi: int) -> None:
        """Pipelined: the batch ``worker`` computes while its push travels (its push's
        NEXT_SHARD, NEXT_HI; shard -1 when none)."""
        self.tasks_ledger.note_next(worker, shard, hi)

    def advance(self, worker: int, hi: int):
        """``worker`` pushed positions up to ``hi`` of its current task; returns the task if
        that finished it."""
        task = self.tasks_ledger.current(worker)
        return task if self.tasks_ledger.advance(worker, hi) else None

    def add_worker(self, worker: int) -> None:
        """``worker`` joined the run: it holds nothing yet (as the server's admission)."""
        self.tasks_ledger.of[worker] = Holding(worker)

    def can_take_back(self, worker: int) -> bool:
        return self.tasks_ledger.can_take_back(worker)

    def take_back(self, worker: int, lost: bool = False) -> None:
        """What is left of ``worker``'s tasks goes back to the balancer (lost or benched)."""
        self.tasks_ledger.take_back(worker, lost=lost)

    def count_moves(self) -> None:
        """Fold the balancer's moves into the ledger's events and count the moves."""
        self.tasks_ledger.collect_moves()
        self.moved += sum(1 for e in self.tasks_ledger.take_events()
                          if e.event in ("move", "reassign"))
