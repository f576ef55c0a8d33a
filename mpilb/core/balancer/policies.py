"""The load-balancing policies: static, round-robin, demand, load, predictive."""

from __future__ import annotations

import numpy as np

from mpilb.core.balancer.base import Balancer, Move, register
from mpilb.core.balancer.estimates import _EPS, _NONLINEAR

# A silent worker is probed again once (1 - PROBE_SLACK) rebalance intervals have passed.
PROBE_SLACK = 0.1
# A silent worker whose time goes mostly to communication (behind a slow link) is probed
# once per this many intervals: its probe shard outlasts the others' queues and holds an
# epoch's end up, while a slow reader's (issue 17) mostly does not.
COMM_PROBE_SPACING = 4


@register("static")
class StaticBalancer(Balancer):
    """Even contiguous split of the epoch's order, fixed at its start; never moves."""

    def _build_queues(self, order):
        if self.holders is not None:
            return self._by_holder(order)
        n, k = len(order), len(self.workers)
        queues, start = {}, 0
        for i, w in enumerate(self.workers):
            count = n // k + (1 if i < n % k else 0)
            queues[w] = order[start:start + count]
            start += count
        return queues


@register("round-robin")
class RoundRobinBalancer(Balancer):
    """Shards dealt in turn: ``order[k]`` goes to ``workers[k % W]``; never moves."""

    def _build_queues(self, order):
        if self.holders is not None:
            return self._by_holder(order)
        k = len(self.workers)
        return {w: order[i::k] for i, w in enumerate(self.workers)}


@register("demand")
class DemandBalancer(Balancer):
    """One central queue; whoever asks first gets its head. No per-worker queues, no moves."""

    def __init__(self, workers, shard_sizes, config, holders=None):
        super().__init__(workers, shard_sizes, config, holders)
        self._central: list[int] = []

    def _build_queues(self, order):
        self._central = order
        return {w: [] for w in self.workers}

    def next_shard(self, worker, prefetch=False):
        if worker not in self.workers or not self._central:
            return None
        # With a node-local store, take the first shard this worker holds, if any is left.
        pick = next((i for i, s in enumerate(self._central) if worker in self._home(s)), 0)
        shard = self._central.pop(pick)
        self._commit(worker, shard)
        return shard

    def requeue(self, shards):
        # A lost worker's shards go first: they are the ones most likely to end the epoch late.
        self._requeued.update(shards)
        self._central[:0] = list(shards)

    def _place(self, shard):
        self._central.append(shard)
        return -1

    def central(self) -> list[int]:
        """The central queue (a copy)."""
        return list(self._central)

    def state_dict(self):
        state = super().state_dict()
        state["central"] = list(self._central)
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self._central = [int(s) for s in state["central"]]


@register("load")
class LoadBalancer(Balancer):
    """Queues sized so every worker is projected to finish together, at its measured rate.

    Plan: each shard of ``order`` in turn goes to the worker that would finish it earliest
    (greedy earliest-finish), so queue lengths follow the rates. Rebalance: repeatedly move
    the last unstarted shard of the worker projected to finish last to the worker that would
    finish it earliest, while that brings the last finisher forward; keep the moves only if
    together they bring the projected epoch end forward by more than ``hysteresis`` of the
    remaining time. Moving single shards one at a time and judging the whole set lets many
    small shards move even when each alone gains less than the hysteresis. A worker whose
    queue runs dry steals from the worker projected to finish last, if that ends sooner.

    End of the epoch: a worker that still holds work and asks for one more shard (its
    prefetch) does not get it when another worker, after everything it holds and has
    queued, would finish that shard sooner. The shard stays queued where that worker can
    steal it, and the asker gets it anyway if it runs dry first. Without this a slow worker
    commits to two shards near the end (its current one and its prefetch) and ends the
    epoch late while the fast ones idle; committed shards never move. For the same reason
    a worker holds one shard at a time until it has a rate: the first plan is blind, and a
    second shard committed on it to a worker that turns out slow (behind a slow link) ended
    the run's first epoch late (cluster case (f): 1.35 s, 0.86 s without that node). That
    rule holds back a `prefetch` only (asked while the worker still holds a task): one that
    ran dry gets its next shard whatever its rate (its committed count can lag its reports,
    and an ssp run whose workers had no rate yet stalled with shards queued).
    """

    def next_shard(self, worker, prefetch=False):
        if worker not in self.workers:
            return None
        queue = self._queues[worker]
        if queue and self._committed.get(worker, 0) > 0 and len(self.workers) > 1 and (
                (prefetch and not self.rate_known(worker))
                or self._sooner_elsewhere(worker, queue[0])):
            return None
        return super().next_shard(worker)

    def keep_of_tail(self, worker, before, tail, batch):
        """Keep the whole batches of the tail that ``worker`` ends no later than the
        others end theirs; give the rest to the worker with work that would end it soonest.

        Only once ``worker``'s queue is empty (the epoch's end: before it, moving queued
        shards is the rebalance's job). A step is counted whole even when short (a worker
        behind a slow link spends a step's time on transfers whatever its batch), the
        others by their projected finish, the taker by its own. Only the projected last
        finisher is cut, and only where that brings the epoch's projected end forward by
        more than one of the taker's steps and more than ``hysteresis`` of it.
        """
        if worker not in self.workers or len(self.workers) < 2 or self._queues.get(worker):
            return tail, None   # mid-epoch: moving queued shards is the rebalance's job
        vec = self._vectors()
        workers, pos, load, spp, _ = vec
        me = pos[worker]
        step = batch / self.effective_rate(worker)
        whole = -(-(before + tail) // batch) * step
        last, own_end = self._last_other(vec, me)
        # at most it saves the steps past what it holds ahead of the tail, down to the
        # others' end: most replies stop here (a reply is on the server's busiest path)
        gain_at_most = whole - max(own_end, -(-before // batch) * step)
        if last < 0 or gain_at_most <= self.config.hysteresis * whole:
            return tail, None
        busy = load > 0
        busy[me] = False
        after = self._times_at(vec, load + tail)
        after[~busy] = np.inf
        t = int(np.argmin(after))           # who would end the whole tail soonest
        taker = workers[t]
        if not all(self.rate_known(w) for w in (worker, taker, workers[last])):
            return tail, None   # guesses, not rates

        def end(keep):   # the epoch's projected end if worker keeps `keep`, the taker the rest
            mine = -(-(before + keep) // batch) * step
            return max(mine, own_end, self._time_for(taker, float(load[t]) + tail - keep))

        whole = end(tail)
        keep, best = tail, whole
        for k in range(0, tail, batch):
            e = end(k)
            if e < best - _EPS:
                keep, best = k, e
        # Worth a cut (and the taker's read of the shard) only if it saves more than one of
        # the taker's steps and more than the hysteresis: not for estimate noise.
        taker_step = batch / self.effective_rate(taker)
        if keep >= tail or whole - best < max(taker_step, self.config.hysteresis * whole) + _EPS:
            return tail, None
        return keep, taker

    def _last_other(self, vec: tuple, me: int) -> tuple[int, float]:
        """(position, projected finish) of the last to finish among the workers of ``vec``
        with work, but the one at ``me``; (-1, 0.0) if none has work."""
        workers, _, load, spp, _ = vec
        if len(workers) > 64:    # one vector pass; below that, floats are cheaper
            busy = load > 0
            busy[me] = False
            if not busy.any():
                return -1, 0.0
            finish = np.where(busy, self._times_at(vec, load), -np.inf)
            last = int(np.argmax(finish))
            return last, float(finish[last])
        last, end = -1, 0.0
        for j, (n, c) in enumerate(zip(load.tolist(), spp.tolist())):
            if j != me and n > 0:
                f = n * c if c >= 0.0 else self._time_nonlinear(workers[j], n)
                if last < 0 or f > end:
                    last, end = j, f
        return last, end

    def _sooner_elsewhere(self, worker: int, shard: int) -> bool:
        size = self.shard_sizes[shard]
        mine = self._time_for(worker, self._committed.get(worker, 0) + size)
        vec = self._vectors()
        others = self._times_at(vec, vec[2] + size)
        others[vec[1][worker]] = np.inf
        return bool((others < mine - _EPS).any())

    def _build_queues(self, order):
        queues = {w: [] for w in self.workers}
        if self.holders is None:   # every worker is a home: one vector op per shard
            vec = self._vectors()
            workers = vec[0]
            loads = np.zeros(len(workers))
            for shard in order:
                size = self.shard_sizes[shard]
                i = int(np.argmin(self._times_at(vec, loads + size)))
                queues[workers[i]].append(shard)
                loads[i] += size
            return queues
        load = {w: 0 for w in self.workers}
        for shard in order:
            size = self.shard_sizes[shard]
            w = min(self._home(shard), key=lambda v: self._time_for(v, load[v] + size))
            queues[w].append(shard)
            load[w] += size
        if self.holders is not None and len(self.workers) > 1:
            # Holders first; then send shards elsewhere only where that ends the epoch
            # sooner by more than the hysteresis (rebalance's rule).
            self._queues = queues
            self._qsum.clear()
            self._vec = None
            self.rebalance(self.now, {})
            queues = self._queues
        return queues

    def plan_epoch(self, epoch, order):
        super().plan_epoch(epoch, order)
        # A probe a rebalance owed (every queue was empty then) is made now, if the plan
        # left that worker without a shard.
        owed, self._probe_owed = self._probe_owed, {}
        self._moves.extend(self._probe_silent(self.now, owed))
        return {w: list(q) for w, q in self._queues.items()}

    def rebalance(self, t, committed):
        super().rebalance(t, committed)
        if len(self.workers) < 2:
            return []
        moves = self._moves_by_rate()
        self._moves.extend(moves)
        probes = self._probe_silent(t)
        self._moves.extend(probes)
        return moves + probes

    def _probe_silent(self, t: float, owed: dict | None = None) -> list[Move]:
        """A worker left without work while others still have shards queued (projected too
        slow for even one, e.g. a slow reader) sends no reports, so its rate would never
        recover when it speeds up. At a rebalance it gets one queued shard (a probe: the
        smallest at the tail of the last finisher's queue), at most one per interval; its
        old estimate is then replaced by what the probe measures (see ``observe``). A
        worker idle for any other reason would have stolen that shard already.

        A worker that spends more of a sample's time communicating than computing and
        reading (behind a slow link) is probed once per COMM_PROBE_SPACING intervals,
        counted before its first probe from its last report: its probe shard, a few
        transfers over that link, outlasts what is left of the epoch and holds the epoch's
        end up (the cluster in a box's case (f): a 0.5 s epoch took 0.7 s), where a slow
        reader's probe is mostly one read.

        A rebalance that finds every queue empty (the epoch's end) owes the probe to the
        next epoch's start (``owed``: worker -> the rebalance's time, which then counts as
        the probe's). The interval is counted with PROBE_SLACK: rebalances come one
        interval apart by the server's clock, and a probe must not skip every other one
        because two readings of the clock differ by a millisecond.
        """
        wait = (1.0 - PROBE_SLACK) * self.config.rebalance_interval
        moves = []
        for w in self.workers if owed is None else [w for w in self.workers if w in owed]:
            if self._queues[w] or self._committed.get(w, 0) > 0:
                continue
            when = t if owed is None else owed[w]
            last = self._probed.get(w)
            spacing = 1
            if self.overhead(w) * self._planning_rate(w) > 1.0:   # behind a slow link
                spacing = COMM_PROBE_SPACING
                if last is None:   # its estimate is as old as its last report
                    last = self._rates[w].last_t
            if (last is not None and when - last < wait * spacing) or not self.rate_known(w):
                continue
            donors = [v for v in self.workers if v != w and self._queues[v]]
            if not donors:
                if owed is None:
                    self._probe_owed[w] = t
                continue
            src = max(donors, key=self._finish)
            shard = min(self._queues[src][-3:], key=lambda s: self.shard_sizes[s])
            self._queues[src].remove(shard)
            self._queues[w].append(shard)
            self._touch(src)
            self._touch(w)
            self._probed[w] = when
            self._rates[w].ewma.mark_stale()
            moves.append(Move(shard, src, w, "probe"))
        return moves

    def _moves_by_rate(self) -> list[Move]:
        """The rebalance proper (see the class docstring); moves not yet recorded."""
        # Vectors over self.workers: argmax/argmin take the first of equals, as max/min do.
        vec = self._vectors()
        workers = vec[0]
        load = vec[2].copy()
        finish = self._times_at(vec, load)
        before = float(finish.max())
        moves: list[Move] = []
        for _ in range(sum(len(q) for q in self._queues.values())):
            s = int(np.argmax(finish))
            src = workers[s]
            if not self._queues[src]:
                break                       # the last finisher has only committed work left
            shard = self._queues[src][-1]
            size = self.shard_sizes[shard]
            after_dst = self._times_at(vec, load + size)
            after_dst[s] = np.inf
            d = int(np.argmin(after_dst))
            dst, dst_after = workers[d], float(after_dst[d])
            if dst_after >= finish[s] - _EPS:
                break                       # it would only move the late finish elsewhere
            self._queues[src].pop()
            self._queues[dst].append(shard)
            load[s] -= size
            load[d] += size
            finish[s] = self._time_for(src, float(load[s]))
            finish[d] = dst_after
            moves.append(Move(shard, src, dst, "rebalance"))
        after = float(finish.max())
        if moves and before - after <= self.config.hysteresis * before + _EPS:
            for move in reversed(moves):    # not worth it: undo, newest first
                self._queues[move.dst].pop()
                self._queues[move.src].append(move.shard)
            moves = []
        for move in moves:
            self._touch(move.src)
            self._touch(move.dst)
        return moves

    def _steal(self, worker):
        vec = self._vectors()
        workers, pos, load, _, queued = vec
        finish = self._times_at(vec, load)
        finish[~queued] = -np.inf
        finish[pos[worker]] = -np.inf
        if not np.isfinite(finish).any():
            return None
        victim = workers[int(np.argmax(finish))]
        shard = self._queues[victim][-1]
        if shard in self._given_back.get(worker, ()):
            return None                     # it gave that tail away this epoch
        size = self.shard_sizes[shard]
        before = self._finish(victim)
        thief_after = self._time_for(worker, self._committed.get(worker, 0) + size)
        victim_after = self._time_for(victim, self._load(victim) - size)
        if max(thief_after, victim_after) >= before - _EPS:
            return None
        self._queues[victim].pop()
        self._touch(victim)
        self._moves.append(Move(shard, victim, worker, "steal"))
        return shard


@register("predictive")
class PredictiveBalancer(LoadBalancer):
    """Like ``load``, but plans on forecast rates (see :class:`mpilb.core.rates.TrendRate`).

    ``predicted_rate`` is the forecast mean rate over the next ``rebalance_interval`` (it
    drives proportional batches and the logs). Projected finish times follow the trend over
    the whole remaining work, so a worker that is slowing down is unloaded before it falls
    behind (and one that is speeding up is not trusted with more until it has).
    """

    def predicted_rate(self, worker):
        est = self._rates.get(worker)
        forecast = est.forecast(self.now, self.config.rebalance_interval) if est else None
        return forecast if forecast is not None else self.rate(worker)

    def _linear_cost(self, worker):
        # A worker that is slowing down keeps slowing while it works through its queue:
        # integrate the trend over the whole job rather than assume the next interval's rate.
        est = self._rates.get(worker)
        if est is None or est.value is None:
            return super()._linear_cost(worker)
        if est.slope() < 0.0:
            return _NONLINEAR
        return 1.0 / est.value + self.overhead(worker)   # a flat or rising trend: its EWMA

    def _time_nonlinear(self, worker, samples):
        if samples <= 0:
            return 0.0
        return self._rates[worker].time_for(samples, self.now) + samples * self.overhead(worker)
