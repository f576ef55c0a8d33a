"""The task ledger: which worker covers which positions of which shard (pure: no MPI, no log).

A task is positions [pos, end) of one shard's permuted order in one epoch. The balancer owns
the shard queues; the ledger turns its decisions into tasks and keeps, per worker, what it
holds and what it has yet to be told (assignments, send orders, a cut). A worker holds at
most COMMITTED tasks (the current one and the one it prefetches); everything still queued
can be moved without asking it, and the tail of a started task can be cut off and handed to
an idle worker (a part-way move, :meth:`TaskLedger.split_for`).

What happened (assign, move, start, done, reassign) is collected as :class:`ShardEvent`s for
the caller to log (:meth:`TaskLedger.take_events`). The live server and a simulator drive the
same code: give it worker ranks, batch sizes and (through the balancer) rates; read back the
tasks and the messages each worker is owed.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Optional

from mpilb.core import cuts
from mpilb.core.holdings import Holding, ShardEvent, Task
from mpilb.mpi.wire import MAX_ASSIGN, MAX_ORDER, SHARD_TAGS, TAG_SHARD_BASE, OrderMsg, TaskMsg, resource_tag

COMMITTED = 2   # shards a worker holds at once: the current one and the one it prefetches


class TaskLedger:
    """Tasks per worker, kept in step with a :class:`~mpilb.core.balancer.Balancer`.

    Args:
        balancer: the live balancer (queues, rates, discounts, requeues).
        shard_sizes: samples per shard.
        ranks: the workers.
        holders: with a node-local store, shard -> ranks holding a copy; None when every
            rank reads every shard.
        row_nbytes: bytes of one sample (for the `bytes` of a move over MPI).
        pipeline: workers compute one batch ahead (--pipeline 1): cuts keep further away.
        split: part-way moves allowed (not for the fixed static/round-robin plans).

    `readers`: workers in `holders` that read their node's copies of those shards but send
    no rows (workers that joined: they reach rank 0 only, docs/membership.md); never chosen
    to send rows, nor counted as a copy another worker's rows could come from.
    """

    def __init__(self, balancer, shard_sizes: list[int], ranks: Iterable[int], *,
                 holders: Optional[dict] = None, row_nbytes: int = 0, pipeline: bool = False,
                 split: bool = True):
        self.balancer = balancer
        self.shard_sizes = list(shard_sizes)
        self.holders = holders
        self.row_nbytes = row_nbytes
        self.pipeline = pipeline
        self.split = split
        self.of = {r: Holding(r) for r in ranks}
        self.gone: set[int] = set()   # lost: neither holder nor donor any more
        self.readers: set[int] = set()   # hold copies, send none (see above)
        self.epoch = 0
        # shard -> [(start, end)] still to do when it is next handed out (a lost worker's
        # remainder, or an interrupted epoch's gaps)
        self.pending_ranges: dict[int, list[tuple[int, int]]] = {}
        self.transfers = 0
        self.events: list[ShardEvent] = []
        self.ordered: list[int] = []   # ranks given new send orders since the last look

    # ----------------------------------------------------------------- reading
    def tasks(self, rank: int) -> deque:
        return self.of[rank].tasks

    def current(self, rank: int) -> Optional[Task]:
        tasks = self.of[rank].tasks
        return tasks[0] if tasks else None

    def committed(self, ranks: Iterable[int]) -> dict[int, int]:
        """Samples each worker still holds (for the balancer's rebalance)."""
        return {r: self.of[r].remaining for r in ranks}

    def take_events(self) -> list[ShardEvent]:
        events, self.events = self.events, []
        return events

    def take_ordered(self) -> list[int]:
        """Ranks given send orders since the last call (a waiting one must be told now)."""
        ranks, self.ordered = self.ordered, []
        return ranks

    def expects_rows_from(self, rank: int) -> list[tuple[int, Task]]:
        """(receiver, task) for every task still waiting for rows from `rank`."""
        return [(h.rank, t) for h in self.of.values() if h.rank not in self.gone
                for t in h.tasks if t.src == rank and t.pos == t.start]

    def awaits_rows(self, rank: int) -> Optional[int]:
        """The rank whose rows `rank` may be blocked waiting for now, or None: its current
        task's rows come from another rank and no push of that task has come yet. Such a
        worker reads only send orders (ORDERS) until they arrive, and is silent meanwhile."""
        task = self.current(rank)
        if task is not None and task.src >= 0 and task.pos == task.start:
            return task.src
        return None

    # ----------------------------------------------------------------- epochs
    def begin_epoch(self, epoch: int, pending_ranges: Optional[dict] = None) -> None:
        self.epoch = epoch
        if pending_ranges is not None:
            self.pending_ranges = pending_ranges
        self.collect_moves()

    def collect_moves(self) -> None:
        """The balancer's own moves (rebalance, lost or benched workers) as events."""
        for mv in self.balancer.take_moves():
            self.events.append(ShardEvent(self.epoch, mv.shard, mv.src, mv.dst,
                                          "reassign" if mv.reason == "lost" else "move"))

    # ----------------------------------------------------------------- handing out
    def top_up(self, rank: int, batch: int) -> None:
        """Hand `rank` shards until it holds COMMITTED; with none left, split another's."""
        h = self.of[rank]
        while len(h.tasks) < COMMITTED:
            shard = self.balancer.next_shard(rank, prefetch=bool(h.tasks))
            if shard is None:
                break
            size = self.shard_sizes[shard]
            ranges = self.pending_ranges.pop(shard, None) or [(0, size)]
            done = size - sum(hi - lo for lo, hi in ranges)
            if done:   # a remainder (resumed or taken over): only that part is work
                self.balancer.discount(rank, done)
            for lo, hi in ranges:
                self.assign(rank, shard, lo, hi)
        self.collect_moves()
        if not h.tasks:
            self.split_for(rank, batch)
        else:
            self.trim_tail(rank, batch)

    def assign(self, rank: int, shard: int, lo: int, hi: int, source: Optional[int] = None,
               event: str = "assign") -> None:
        """Give `rank` positions [lo, hi) of `shard`; with a local store, have a holder send them."""
        src, tag, nbytes = -1, 0, 0
        # A rank holding a copy reads it itself, even for the tail of another's task: no
        # transfer to wait for, and no rows owed by a rank that may yet be lost.
        if self.holders is not None and rank not in self.holders[shard]:
            giver = source if source is not None else self.holder_for(shard, hi - lo)
            src, tag = giver, self._next_tag()
            nbytes = (hi - lo) * self.row_nbytes
            self.of[giver].orders.append(OrderMsg(self.epoch, shard, lo, hi, rank, tag))
            self.ordered.append(giver)
        self.of[rank].tasks.append(Task(self.epoch, shard, lo, hi, src, tag=tag))
        self.of[rank].assigns.append(TaskMsg(self.epoch, shard, lo, hi, src, tag))
        origin = src if src >= 0 else (source if source is not None else -1)
        self.events.append(ShardEvent(self.epoch, shard, origin, rank,
                                      event if origin < 0 else "move", nbytes))

    def holder_for(self, shard: int, rows: int, exclude: Iterable[int] = ()) -> int:
        """The holder of a shard copy that can deliver soonest.

        A holder must read the rows before it sends them; its rate includes its reads, so
        (work it holds + the rows) / rate ranks a slow reader last even when it is idle.
        """
        alive = [r for r in self.holders[shard]
                 if r not in self.gone and r not in exclude and r not in self.readers]
        if not alive:
            raise RuntimeError(f"shard {shard}: {self.copies_lost(shard)}")
        return min(alive, key=lambda r: (self.of[r].remaining + rows)
                   / max(1e-9, self.balancer.effective_rate(r)))

    def copies_lost(self, shard: int) -> str:
        """What became of a shard's copies, for the line that ends the run: the advice to
        keep more copies only where there was one."""
        holders = [r for r in self.holders[shard] if r not in self.readers]
        ranks = ", ".join(map(str, holders))
        if len(holders) == 1:
            return (f"its only copy was on rank {ranks}, which was lost (use --replicas 2 or "
                    f"more to survive this)")
        return (f"all {len(holders)} of its copies (--replicas {len(holders)}) were on ranks "
                f"that were lost: {ranks}")

    def resource(self, lost: int) -> list[tuple[int, Task]]:
        """Rows `lost` owed go out again from another holder of the shard.

        The receiver posted its receives for the rows from every holder of the shard at
        once (the first copy to arrive is used), the others with :func:`resource_tag`: the
        new holder is ordered to send with that tag, so the receiver needs no new message
        even while it blocks waiting for the rows. Returns the (receiver, task) re-sourced.

        Raises:
            RuntimeError: no other live rank holds a copy (--replicas 1).
        """
        moved = self.expects_rows_from(lost)
        for receiver, task in moved:
            try:
                giver = self.holder_for(task.shard, task.remaining, exclude=(lost, receiver))
            except RuntimeError:
                raise RuntimeError(
                    f"rank {lost} was lost before sending rows of shard {task.shard} to rank "
                    f"{receiver}, and no other live rank holds a copy: "
                    f"{self.copies_lost(task.shard)}; resume from the last checkpoint") from None
            task.src, task.tag = giver, resource_tag(task.tag)
            self.of[giver].orders.append(OrderMsg(task.epoch, task.shard, task.start, task.end,
                                                  receiver, task.tag))
            self.ordered.append(giver)
            self.events.append(ShardEvent(task.epoch, task.shard, giver, receiver, "move",
                                          task.remaining * self.row_nbytes))
        return moved

    def _next_tag(self) -> int:
        self.transfers += 1
        return TAG_SHARD_BASE + 2 * (self.transfers % SHARD_TAGS)

    def split_for(self, thief: int, batch: int) -> Optional[tuple[int, Task, int]]:
        """Give an idle worker the tail of the task that would finish last (a part-way move;
        :func:`mpilb.core.cuts.split_for`). Returns (donor, donor's task, cut) or None."""
        return cuts.split_for(self, thief, batch)

    def trim_tail(self, rank: int, batch: int) -> Optional[int]:
        """At `rank`'s reply: give back what it would finish after the others could
        (:func:`mpilb.core.cuts.trim_tail`). Returns the cut or None."""
        return cuts.trim_tail(self, rank, batch)

    # ----------------------------------------------------------------- progress
    def note_next(self, rank: int, next_shard: int, next_hi: int) -> None:
        """Pipeline: the batch `rank` computes while its push travels."""
        h = self.of[rank]
        h.next_shard, h.next_hi = next_shard, next_hi

    def matches(self, rank: int, epoch: int, shard: int, lo: Optional[int] = None,
                hi: Optional[int] = None) -> bool:
        """True if a push for (epoch, shard) belongs to `rank`'s current task; with `lo`
        and `hi`, if positions [lo, hi) are also its next part (from where the task stands,
        inside it). A batch outside its task may hold positions given to another worker:
        applied, they would be applied twice."""
        task = self.current(rank)
        if task is None or task.shard != shard or task.epoch != epoch:
            return False
        return lo is None or (lo == task.pos and lo < hi <= task.end)

    def advance(self, rank: int, hi: int) -> bool:
        """`rank` covered its current task up to `hi`. Returns True when the task is done."""
        h = self.of[rank]
        task = h.tasks[0]
        first = task.pos == 0
        task.pos = hi
        if first:
            self.events.append(ShardEvent(task.epoch, task.shard, -1, rank, "start"))
        if task.pos >= task.end:
            h.tasks.popleft()
            self.events.append(ShardEvent(task.epoch, task.shard, -1, rank, "done"))
            return True
        return False

    # ----------------------------------------------------------------- messages owed
    def take_reply(self, rank: int, batch: int) -> tuple[list, list, Optional[tuple]]:
        """What the next reply to `rank` carries: (assignments, send orders, cut), at most
        MAX_ASSIGN and MAX_ORDER; the rest waits for the reply after. `batch`: the batch
        size the reply tells it to use."""
        h = self.of[rank]
        h.batch_sent = max(h.batch_sent, batch) if h.tasks else batch
        assigns, h.assigns = h.assigns[:MAX_ASSIGN], h.assigns[MAX_ASSIGN:]
        orders = self.take_orders(rank)
        cut, h.cut = h.cut, None
        return assigns, orders, cut

    def take_orders(self, rank: int) -> list:
        h = self.of[rank]
        orders, h.orders = h.orders[:MAX_ORDER], h.orders[MAX_ORDER:]
        return orders

    def has_orders(self, rank: int) -> bool:
        return bool(self.of[rank].orders)

    # ----------------------------------------------------------------- taking back
    def can_take_back(self, rank: int) -> bool:
        """False while rows are on their way to or from `rank` (it must finish those)."""
        h = self.of[rank]
        return not (any(t.src >= 0 for t in h.tasks) or h.orders)

    def take_back(self, rank: int, lost: bool = False) -> list[int]:
        """What is left of `rank`'s tasks this epoch goes back to the balancer, as ranges
        for whoever gets the shard next (`rank` lost or benched, and already out of the
        balancer). Unsent assignments and cut are forgotten. Returns the shards requeued."""
        h = self.of[rank]
        if lost:
            self.gone.add(rank)
        else:
            h.assigns.clear()
            h.cut = None
        requeue = []
        for task in h.tasks:
            if task.epoch == self.epoch and task.remaining > 0:
                # A shard with ranges pending is queued once already (a tail given back by
                # trim_tail): queued again, its second taker would get all of it.
                if task.shard not in self.pending_ranges and task.shard not in requeue:
                    requeue.append(task.shard)
                self.pending_ranges.setdefault(task.shard, []).append((task.pos, task.end))
                self.events.append(ShardEvent(task.epoch, task.shard, rank, -1, "reassign"))
        h.tasks.clear()
        if requeue:
            self.balancer.requeue(requeue)
        self.collect_moves()
        return requeue
