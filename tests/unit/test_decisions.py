"""The server's pure decisions (mpilb.core.decisions) with fake workers and a fake driver:
the first sizes, the rebalance timer, waking idle workers and the batch sizes."""

from types import SimpleNamespace

import pytest

from mpilb.core.balancer import BalancerConfig, build_balancer
from mpilb.core.decisions import (FIRST_SIZES_STEPS, Decisions, FirstSizes, Interval, RebalanceTimer,
                                  SampleInterval)
from mpilb.core.tasks import TaskLedger
from mpilb.core.worker_state import Membership, Waiting
from mpilb.server.peers import Peer
from mpilb.simulate.workers import SimWorker


def busy(rank, step=0):
    p = Peer(rank, batch=32, step=step)
    p.wake()
    return p


def test_first_sizes_are_due_once_when_every_busy_worker_took_its_steps():
    first = FirstSizes(proportional=True)
    assert not first.due([busy(1, FIRST_SIZES_STEPS), busy(2, FIRST_SIZES_STEPS - 1)])
    assert not first.due([])
    assert first.due([busy(1, FIRST_SIZES_STEPS), busy(2, FIRST_SIZES_STEPS)])
    assert not first.due([busy(1, 99)])                      # once
    assert not FirstSizes(proportional=False).due([busy(1, 99)])
    # the event-driven form judges only as a worker reaches the count
    idle = Peer(3, step=0)
    first = FirstSizes(proportional=True)
    assert not first.due_after_step(FIRST_SIZES_STEPS + 1, lambda: [busy(1, 99), idle])
    assert first.due_after_step(FIRST_SIZES_STEPS, lambda: [busy(1, 99), idle])


def test_rebalance_timer_interval_first_sizes_and_warmup():
    timer = RebalanceTimer(2.0, proportional=False, start=10.0)
    workers = [busy(1), busy(2)]
    known = set()
    assert not timer.due(11.0, workers, known.__contains__)
    known |= {1, 2}
    assert timer.due(11.0, workers, known.__contains__)      # the first rates: at once
    timer.done(11.0)
    assert not timer.due(11.2, workers, known.__contains__)
    assert timer.due(11.25, workers, known.__contains__)     # then 0.25 s later
    timer.done(11.25)
    assert timer.due(13.25, workers, lambda r: True)         # and every interval
    tick = Interval(5.0, start=1.0)
    assert not tick.due(5.9) and tick.due(6.0)
    tick.reset(6.0)
    assert not tick.due(10.9)


class Driver:
    """Records what the decisions ask of the server or the simulator."""

    def __init__(self, workers, ledger):
        self.workers, self.ledger = workers, ledger
        self.woken, self.benched_ranks, self.moved = [], [], 0

    def present(self):
        return [w for w in self.workers if w.present]

    def top_up(self, w):
        if not w.benched:
            self.ledger.top_up(w.rank, w.batch)

    def has_work(self, w):
        return bool(self.ledger.of[w.rank].assigns)

    def wake(self, w, t, floor):
        w.step = max(w.step, floor or 0)
        w.wake() if isinstance(w, Peer) else w.compute()
        self.woken.append((w.rank, t, floor))

    def benched(self, w):
        self.benched_ranks.append(w.rank)

    def shards_moved(self):
        self.moved += len(self.ledger.take_events())


def decisions_for(workers, sizes, **bcfg):
    ranks = [w.rank for w in workers]
    bal = build_balancer("load", ranks, sizes, BalancerConfig(batch=32, **bcfg))
    bal.plan_epoch(0, list(range(len(sizes))))
    ledger = TaskLedger(bal, sizes, ranks)
    driver = Driver(workers, ledger)
    return Decisions(bal, ledger, None, 32, driver), driver, ledger


def test_wake_idle_sends_work_to_the_idle_at_the_busy_ones_lowest_step():
    a, b, c = busy(1, step=7), busy(2, step=5), Peer(3, batch=32, step=1)
    decisions, driver, ledger = decisions_for([a, b, c], [100] * 6)
    for w in (a, b):
        ledger.top_up(w.rank, 32)
        ledger.take_reply(w.rank, 32)
    decisions.wake_idle(t=4.0)
    assert driver.woken == [(3, 4.0, 5)] and c.step == 5 and not c.idle
    assert driver.moved >= 2   # its hand-outs, taken as shard events


def test_the_same_decisions_drive_the_simulators_workers():
    """A simulated worker has the server's states: the one code serves both."""
    w = SimWorker(1, SimpleNamespace(), [], 32, 0)
    assert (w.waiting, w.membership) == (Waiting.IDLE, Membership.ACTIVE) and w.idle
    decisions, driver, _ = decisions_for([w], [100] * 2)
    decisions.wake_idle(t=0.5)
    assert driver.woken == [(1, 0.5, None)]
    w.die()
    assert not w.present and not w.lost
    w.lose()
    assert w.lost and not w.present


def test_update_batches_sizes_every_worker_and_clears_its_lags():
    a, b = busy(1), busy(2)
    a.lags, b.lags = [0.1], [0.2]
    decisions, _, _ = decisions_for([a, b], [100] * 4, batch_policy="proportional")
    decisions.update_batches(now=1.0)
    assert a.batch == b.batch == 32 and a.lags == [] == b.lags


@pytest.mark.parametrize("proportional", [True, False])
def test_rebalance_plans_wakes_and_sizes(proportional):
    a, b = busy(1), Peer(2, batch=32)
    decisions, driver, ledger = decisions_for(
        [a, b], [100] * 4, batch_policy="proportional" if proportional else "fixed")
    ledger.top_up(1, 32)
    ledger.take_reply(1, 32)
    decisions.rebalance(t=2.0, now=2.0)
    assert [r for r, _, _ in driver.woken] == [2]


def test_sample_interval_is_due_once_per_multiple_passed_counting_on_from_a_start():
    every = SampleInterval(100)
    assert [every.add(32) for _ in range(7)] == [False, False, False, True, False, False, True]
    assert every.add(250)                     # passes 300 and 400: one evaluation, due once
    assert not every.add(10) and every.next == 500
    resumed = SampleInterval(100, start=290)  # a resumed run's count from its log
    assert resumed.add(10) and not resumed.add(50)
    off = SampleInterval(None)
    assert not any(off.add(10 ** 6) for _ in range(3))
