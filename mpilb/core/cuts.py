"""Part-way moves of the task ledger: where a started task may be cut, and who takes its tail.

Two moments cut a task (:class:`mpilb.core.tasks.TaskLedger` calls both from ``top_up``):

- :func:`split_for`: a worker with nothing left takes the tail of the task that would
  finish last (the donor keeps the head, both finish together);
- :func:`trim_tail`: at a worker's own reply, the part of its last task it would finish
  after the others could goes back to the balancer, for a busy worker to take at its next
  push (a worker behind a slow link would otherwise start its epoch's last step long after
  the fast ones could have done it, and they would wait it out).

Pure, as the ledger: the balancer's estimates decide, the ledger's holdings change.
"""

from __future__ import annotations

from typing import Optional

from mpilb.core.holdings import Holding, ShardEvent, Task

# `ledger` below is the mpilb.core.tasks.TaskLedger that calls these (not imported: the
# ledger imports this module)


def split_for(ledger, thief: int, batch: int) -> Optional[tuple[int, Task, int]]:
    """Give an idle worker the tail of the task that would finish last (part-way move).

    The donor keeps [pos, cut) and the thief takes [cut, end), with the cut chosen so both
    finish together; `cut` lies past anything the donor may already be computing, and the
    donor learns of it in its next reply, before it could reach it. `batch`: the thief's
    batch size. Returns (donor, donor's task, cut) or None.
    """
    if not ledger.split or thief in ledger.gone:
        return None
    best = None
    for d in ledger.of.values():
        if d.rank == thief or d.rank in ledger.gone or not d.tasks or d.cut is not None:
            continue
        task = d.tasks[-1]
        if task.epoch != ledger.epoch:
            continue
        if task.src >= 0 and task.pos == task.start:
            continue   # its rows are still on their way to the donor: nothing to send yet
        current = len(d.tasks) == 1
        if ledger.holders is not None and not current and d.rank not in ledger.holders[task.shard]:
            continue   # its rows are not in the donor's memory or store: nothing to send
        if d.rank in ledger.readers and thief not in ledger.holders[task.shard]:
            continue   # a joiner reads its node's copies but sends no rows (ledger.readers)
        cut_min = first_cut(ledger, d, task, current)
        splittable = task.end - cut_min
        if splittable <= 0:
            continue
        r_d = max(1e-9, ledger.balancer.effective_rate(d.rank))
        r_t = max(1e-9, ledger.balancer.effective_rate(thief))
        before = d.remaining - splittable
        keep = int((splittable * r_d - before * r_t) / (r_d + r_t))
        keep = min(max(keep, 0), splittable)
        give = splittable - keep
        finish = (before + splittable) / r_d
        # Worth a move: a batch or more, from a tail of two of the donor's batches or
        # more; from a slower donor, also a shorter tail that costs the donor at least
        # what one of its batches costs the thief (a worker behind a slow link spends a
        # step's time on a step of a few samples: the fast ones would wait it out).
        worth = give >= batch and splittable >= max(2 * d.batch_sent, batch)
        if r_d < r_t and give > 0 and give * r_t >= batch * r_d:
            worth = True
        if worth and (best is None or finish > best[0]):
            best = (finish, d, task, cut_min + keep)
    if best is None:
        return None
    _, donor, task, cut = best
    end = task.end
    ledger.balancer.discount(donor.rank, end - cut)
    task.end = cut
    donor.cut = (task.epoch, task.shard, cut)
    if task.remaining <= 0 and task is donor.tasks[-1] and len(donor.tasks) > 1:
        donor.tasks.pop()
    ledger.assign(thief, task.shard, cut, end, source=donor.rank, event="move")
    return donor.rank, task, cut


def trim_tail(ledger, rank: int, batch: int) -> Optional[int]:
    """At `rank`'s reply: give back the part of its last task it would finish after the
    others could have (the balancer's :meth:`keep_of_tail`), for whoever asks next.

    Called while `rank` waits for its reply (it computes nothing, or, pipelined, the
    batch its push announced), so the cut may lie right there: the reply carries it
    before the worker takes another batch. A worker behind a slow link otherwise
    starts the epoch's last step long after the fast ones could have done it, and they
    wait it out (a part-way move cannot take a batch already started). Returns the cut,
    or None.
    """

    h = ledger.of[rank]
    if not ledger.split or ledger.holders is not None or rank in ledger.gone or h.cut is not None:
        return None
    if h.assigns:
        # Handed out in this top-up (an idle worker being woken, or its prefetch): the
        # server wakes a worker that is owed an assignment, and one whose only task is cut
        # away with it would wait for work while the server waits for its push. Such a
        # task is judged at its next reply.
        return None
    task = h.tasks[-1] if h.tasks else None
    if task is None or task.epoch != ledger.epoch or task.src >= 0:
        return None
    reach = task.pos
    if ledger.pipeline and h.next_shard == task.shard and task.pos <= h.next_hi:
        reach = h.next_hi   # the batch it computes now, announced with this push
    tail = task.end - reach
    if tail <= 0:
        return None
    keep, taker = ledger.balancer.keep_of_tail(rank, h.remaining - tail, tail, batch)
    if keep >= tail or taker is None:
        return None
    cut = reach + max(0, keep)
    end = task.end
    ledger.balancer.discount(rank, end - cut)
    task.end = cut
    h.cut = (task.epoch, task.shard, cut)
    if task.remaining <= 0:
        h.tasks.pop()
    queued = task.shard in ledger.pending_ranges   # queued once already: its ranges go together
    ledger.pending_ranges.setdefault(task.shard, []).append((cut, end))
    if not queued:
        ledger.balancer.give_back(task.shard, rank, taker)
    ledger.events.append(ShardEvent(task.epoch, task.shard, rank, taker, "move"))
    ledger.collect_moves()
    return cut


def first_cut(ledger, d: Holding, task: Task, current: bool) -> int:
    """The first position a cut may take: past whatever the donor may reach before it
    reads the cut. Without pipelining, one batch past what it computes now (a task it has
    not started stays untouched). Pipelined, the donor may have pushed one more batch than
    we have seen and compute the next while it waits, and it reads the cut only in the
    reply to that push:

    - its last push announced a batch of this shard (NEXT_HI): one batch past it (the
      announced one may be pushed already, and the one after it computed meanwhile);
    - it announced a batch of another shard: one batch past ``pos`` (the batch after the
      announced one may start this task);
    - it announced none (nothing was left when it pushed): two batches past ``pos`` (a
      reply since may have brought this task, whose first batch it pushed and whose
      second it computes).

    (Until 2026-12-01 two batches past the announced one in every case; the simulator's
    pipelined workers check the rule: a batch pushed past its cut is counted as stray.)"""
    b = d.batch_sent
    if ledger.pipeline:
        if d.next_shard == task.shard:
            return max(task.pos, d.next_hi) + b
        return task.pos + (2 * b if d.next_shard < 0 else b)
    return task.pos + (b if current else 0)
