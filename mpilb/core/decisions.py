"""The server's decisions between pushes, pure: when to rebalance, and what a rebalance does.

One copy, driven by the live server (:mod:`mpilb.server.epochs`, :mod:`mpilb.server.chores`) and by the simulator
(:mod:`mpilb.simulate.engine`) alike:

- :class:`FirstSizes`: proportional batches are sized as soon as every busy worker has taken
  ``FIRST_SIZES_STEPS`` steps, not only at the first --rebalance-interval (a slow worker
  costs every round);
- :class:`Interval`: a timer of the live server (evaluations, checkpoints);
- :class:`RebalanceTimer`: the interval, the first sizes, and the warm-up rebalances of
  the live server (the simulator rebalances on its own event clock);
- :class:`Decisions`: a rebalance (probes, the balancer's plan, moves), waking idle workers
  that were given work, and the batch sizes with sit-out's benching, each over the driver's
  workers through a small :class:`Driver` interface (what differs: the server sends replies
  and logs `shards/` rows, the simulator schedules steps and counts moves).

The workers are the driver's objects: ``rank``, ``step``, ``batch``, ``idle``, ``benched``,
``probing``, ``lags`` (the server's :class:`~mpilb.server.peers.Peer`, the simulator's
:class:`~mpilb.simulate.engine.SimWorker`).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

FIRST_SIZES_STEPS = 16   # proportional batches are first sized after this many steps each
WARMUP_FIRST_S = 0.25    # after the first rates, rebalance after 0.25, 0.5, 1 ... s


def busy(present) -> list:
    """The workers with work in hand (computing or held): those whose steps count."""
    return [w for w in present if not w.idle]


class FirstSizes:
    """Proportional batches: due once, as soon as every busy worker has taken a few steps.

    Args:
        proportional: --batch-policy proportional (with any other policy it is never due).
    """

    def __init__(self, proportional: bool):
        self.done = not proportional

    def due(self, busy_workers) -> bool:
        """True the first time every one of ``busy_workers`` has taken FIRST_SIZES_STEPS."""
        if self.done:
            return False
        if busy_workers and all(w.step >= FIRST_SIZES_STEPS for w in busy_workers):
            self.done = True
            return True
        return False

    def due_after_step(self, step: int, present: Callable[[], list]) -> bool:
        """As :meth:`due`, judged only as a worker reaches its FIRST_SIZES_STEPS-th step
        (an event-driven caller: nothing else can make it due)."""
        return not self.done and step == FIRST_SIZES_STEPS and self.due(busy(present()))


CHORES_S = 0.01   # how often the live server's loop runs its chores (timers included)

# A worker's pushes are taken once rank 0's chunks of them are all in, instead of at their
# header, from its first push until one came within this of its header; then streamed, until
# one keeps rank 0 waiting longer than this (a slow link). Rank 0 streams a push's slice chunk
# by chunk and waits for each chunk, and a worker behind a 100 Mbit/s link held it, and every
# other worker, for each of its pushes (benchmarks/cluster.py (f): 2.8x the run without that
# node; 1.13-1.18x deferring from the second push on; 1.02-1.06x from the first). The
# server's receive loop (server/receive.py) and the simulator (simulate/streams.py) both
# follow it.
DEFER_S = 0.02


class Interval:
    """A timer that is due every ``every`` seconds after its last :meth:`reset`.

    Args:
        every: seconds (--eval-interval, --checkpoint-interval).
        start: the clock's reading it counts from.
    """

    def __init__(self, every: float, start: float = 0.0):
        self.every = every
        self.last = start

    def due(self, now: float) -> bool:
        return now - self.last >= self.every

    def reset(self, now: float) -> None:
        self.last = now


class SampleInterval:
    """Due each time the samples applied over the run pass a multiple of ``every``
    (--eval-every); never where ``every`` is None.

    Args:
        every: samples between evaluations, or None.
        start: the samples applied before this launch (a resumed run's, from its log).
    """

    def __init__(self, every: Optional[int], start: int = 0):
        self.every = every
        self.samples = start
        self.next = None if every is None else (start // every + 1) * every

    def add(self, n: int) -> bool:
        """Count `n` more samples applied; True when an evaluation is due now (once,
        however many multiples one update passed)."""
        self.samples += n
        if self.next is None or self.samples < self.next:
            return False
        self.next = (self.samples // self.every + 1) * self.every
        return True


class RebalanceTimer:
    """When the live server rebalances: every ``interval`` seconds, at the first sizes, and
    while the first rate estimates settle (warm-up).

    Rates learnt from the first steps are used at once: a rebalance as soon as every busy
    worker has a first estimate (a bucket of its first steps), then after 0.25, 0.5, 1 ... s
    while the estimates settle, until the gap reaches ``interval``. A run of a few seconds
    would otherwise spend its first interval on a blind plan.

    Args:
        interval: --rebalance-interval, seconds.
        proportional: --batch-policy proportional (see :class:`FirstSizes`).
        start: the clock's reading at the start of the run.
    """

    def __init__(self, interval: float, proportional: bool, start: float = 0.0):
        self.interval = interval
        self.last = start
        self.first_sizes = FirstSizes(proportional)
        self.warmup_gap: Optional[float] = None

    def due(self, now: float, present, rate_known: Callable[[int], bool]) -> bool:
        """A rebalance is due at ``now`` (``present``: the workers in the run)."""
        return (now - self.last >= self.interval or self.first_sizes.due(busy(present))
                or self.warmup_due(now, present, rate_known))

    def warmup_due(self, now: float, present, rate_known: Callable[[int], bool]) -> bool:
        gap = self.warmup_gap
        if gap is None:
            working = busy(present)
            if working and all(rate_known(w.rank) for w in working):
                self.warmup_gap = WARMUP_FIRST_S
                return True
            return False
        if gap < self.interval and now - self.last >= gap:
            self.warmup_gap = 2 * gap
            return True
        return False

    def done(self, now: float) -> None:
        """A rebalance was made at ``now``."""
        self.last = now


class Driver(Protocol):
    """What :class:`Decisions` asks of the server or the simulator that drives it."""

    def present(self) -> list:
        """The workers in the run (active or benched)."""

    def top_up(self, w) -> None:
        """Hand ``w`` tasks (the ledger's top-up), where it may take them."""

    def has_work(self, w) -> bool:
        """An idle ``w`` was given work to be told of."""

    def wake(self, w, t: float, floor: Optional[int]) -> None:
        """Send idle ``w`` its work at ``t``; ``floor``: the busy workers' lowest step."""

    def benched(self, w) -> None:
        """Sit-out benched idle ``w`` (its tasks went back)."""

    def shards_moved(self) -> None:
        """The ledger may hold new shard events (moves, hand-outs): take them."""


class Decisions:
    """A rebalance, waking idle workers and sizing batches, over a :class:`Driver`.

    Args:
        balancer: the :class:`~mpilb.core.balancer.Balancer`.
        ledger: the :class:`~mpilb.core.tasks.TaskLedger`.
        sitout: the :class:`~mpilb.core.sitout.SitOut` policy, or None.
        batch: --batch, for a worker the balancer does not size.
        driver: the :class:`Driver`.
    """

    def __init__(self, balancer, ledger, sitout, batch: int, driver: Driver):
        self.balancer = balancer
        self.ledger = ledger
        self.sitout = sitout
        self.batch = batch
        self.driver = driver

    def rebalance(self, t: float, now: float) -> None:
        """The balancer plans again on what each worker still holds (``t``: the run's clock
        for the balancer, ``now``: the clock of sit-out's probes)."""
        present = self.driver.present()
        committed = self.ledger.committed(w.rank for w in present)
        if self.sitout is not None:
            self.sitout.start_probes(present, now)
        self.balancer.rebalance(t, committed)
        self.ledger.collect_moves()
        self.driver.shards_moved()
        self.wake_idle(t)
        self.update_batches(now)

    def wake_idle(self, t: float) -> None:
        """Send work to idle workers that the balancer has given shards to (e.g. by a move).
        A woken worker's step count starts at the busy ones' lowest, as at an epoch's start
        (the driver's :meth:`Driver.wake` applies it): its old count, left behind while it
        idled, would have ssp hold every other worker until it caught up."""
        present = self.driver.present()
        floor = min((w.step for w in present if not w.idle), default=None)
        for w in present:
            if w.idle:
                self.driver.top_up(w)
                if self.driver.has_work(w):
                    self.driver.wake(w, t, floor)
        self.driver.shards_moved()

    def update_batches(self, now: float) -> None:
        """Each worker's batch from the balancer's sizes, judged on the interval that just
        ended; sit-out's slow ones get 0 and, idle, are benched at once (else after their
        next push)."""
        sitout = self.sitout
        present = self.driver.present()
        slow = sitout.slow(present) if sitout is not None else set()
        sizes = self.balancer.batch_sizes(frozenset(slow))
        for w in present:
            w.batch = int(sizes.get(w.rank, self.batch))
            if w.probing:
                w.batch = sitout.probe_batch()
            elif w.rank in slow:
                w.batch = 0
            if w.batch == 0 and sitout is not None and not w.benched and w.idle:
                sitout.bench(w, present, now)   # nothing in flight: at once
                self.driver.benched(w)
            w.lags.clear()
