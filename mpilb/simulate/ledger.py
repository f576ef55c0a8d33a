"""The task ledger the simulator drives: which positions of which shard each worker holds.

STAND-IN. The live server's ledger (assign, top up, part-way moves, take back, coverage) is
being moved out of ``server.py`` into the pure module ``mpilb/server/tasks.py``; once that
lands this module becomes a thin adapter over it. Until then it follows ``server.py``
line for line (``_top_up``, ``_split_for``, ``_take_back``, ``_advance``, ``pending_ranges``),
and coverage is counted by the server's own :class:`mpilb.training.EpochTracker`.

The engine talks to the ledger only through :class:`Ledger`'s public methods:
``begin_epoch``, ``top_up``, ``tasks``, ``advance``, ``record``, ``take_back``, ``remaining``,
``complete``; it tells the ledger the batch each worker uses (``batch_sent`` / ``batch``) and
when a donor has learnt of a cut (``delivered``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..training import EpochTracker

COMMITTED = 2   # as server.COMMITTED: a current task and one being prefetched


@dataclass
class Task:
    """Positions [pos, end) of a shard's permuted order still to be applied by one worker."""

    epoch: int
    shard: int
    pos: int
    end: int

    @property
    def remaining(self) -> int:
        return self.end - self.pos


class Ledger:
    """Per-worker tasks handed out through the balancer, with part-way moves.

    Args:
        balancer: the :class:`mpilb.balancer.Balancer` (shard queues and rates).
        shard_sizes: samples per shard.
        part_way: split a started task for an idle worker (every policy but static and
            round-robin, as the server does).
    """

    def __init__(self, balancer, shard_sizes: list[int], part_way: bool = True):
        self.balancer = balancer
        self.shard_sizes = list(shard_sizes)
        self.part_way = part_way
        self.tracker = EpochTracker(self.shard_sizes)
        self.epoch = -1
        self._tasks: dict[int, deque] = {}
        self._trunc: set[int] = set()           # donors not yet told of their cut
        self.batch_sent: dict[int, int] = {}    # batch of each worker's work in flight
        self.batch: dict[int, int] = {}         # batch each worker uses next
        self.pending_ranges: dict[int, list[tuple[int, int]]] = {}
        self.splits = 0                         # part-way moves made

    # -- epochs -------------------------------------------------------------------------
    def begin_epoch(self, epoch: int, order: list[int], t: float) -> None:
        """Plan ``epoch`` (``order``: the shuffled shards) and start counting its coverage."""
        self.epoch = epoch
        self.tracker.begin(epoch, t)
        self.balancer.plan_epoch(epoch, order)

    def end_epoch(self, t: float) -> None:
        """The epoch is over: its coverage counts (see :meth:`coverage`)."""
        self.tracker.end(t)

    def coverage(self) -> dict:
        """DESIGN.md's ``coverage`` over completed epochs."""
        return self.tracker.coverage()

    @property
    def complete(self) -> bool:
        """Every sample of the epoch applied."""
        return self.tracker.complete

    def record(self, epoch: int, shard: int, lo: int, hi: int) -> None:
        """Samples [lo, hi) of ``shard`` were applied (counted for coverage)."""
        self.tracker.record(epoch, shard, lo, hi)

    # -- tasks --------------------------------------------------------------------------
    def tasks(self, worker: int) -> deque:
        """The tasks ``worker`` holds (its current one first)."""
        return self._tasks.setdefault(worker, deque())

    def remaining(self, worker: int) -> int:
        """Samples ``worker`` still has to do in the tasks it holds."""
        return sum(t.remaining for t in self._tasks.get(worker, ()))

    def top_up(self, worker: int, active) -> None:
        """Hand ``worker`` shards until it holds COMMITTED tasks; with none left, split the
        task of another (``active()``: the workers that may donate)."""
        tasks = self.tasks(worker)
        while len(tasks) < COMMITTED:
            shard = self.balancer.next_shard(worker)
            if shard is None:
                break
            size = self.shard_sizes[shard]
            ranges = self.pending_ranges.pop(shard, None) or [(0, size)]
            done = size - sum(hi - lo for lo, hi in ranges)
            if done:
                self.balancer.discount(worker, done)
            for lo, hi in ranges:
                tasks.append(Task(self.epoch, shard, lo, hi))
        if not tasks and self.part_way:
            self._split_for(worker, active())

    def advance(self, worker: int, hi: int) -> Task | None:
        """``worker`` pushed positions up to ``hi`` of its current task; returns the task if
        that finished it."""
        tasks = self._tasks[worker]
        task = tasks[0]
        task.pos = hi
        if task.pos >= task.end:
            return tasks.popleft()
        return None

    def delivered(self, worker: int) -> None:
        """``worker`` received a reply: any cut made to its task is now known to it."""
        self._trunc.discard(worker)

    def _split_for(self, thief: int, active: list[int]) -> None:
        """server._split_for without pipelining: the tail of the task that would finish
        last goes to the idle ``thief``, cut so that both finish together."""
        best = None
        for d in active:
            tasks = self._tasks.get(d)
            if d == thief or not tasks or d in self._trunc:
                continue
            task = tasks[-1]
            if task.epoch != self.epoch:
                continue
            current = len(tasks) == 1
            sent = self.batch_sent.get(d, 0)
            cut_min = task.pos + (sent if current else 0)
            splittable = task.end - cut_min
            if splittable < max(2 * sent, self.batch.get(thief, 1)):
                continue
            r_d = max(1e-9, self.balancer.effective_rate(d))
            r_t = max(1e-9, self.balancer.effective_rate(thief))
            before = sum(t.remaining for t in tasks) - splittable
            keep = int((splittable * r_d - before * r_t) / (r_d + r_t))
            keep = min(max(keep, 0), splittable)
            give = splittable - keep
            finish = (before + splittable) / r_d
            if give >= self.batch.get(thief, 1) and (best is None or finish > best[0]):
                best = (finish, d, task, cut_min + keep)
        if best is None:
            return
        _, donor, task, cut = best
        end = task.end
        self.balancer.discount(donor, end - cut)
        task.end = cut
        self._trunc.add(donor)
        tasks = self._tasks[donor]
        if task.remaining <= 0 and task is tasks[-1] and len(tasks) > 1:
            tasks.pop()
        self.tasks(thief).append(Task(task.epoch, task.shard, cut, end))
        self.splits += 1

    def take_back(self, worker: int) -> None:
        """What is left of ``worker``'s tasks this epoch goes back to the balancer (the
        worker is lost or benched, and already out of the balancer)."""
        requeue = []
        for task in self._tasks.get(worker, ()):
            if task.epoch == self.epoch and task.remaining > 0:
                self.pending_ranges.setdefault(task.shard, []).append((task.pos, task.end))
                if task.shard not in requeue:
                    requeue.append(task.shard)
        self._tasks[worker] = deque()
        self._trunc.discard(worker)
        if requeue:
            self.balancer.requeue(requeue)
