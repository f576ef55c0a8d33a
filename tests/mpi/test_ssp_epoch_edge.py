"""ssp at an epoch's edge: a held reply released after the epoch moved on carries the new
epoch's work, so no worker idles with shards still queued for it.

The first test drives rank 0's own protocol code (Epochs.begin, ParameterServer's _advance,
_respond, _release_held) without MPI: a fake outbox records replies, and a small event loop
stands in for the workers (each pushes its current task's next batch some seconds after its
reply). Every worker waiting (idle or held) with the epoch unfinished is what a live run
spends a whole --rebalance-interval on (the rebalance's wake_idle ends it): a stall here.
The second runs the engine under mpiexec.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from mpirun import config_stub

from mpilb.core.balancer import BalancerConfig, build_balancer
from mpilb.core.corrections import build_correction
from mpilb.core.decisions import Interval
from mpilb.core.optimizers import build_optimizer
from mpilb.runfiles.summary import summarize_log
from mpilb.runfiles.runlog import read_columns
from mpilb.server.epochs import Epochs
from mpilb.server.lifecycle import Clock
from mpilb.server.loop import ParameterServer
from mpilb.server.modes import ParamRing, build_rule
from mpilb.server.peers import Peer, Roster
from mpilb.core.tasks import TaskLedger
from mpilb.mpi.wire import Cmd

import mpirun


class Stall(AssertionError):
    pass


class FakeOutbox:
    """Records replies; a worker sent PARAMS with work computes its next batch."""

    def __init__(self, ledger, sim):
        self.ledger, self.sim = ledger, sim

    def reply(self, peer, ring, cmd=Cmd.PARAMS, held_s=0.0):
        if cmd == Cmd.STOP:
            self.sim.computing.pop(peer.rank, None)
            return
        self.ledger.take_reply(peer.rank, peer.batch)
        if peer.idle:
            self.sim.computing.pop(peer.rank, None)
        else:
            self.sim.computing[peer.rank] = self.sim.t + self.sim.step_s[peer.rank]

    def orders(self, peer):
        self.ledger.take_orders(peer.rank)


class Sim:
    """Rank 0's protocol code, with workers that take step_s[rank] seconds a batch."""

    def __init__(self, mode, bound, policy, shard_sizes, step_s, batch=32, epochs=3):
        ranks = sorted(step_s)
        self.t = 0.0
        self.step_s = step_s
        self.computing: dict[int, float] = {}   # rank -> when its next push arrives
        self.epochs = epochs
        self.total = sum(shard_sizes)
        self.done = 0
        bal = build_balancer(policy, ranks, shard_sizes, BalancerConfig(batch=batch))
        ledger = TaskLedger(bal, shard_sizes, ranks, split=policy not in ("static", "round-robin"))
        store = ParamRing(np.zeros(4, np.float32), build_optimizer("sgd", 4, lr=0.5),
                           build_correction("none"), nominal_batch=batch)
        # the server's protocol over its real parts (epochs, ledger, rule), MPI left out
        s = self.server = ParameterServer.__new__(ParameterServer)
        s.cfg = config_stub(seed=0, batch=batch, balancer=policy)
        dataset = SimpleNamespace(shard_sizes=list(shard_sizes))
        s.balancer, s.ledger, s.ring = bal, ledger, store
        s.rule = build_rule(mode, store, lambda r: ledger.of[r].owed, bound)
        s.roster = Roster({r: Peer(rank=r, batch=batch) for r in ranks})
        s.peers = s.roster.peers
        s.stop = SimpleNamespace(reason=None)
        s.tracker = SimpleNamespace(begin=lambda epoch, t, counts=None: None, complete=False)
        s.log = SimpleNamespace(append=lambda *a, **k: None)
        s.outbox = FakeOutbox(ledger, self)
        s.clock = Clock()
        session = SimpleNamespace(balancer=bal, tracker=s.tracker, stop=s.stop, log=s.log,
                                  progress=None, model=None)
        s.epochs = Epochs(s.cfg, dataset, session, ledger, s.roster, s.clock, None, None, s,
                          Interval(1e9))
        s.epochs.begin(0)

    def run(self) -> int:
        """Serve pushes until every worker is stopped; returns the epochs completed."""
        s = self.server
        epoch = 0
        while not all(w.stopped for w in s.peers.values()):
            if not self.computing:
                waiting = {r: w.waiting.value for r, w in s.peers.items()}
                raise Stall(f"epoch {s.ledger.epoch}: no worker computes ({waiting}), "
                            f"{self.total - self.done} samples to go; queued: "
                            f"{ {r: s.balancer.queued(r) for r in s.peers} }")
            rank = min(self.computing, key=lambda r: (self.computing[r], r))
            self.t = self.computing.pop(rank)
            w = s.peers[rank]
            if s.stop.reason:
                s._respond(w)
                continue
            task = s.ledger.current(rank)
            hi = min(task.pos + w.batch, task.end)
            self.done += hi - task.pos
            w.step += 1   # what _on_push does with a push that belongs to its task
            s._advance(w, hi)
            if self.done == self.total:   # _end_epoch: the next epoch, or the stop
                epoch += 1
                self.done = 0
                if epoch == self.epochs:
                    s.stop.reason = "epochs"
                    s.begin_stop()
                else:
                    s.epochs.begin(epoch)
            s._respond(w)
        return epoch


@pytest.mark.parametrize("policy", ["static", "load", "round-robin"])
@pytest.mark.parametrize("bound", [0, 1, 3])
@pytest.mark.parametrize("step_s", [
    {1: 1.0, 2: 1.0},
    {1: 1.0, 2: 1.3},
    {1: 1.0, 2: 1.0, 3: 1.0},
    {1: 1.0, 2: 0.7, 3: 1.9},
], ids=["2-even", "2-uneven", "3-even", "3-uneven"])
def test_ssp_never_leaves_every_worker_waiting_at_an_epoch_edge(policy, bound, step_s):
    """The ssp hold at an epoch's end: the worker that finished its share first is held
    (it leads by a step), the other's last push ends the epoch and releases it. Its reply
    must carry its shards of the new epoch; it went idle with them queued, and with a
    fixed plan (or no steal that pays) every worker then waited for the next rebalance."""
    sim = Sim("ssp", bound, policy, [96] * 8, step_s)
    assert sim.run() == 3


def test_ssp_never_stalls_over_random_rates_bounds_and_shards():
    """The same over random clusters (the old code stalled in ~30% of these, every bound)."""
    rng = random.Random(1)
    for _ in range(150):
        n = rng.choice([2, 3, 4])
        step_s = {r: rng.choice([1.0, 1.1, 1.3, 1.7, 2.0, 3.0]) for r in range(1, n + 1)}
        sizes = [rng.choice([64, 96, 100, 128]) for _ in range(rng.choice([6, 8, 12]))]
        bound = rng.choice([0, 1, 2, 3])
        policy = rng.choice(["static", "round-robin", "load", "demand", "predictive"])
        assert Sim("ssp", bound, policy, sizes, step_s).run() == 3, (n, step_s, sizes, bound, policy)


def test_released_held_worker_gets_the_new_epochs_shards():
    """The case of the report (2 workers, static, bound 0), step by step."""
    sim = Sim("ssp", 0, "static", [64] * 4, {1: 1.0, 2: 1.0})
    s = sim.server
    # each worker holds 2 shards of 64 = 4 pushes; rank 1 pushes first each time and is
    # held until rank 2 catches up: its 4th (last) push is held with nothing left to do
    for _ in range(7):
        rank = min(sim.computing, key=lambda r: (sim.computing[r], r))
        sim.t = sim.computing.pop(rank)
        w = s.peers[rank]
        task = s.ledger.current(rank)
        hi = min(task.pos + w.batch, task.end)
        sim.done += hi - task.pos
        w.step += 1
        s._advance(w, hi)
        s._respond(w)
    p1, p2 = s.peers[1], s.peers[2]
    assert p1.held and not s.ledger.of[1].owed and p1.step == 4 and p2.step == 3
    # rank 2's last push ends epoch 0; epoch 1 begins while neither worker is idle
    sim.t = sim.computing.pop(2)
    p2.step += 1
    s._advance(p2, s.ledger.current(2).end)
    s.epochs.begin(1)
    s._respond(p2)
    assert not p1.held and not p1.idle, "released with nothing to do: idle all epoch"
    assert [t.epoch for t in s.ledger.tasks(1)] == [1, 1]
    assert set(sim.computing) == {1, 2}


def test_async_runs_through_the_same_driver():
    """The driver itself: async never holds, so never stalls."""
    assert Sim("async", 0, "static", [96] * 8, {1: 1.0, 2: 1.3}).run() == 3


# ---------------------------------------------------------------- end to end (mpiexec)
@pytest.mark.mpi
@pytest.mark.parametrize("balancer", ["load", "static"])
def test_ssp_bound_0_epochs_do_not_wait_for_the_rebalance(digits_dir, tmp_path, balancer):
    """Digits' epochs take ~0.05 s here; the stall made one of them last the whole
    --rebalance-interval (set to 20 s: far beyond a slow CI machine's epoch)."""
    log = tmp_path / "run.h5"
    res = mpirun.run(3, "train", "--data", digits_dir, "--epochs", "4", "--no-progress",
                     "--log", log, "--mode", "ssp", "--staleness-bound", "0",
                     "--balancer", balancer, "--rebalance-interval", "20", timeout=90)
    assert res.returncode == 0, res.stderr
    s = summarize_log(str(log))
    assert s["status"] == "finished" and s["epochs_completed"] == 4
    assert s["coverage"]["applied"] == s["coverage"]["expected"]
    _, cols = read_columns(str(log))
    seconds = cols["epochs"]["t_end"] - cols["epochs"]["t_start"]
    assert seconds.max() < 5.0, seconds


def test_a_worker_woken_mid_epoch_starts_at_the_busy_ones_lowest_step():
    """Its own count, left behind while it idled, would have ssp hold the others until it
    caught up (as an epoch's start already knew)."""
    sim = Sim("ssp", 1, "load", [64] * 12, {1: 1.0, 2: 1.0})
    s = sim.server
    busy, idle = s.peers[1], s.peers[2]
    s.ledger.take_back(2)   # (its shards back in the balancer's queue for it)
    idle.go_idle()
    idle.step, busy.step = 1, 9
    s.epochs.wake_idle()
    assert not idle.idle and idle.step == 9
