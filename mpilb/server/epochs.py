"""Epochs on rank 0: plan, hand out, end, evaluate (a part of the parameter server).

Epochs are strict (docs/cli.md): an epoch ends when every one of its samples has been applied
exactly once. At its start the balancer plans the shard queues and idle workers get tasks;
at its end the `epochs/` row is logged, the model is evaluated and the stop rules decide.
Mixed into :class:`~mpilb.server.loop.ParameterServer`.
"""

from __future__ import annotations

import time
from typing import Optional

from mpilb.runfiles import checkpoint
from mpilb.core.epochs import epoch_order
from mpilb.server.peers import Peer


class Epochs:
    """Epoch bookkeeping and handing out tasks (a mixin: it reads the server's state)."""

    def _log_shards(self) -> None:
        events = self.ledger.take_events()
        if events:
            t = self.now()
            for e in events:
                self.log.append("shards", t=t, epoch=e.epoch, shard=e.shard, src=e.src, dst=e.dst,
                                event=e.event, bytes=e.bytes)

    def _top_up(self, w: Peer) -> None:
        """Hand w shards until it holds enough; with none left, split another's task."""
        if self.stop.reason or w.lost or w.benched:
            return
        self.ledger.top_up(w.rank, w.batch)
        self._send_orders_to_waiting()
        self._log_shards()

    def _begin_epoch(self, epoch: int, resume_counts=None) -> None:
        self.ledger.epoch = epoch
        order = epoch_order(self.cfg.seed, epoch, len(self.dataset.shard_sizes))
        # An empty shard (allowed by the format) holds no work: handed out, it would be a
        # task no push ever advances, and its worker would look silent.
        order = [s for s in order if self.dataset.shard_sizes[s] > 0]
        if resume_counts is None:
            self.tracker.begin(epoch, self.now())
        else:   # an interrupted epoch: only what was not applied yet
            self.tracker.begin(epoch, self.now(), resume_counts)
            order, pending = checkpoint.resume_plan(order, resume_counts, self.tracker.offsets,
                                                    self.dataset.shard_sizes)
            self.ledger.begin_epoch(epoch, pending)
        self.balancer.plan_epoch(epoch, order)
        self._update_batches()
        if self.tracker.complete:   # resumed from a checkpoint taken as the epoch ended
            self._end_epoch()
            return
        self.ledger.collect_moves()
        self._log_shards()
        for w in self.present():
            w.epoch_busy = 0.0
            w.epoch_finish = None
        self._wake_idle()

    def _wake_idle(self) -> None:
        """Send work to idle workers that the balancer has given shards to (e.g. by a move).
        A woken worker's step count starts at the busy ones' lowest, as at an epoch's start:
        its old count, left behind while it idled, would have ssp hold every other worker
        until it caught up."""
        if self.stop.reason:
            return
        floor = min((w.step for w in self.present() if not w.idle), default=None)
        for w in self.present():
            if w.idle:
                self._top_up(w)
                if self.ledger.of[w.rank].assigns:
                    if floor is not None:
                        w.step = max(w.step, floor)
                    w.wake()
                    self._reply(w)

    def _end_epoch(self) -> None:
        t = self.now()
        stats = self.tracker.end(t)
        span = max(1e-9, stats.t_end - stats.t_start)
        active = [w for w in self.peers.values() if not w.lost]
        busy = sum(w.epoch_busy for w in active)
        # seconds on the bench are not seats a worker could have filled (sit-out)
        sitout = self.rule.sitout
        benched = 0.0 if sitout is None else sum(
            sitout.benched_s(w.rank, self.t0 + stats.t_start, self.t0 + stats.t_end) for w in active)
        seats = len(active) * span - benched
        util = min(1.0, busy / seats) if seats > 0 else 0.0
        finishes = [w.epoch_finish for w in active if w.epoch_finish is not None]
        imbalance = (max(finishes) - min(finishes)) if finishes else 0.0
        self.log.append("epochs", epoch=stats.epoch, t_start=stats.t_start, t_end=stats.t_end,
                        samples=stats.samples, utilization=util, imbalance_s=imbalance)
        if not self.stop.waits_on_evaluations and not self.stop.check(stats.epoch + 1, t):
            # The run goes on whatever this evaluation says: hand out the next epoch first,
            # and evaluate while serving the workers (on the straggler benchmark every
            # worker used to wait 0.12 s for it at each epoch's end).
            self._begin_epoch(stats.epoch + 1)
            if self.model.num_state:   # statistics the pushes update: evaluate them now
                self._evaluate(epoch=stats.epoch)
                self.progress.epoch_done(stats.epoch, self.accuracy)
            else:
                self.session.evaluate_later(
                    self.params, self.now(), self.version, stats.epoch,
                    then=lambda: self.progress.epoch_done(stats.epoch, self.accuracy))
            return
        self._evaluate()
        self.progress.epoch_done(stats.epoch, self.accuracy)
        if self.stop.check(stats.epoch + 1, t, self.session.evaluation):
            self._begin_stop()
        else:
            self._begin_epoch(stats.epoch + 1)

    def _evaluate(self, epoch: Optional[int] = None) -> None:
        self.session.evaluate(self.params, self.now(), self.version,
                              self.epoch if epoch is None else epoch)
        self.last_eval = time.monotonic()
