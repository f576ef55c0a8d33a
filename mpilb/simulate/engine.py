"""The discrete-event engine: simulated workers against the server's balancer and ledger.

Events, in time order (a heap): a worker's push (its step done: compute at its rate, after
any wait for its shard's rows), a rebalance every ``rebalance_interval``, a lost worker
declared after ``worker_timeout``. The server's side of a push is done at once: the
balancer observes it, the ledger advances and tops the worker up, the stores queue the
update (async: reply when applied; sync: held until the round's last member has pushed,
then one apply and replies to all), and the worker's next step starts when the reply
arrives. Epochs are strict, as in the server: an epoch ends when the tracker has every one
of its samples applied, and the next one is planned at once; an idle worker waits for
work (a rebalance, a part-way move, the next epoch).

What the engine does as the server does (mpilb/server/), with the server's own code:
top-up to two tasks and part-way moves (the task ledger, :mod:`mpilb.core.tasks`), the first
proportional sizing after 16 steps each, rebalances, waking idle workers and batch sizes
revised at each rebalance and epoch start (:mod:`mpilb.core.decisions`), sync rounds
over the workers that are not idle, sit-out (the server's :class:`~mpilb.core.sitout.SitOut`
on the simulated workers: lags per round, benching, probes), lost workers
(``hang``/``crash`` injections; their tasks go back), and a replayed run's joins, leaves
and losses at their times (:mod:`.members`).
"""

from __future__ import annotations

import heapq
from typing import Optional

import numpy as np

from mpilb.core.balancer import BalancerConfig, build_balancer
from mpilb.core.decisions import CHORES_S, Decisions, FirstSizes, RebalanceTimer
from mpilb.core.epochs import EpochTracker, epoch_order
from mpilb.core.sitout import SitOut
from mpilb.errors import UsageError
from mpilb.simulate.cluster import Profile, Slices
from mpilb.simulate.cores import crowded
from mpilb.simulate.ledger import Ledger
from mpilb.simulate.members import MemberChanges
from mpilb.simulate.workers import PUSH, REBALANCE, SimConfig, SimPush, SimWorker, read_key

__all__ = ["Engine", "SimConfig", "SimWorker"]


class Engine:
    """Simulate one configuration on a cluster of profiles (the :class:`Driver
    <mpilb.core.decisions.Driver>` of the server's decisions).

    Args:
        cfg: the :class:`SimConfig`.
        profiles: one :class:`Profile` per worker (ranks 1..W).
        shard_sizes: samples per shard.
        replay: I/O comes from the profiles' per-sample traces (a replayed run) rather
            than from modelled shard reads.
        ranks: the workers' ranks (default 1..W).
    The epochs' shard order and coverage counter are the server's
    (:mod:`mpilb.core.epochs`).
    """

    PIPELINES = False   # --pipeline 1 is simulated by the network engine only

    def __init__(self, cfg: SimConfig, profiles: list[Profile], shard_sizes: list[int],
                 replay: bool = False, *, ranks=None):
        if cfg.pipeline and not self.PIPELINES:
            raise UsageError("--pipeline 1 is simulated on a network only (--nodes, or --from "
                             "with --link-rate); give --pipeline 0 without one")
        self.cfg = cfg
        self.replay = replay
        self.shard_sizes = [int(s) for s in shard_sizes]
        ranks = list(ranks) if ranks is not None else list(range(1, len(profiles) + 1))
        self.changes = MemberChanges(cfg.members)
        bcfg = BalancerConfig.of_run(cfg, cfg.mode)
        first = self.changes.at_start(ranks)
        self.balancer = build_balancer(cfg.balancer, first, self.shard_sizes, bcfg)
        self.order = epoch_order
        self.ledger = Ledger(self.balancer, EpochTracker(self.shard_sizes), self.shard_sizes, first,
                             part_way=cfg.balancer not in ("static", "round-robin"),
                             pipeline=bool(cfg.pipeline))
        self.sitout = (SitOut(self.balancer, self.ledger.tasks_ledger, cfg.batch, cfg.min_batch,
                              cfg.max_batch, cfg.rebalance_interval) if bcfg.sit_out else None)
        self.decisions = Decisions(self.balancer, self.ledger.tasks_ledger, self.sitout, cfg.batch,
                                   self)
        self.first_sizes = FirstSizes(cfg.batch_policy == "proportional")
        # the server's clock of rebalances: --rebalance-interval after the last one, and
        # its warm-up ones (as soon as every busy worker has a first rate, then after
        # 0.25, 0.5, 1 ... s); the first sizes are judged at the steps (first_sizes)
        self.timer = RebalanceTimer(cfg.rebalance_interval, False)
        self.slices = Slices(cfg.params, cfg.servers, cfg.server_gbps, cfg.apply_s)
        self.workers = {r: SimWorker(r, p, cfg.inject, cfg.batch, cfg.seed, cfg.jitter)
                        for r, p in zip(ranks, profiles)}
        self.sync, self.cores = cfg.mode == "sync", crowded(cfg.cores)
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.epoch = -1
        self.t_epoch = 0.0
        self.done = False
        self.running = 0          # workers computing (sync: the round is complete at 0)
        self.members: list[SimWorker] = []
        self.round_batches: list[tuple] = []
        self.updates = 0
        self.epochs: list[dict] = []
        self.warmup = WarmupCheck(self.timer, self.balancer.rate_known)
        self.changes.schedule(self)

    # ------------------------------------------------------------------ helpers
    def _at(self, t: float, kind: int, rank: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, rank))

    def _link(self, w: SimWorker, t: float) -> float:
        p = w.profile
        return p.link[p.piece(t)] / 2.0

    def _count_moves(self) -> None:
        self.ledger.count_moves()

    def _present(self) -> list[SimWorker]:
        return [w for w in self.workers.values() if w.present]

    # ------------------------------------------------------------------ the server's decisions
    # (the Driver of mpilb.core.decisions: what the server does, done to simulated workers)
    def present(self) -> list[SimWorker]:
        return self._present()

    def top_up(self, w: SimWorker) -> None:
        if not w.benched:
            self.ledger.top_up(w.rank, w.batch)

    def has_work(self, w: SimWorker) -> bool:
        return not w.benched and bool(self.ledger.tasks(w.rank))

    def wake(self, w: SimWorker, t: float, floor: Optional[int]) -> None:
        self._start(w, t + self._link(w, t))   # (no ssp here: the step floor is not needed)

    def benched(self, w: SimWorker) -> None:
        pass   # its tasks' events are counted with the next moves

    def shards_moved(self) -> None:
        self._count_moves()

    def _rebalance(self, t: float) -> None:
        self.decisions.rebalance(t, t)
        self.timer.done(t)

    # ------------------------------------------------------------------ lost workers
    def _die(self, w: SimWorker, t: float) -> None:
        self.changes.die(self, w, t)

    def _drop(self, w: SimWorker, t: float) -> None:
        """w is out of the run (lost, or it left): its work goes to the others."""
        self.balancer.remove_worker(w.rank)
        w.ready.clear()
        self.ledger.take_back(w.rank, lost=True)
        self._count_moves()
        self.decisions.wake_idle(t)
        if self.sync and self.members and self.running == 0:
            self._apply_round(t)

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        """Simulate every epoch; returns the figures (see :func:`summarize`)."""
        self._begin_epoch(0, 0.0)
        self._at(max(self.cfg.rebalance_interval, CHORES_S), REBALANCE)
        heap = self.heap
        while heap and not self.done:
            self._event(*heapq.heappop(heap))
        return summarize(self)

    def _event(self, t: float, _seq: int, kind: int, rank: int) -> None:
        self.now = t
        if kind == PUSH:
            self._on_push(self.workers[rank], t)
        elif kind == REBALANCE:
            interval = max(self.cfg.rebalance_interval, CHORES_S)   # once a chore at most
            if t - self.timer.last >= interval * (1 - 1e-9):
                self._rebalance(t)
            self._at(self.timer.last + interval, REBALANCE)   # (after a warm-up one: later)
            if self._nobody_busy() and not self.changes.pending and not self.done:
                # as the server's stall check: nobody computes and nothing can change
                raise RuntimeError(f"simulation stalled in epoch {self.epoch + 1}: every worker "
                                   f"is idle but the epoch is not complete")
        else:
            self.changes.event(self, kind, rank, t)

    def _nobody_busy(self) -> bool:
        """No worker computes or waits for a reply (the stall check)."""
        return not self.running

    def _begin_epoch(self, epoch: int, t: float) -> None:
        self.epoch, self.t_epoch = epoch, t
        order = self.order(self.cfg.seed, epoch, len(self.shard_sizes))
        self.ledger.begin_epoch(epoch, order, t)
        self.decisions.update_batches(t)
        self._count_moves()
        for w in self.workers.values():
            w.epoch_busy, w.epoch_finish = 0.0, None
            w.ready.clear()
        self.decisions.wake_idle(t)

    def _end_epoch(self, t: float) -> None:
        self.ledger.end_epoch(t)
        span = max(1e-12, t - self.t_epoch)
        alive = [w for w in self.workers.values() if not w.lost and not w.left]
        finishes = [w.epoch_finish for w in alive if w.epoch_finish is not None]
        self.epochs.append({
            "epoch_s": span,
            "utilization": min(1.0, sum(w.epoch_busy for w in alive) / (len(alive) * span)),
            "imbalance_s": (max(finishes) - min(finishes)) if finishes else 0.0,
        })
        if len(self.epochs) >= self.cfg.epochs:
            self.done = True
            self.now = t
            return
        self._begin_epoch(self.epoch + 1, t)

    # ------------------------------------------------------------------ steps
    def _start(self, w: SimWorker, t: float) -> None:
        """w got a reply at ``t``: start its next step, or go idle with nothing to do (or
        leave, told to)."""
        if self.changes.departs(self, w, t):
            return
        self.ledger.reply(w.rank, w.batch)
        tasks = self.ledger.tasks(w.rank)
        if not tasks or w.batch <= 0:
            w.go_idle()
            return
        if t >= w.fault_t:
            self._die(w, t)
            return
        task = tasks[0]
        n = min(w.batch, task.remaining)
        p = w.profile
        i = p.piece(t)
        io = n * p.io[i] if self.replay else self._read_wait(w, task, t)
        comp = w.jittered(n * p.compute[i])
        comp *= self.cores.factor(self, w) if self.cores is not None else 1.0
        if w.rules:
            comp, io = w.injected(t, comp, io, self.replay)
        push_t = t + io + comp + self._push_delay(w, t)
        if push_t >= w.fault_t:
            self._die(w, t)
            return
        w.n, w.comp, w.io, w.reply_t = n, comp, io, t
        w.compute()
        self.running += 1
        self._at(push_t, PUSH, w.rank)

    def _read_wait(self, w: SimWorker, task, t: float) -> float:
        return w.read_wait(self.ledger.tasks(w.rank), task, t, self.shard_sizes, self.cfg.row_bytes)

    def _push_delay(self, w: SimWorker, t: float) -> float:
        """Seconds from a step's end to its push reaching the server."""
        return self._link(w, t)

    def _on_push(self, w: SimWorker, t: float) -> None:
        task, lo, hi = self._received(w, t)
        if self.sync:
            self._hold(w, task, lo, hi, t)
            return
        self.updates += 1
        self.ledger.record(task.epoch, task.shard, lo, hi)
        done = self.slices.update(t)
        if self._applied(w, done):
            return
        reply = done + self._link(w, done)
        w.comm = reply - t + self._link(w, t)
        w.epoch_busy += w.comp + w.io + w.comm
        self._start(w, reply)

    def _applied(self, w: SimWorker, done: float) -> bool:
        """An async update of w's was applied at ``done``: the epoch may end; w is topped
        up. True when the run is over."""
        if self.ledger.complete:
            self._end_epoch(done)
            if self.done:
                return True
        self.ledger.top_up(w.rank, w.batch)
        self._count_moves()
        return False

    def _received(self, w: SimWorker, t: float):
        """The server's side of w's push arriving at ``t``: observe it, advance the
        ledger; returns (task, lo, hi) of the samples it carries."""
        self.running -= 1
        busy = w.comp + w.io
        w.step += 1
        w.samples += w.n
        if w.first_t is None:
            w.first_t = t
        w.last_t = t
        w.busy += busy
        w.last_gap = t - w.reply_t
        # (pipelined, reply -> push is no step's cost: the server passes none, as here)
        step_s = None if self.cfg.pipeline else w.last_gap
        self.balancer.observe(w.rank, t, w.n, busy, comm_s=w.comm, step_s=step_s)
        tasks = self.ledger.tasks(w.rank)
        task = tasks[0]
        lo, hi = task.pos, task.pos + w.n
        w.last_push = SimPush(lo, hi, w.comp)
        finished = self.ledger.advance(w.rank, hi)
        if finished is not None:
            w.epoch_finish = t
            w.ready.pop(read_key(finished), None)
        if self.first_sizes.due_after_step(w.step, self._present):
            self._rebalance(t)
        elif self.warmup.due(t, self._present):
            self._rebalance(t)
        return task, lo, hi

    def _hold(self, w: SimWorker, task, lo: int, hi: int, t: float) -> None:
        """Sync: w's gradient is summed into the round; the round is applied when no
        member is still computing."""
        self.slices.push(t)
        w.hold()
        self.members.append(w)
        self.round_batches.append((task.epoch, task.shard, lo, hi))
        w.epoch_busy += w.comp + w.io
        if self.running == 0:
            self._apply_round(t)

    def _apply_round(self, t: float) -> None:
        members, self.members = self.members, []
        batches, self.round_batches = self.round_batches, []
        done = self.slices.round(t, len(members))
        self.updates += len(members)
        for batch in batches:
            self.ledger.record(*batch)
        if self.sitout is not None:
            self.sitout.note_lags(members)
            self.sitout.after_round(members, self._present(), t)
        if self.ledger.complete:
            self._end_epoch(done)
            if self.done:
                return
        for w in members:
            if not w.held:
                continue
            self.ledger.top_up(w.rank, w.batch)
            reply = done + self._link(w, done)
            w.comm = 2 * self._link(w, t)
            w.epoch_busy += w.comm
            self._start(w, reply)
        self._count_moves()


class WarmupCheck:
    """``timer.warmup_due`` at every push without a pass over every worker each time: until
    the first rates are all known, a busy worker found without one (``unknown``) answers no
    for as long as it stays so; once they are known, the timer reads no workers at all."""

    def __init__(self, timer: RebalanceTimer, rate_known):
        self.timer, self.known = timer, rate_known
        self.unknown: Optional[SimWorker] = None

    def due(self, t: float, present) -> bool:
        """As ``timer.warmup_due(t, present(), rate_known)``."""
        timer, known = self.timer, self.known
        if timer.warmup_gap is not None:
            return timer.warmup_due(t, (), known)
        w = self.unknown
        if w is not None and w.present and not w.idle and not known(w.rank):
            return False
        workers = present()
        if timer.warmup_due(t, workers, known):
            return True
        self.unknown = next((o for o in workers if not o.idle and not known(o.rank)), None)
        return False


def summarize(engine: Engine) -> dict:
    """The figures of a finished simulation (docs/simulate.md)."""
    total = max(engine.now, 1e-12)
    cov = engine.ledger.coverage()
    ep = engine.epochs
    return {
        "balancer": engine.cfg.balancer, "batch_policy": engine.cfg.batch_policy,
        "mode": engine.cfg.mode, "workers": len(engine.workers), "servers": engine.cfg.servers,
        "epoch_s": float(np.mean([e["epoch_s"] for e in ep])) if ep else None,
        "utilization": float(np.mean([e["utilization"] for e in ep])) if ep else None,
        "imbalance_s": float(np.mean([e["imbalance_s"] for e in ep])) if ep else None,
        "moves": engine.ledger.moved,
        "updates_per_s": engine.updates / total,
        "server_busy": min(1.0, engine.slices.busy / total),
        "total_s": total,
        "epochs": [dict(e) for e in ep],
        "lost_workers": list(engine.changes.lost),
        "left_workers": list(engine.changes.left),
        "coverage": cov,
        "per_worker": [{"worker": w.rank, "samples": w.samples, "first_push_s": w.first_t,
                        "last_push_s": w.last_t} for w in engine.workers.values()],
    }
