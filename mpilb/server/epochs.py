"""Epochs on rank 0: plan, hand out, end, evaluate (a part of the parameter server).

Epochs are strict (docs/cli.md): an epoch ends when every one of its samples has been applied
exactly once. At its start the balancer plans the shard queues and idle workers get tasks;
at its end the `epochs/` row is logged, the model is evaluated and the stop rules decide.
:class:`Epochs` is also the server's :class:`~mpilb.core.decisions.Driver`: the pure
decisions (rebalance, waking idle workers, batch sizes) reach the workers through it.
"""

from __future__ import annotations

import time
from typing import Optional, Protocol

from mpilb.core.decisions import Decisions, Interval
from mpilb.core.epochs import epoch_order
from mpilb.runfiles import checkpoint
from mpilb.server.peers import Peer, Roster


class Replies(Protocol):
    """What the epochs ask of the server's protocol (:class:`~mpilb.server.loop.ParameterServer`)."""

    def reply(self, w: Peer) -> None:
        """Send ``w`` its work and the parameters."""

    def send_orders_to_waiting(self) -> None:
        """Tell the waiting workers given send orders."""

    def begin_stop(self) -> None:
        """A stop rule fired: stop every worker."""


class Epochs:
    """Epoch bookkeeping and handing out tasks.

    Args:
        cfg: the run's configuration (--seed, --batch).
        dataset: its shard sizes.
        session: the run's model, balancer, tracker, stop rule, log, progress, evaluations.
        ledger: the :class:`~mpilb.core.tasks.TaskLedger`.
        roster: the workers (:class:`~mpilb.server.peers.Roster`).
        clock: the run's clock (``now()``, ``t0``).
        slices: rank 0's parameter slices (:class:`~mpilb.server.group.SliceGroup`) (the whole vector, for evaluations).
        sitout: the sit-out policy, or None.
        replies: the server's protocol (:class:`Replies`).
        eval_timer: the --eval-interval timer, restarted by every evaluation.
    """

    def __init__(self, cfg, dataset, session, ledger, roster: Roster, clock, slices, sitout,
                 replies: Replies, eval_timer: Interval):
        self.cfg = cfg
        self.dataset = dataset
        self.session = session
        self.ledger = ledger
        self.roster = roster
        self.clock = clock
        self.slices = slices
        self.sitout = sitout
        self.replies = replies
        self.eval_timer = eval_timer
        self.balancer, self.tracker, self.stop = session.balancer, session.tracker, session.stop
        self.log, self.progress, self.model = session.log, session.progress, session.model
        self.decisions = Decisions(self.balancer, ledger, sitout, cfg.balancing.batch, self)
        self.stopped_at: Optional[tuple[int, float]] = None   # (epoch, t) of an end that stopped the run

    # ----------------------------------------------------------------- the Driver of decisions
    def present(self) -> list[Peer]:
        return self.roster.present()

    def top_up(self, w: Peer) -> None:
        """Hand w shards until it holds enough; with none left, split another's task."""
        if self.stop.reason or w.lost or w.benched:
            return
        self.ledger.top_up(w.rank, w.batch)
        self.replies.send_orders_to_waiting()
        self.log_shards()

    def has_work(self, w: Peer) -> bool:
        return not self.stop.reason and bool(self.ledger.of[w.rank].assigns)

    def wake(self, w: Peer, t: float, floor: Optional[int]) -> None:
        if floor is not None:
            w.step = max(w.step, floor)
        w.wake()
        self.replies.reply(w)

    def benched(self, w: Peer) -> None:
        self.log_shards()

    def shards_moved(self) -> None:
        self.log_shards()

    # ----------------------------------------------------------------- handing out
    def log_shards(self) -> None:
        events = self.ledger.take_events()
        if events:
            t = self.clock.now()
            for e in events:
                self.log.append("shards", t=t, epoch=e.epoch, shard=e.shard, src=e.src, dst=e.dst,
                                event=e.event, bytes=e.bytes)

    def wake_idle(self) -> None:
        """Send work to idle workers that the balancer has given shards to (see
        :meth:`mpilb.core.decisions.Decisions.wake_idle`)."""
        self.decisions.wake_idle(self.clock.now())

    def update_batches(self) -> None:
        self.decisions.update_batches(time.monotonic())

    # ----------------------------------------------------------------- epochs
    def begin(self, epoch: int, resume_counts=None) -> None:
        self.ledger.epoch = epoch
        order = epoch_order(self.cfg.experiment.seed, epoch, len(self.dataset.shard_sizes))
        # An empty shard (allowed by the format) holds no work: handed out, it would be a
        # task no push ever advances, and its worker would look silent.
        order = [s for s in order if self.dataset.shard_sizes[s] > 0]
        if resume_counts is None:
            self.tracker.begin(epoch, self.clock.now())
        else:   # an interrupted epoch: only what was not applied yet
            self.tracker.begin(epoch, self.clock.now(), resume_counts)
            order, pending = checkpoint.resume_plan(order, resume_counts, self.tracker.offsets,
                                                    self.dataset.shard_sizes)
            self.ledger.begin_epoch(epoch, pending)
        self.balancer.plan_epoch(epoch, order)
        self.update_batches()
        if self.tracker.complete:   # resumed from a checkpoint taken as the epoch ended
            self.end()
            return
        self.ledger.collect_moves()
        self.log_shards()
        for w in self.present():
            w.epoch_busy = 0.0
            w.epoch_finish = None
        self.wake_idle()

    def end(self) -> None:
        t = self.clock.now()
        stats = self.tracker.end(t)
        span = max(1e-9, stats.t_end - stats.t_start)
        active = [w for w in self.roster.peers.values() if not w.lost]
        busy = sum(w.epoch_busy for w in active)
        # seconds on the bench are not seats a worker could have filled (sit-out)
        sitout, t0 = self.sitout, self.clock.t0
        benched = 0.0 if sitout is None else sum(
            sitout.benched_s(w.rank, t0 + stats.t_start, t0 + stats.t_end) for w in active)
        seats = len(active) * span - benched
        util = min(1.0, busy / seats) if seats > 0 else 0.0
        finishes = [w.epoch_finish for w in active if w.epoch_finish is not None]
        imbalance = (max(finishes) - min(finishes)) if finishes else 0.0
        self.log.append("epochs", epoch=stats.epoch, t_start=stats.t_start, t_end=stats.t_end,
                        samples=stats.samples, utilization=util, imbalance_s=imbalance)
        if self.stop.check(stats.epoch + 1, t):
            # The run ends whatever this evaluation says (--epochs, --max-seconds): stop the
            # workers first; the final evaluation follows once they have stopped
            # (final_evaluation). Evaluating first held every worker's STOP behind it and
            # behind the epochs' evaluations still queued: on the cluster in a box, 0.7-1.2 s
            # at the end of a 2-4 s run, counted in its training time.
            self.stopped_at = (stats.epoch, stats.t_end)
            self.replies.begin_stop()
            return
        if not self.stop.waits_on_evaluations:
            # The run goes on whatever this evaluation says: hand out the next epoch first,
            # and evaluate while serving the workers (on the straggler benchmark every
            # worker used to wait 0.12 s for it at each epoch's end).
            self.begin(stats.epoch + 1)
            if self.model.num_state:   # statistics the pushes update: evaluate them now
                self.evaluate(epoch=stats.epoch)
                self.progress.epoch_done(stats.epoch, self.session.accuracy)
            else:
                self.session.evaluate_later(
                    self.slices.full_params(), self.clock.now(), self.slices.local.version,
                    stats.epoch,
                    then=lambda: self.progress.epoch_done(stats.epoch, self.session.accuracy))
            return
        self.evaluate()
        self.progress.epoch_done(stats.epoch, self.session.accuracy)
        if self.stop.check(stats.epoch + 1, t, self.session.evaluation):
            self.replies.begin_stop()
        else:
            self.begin(stats.epoch + 1)

    def evaluate(self, epoch: Optional[int] = None, t: Optional[float] = None) -> None:
        self.session.evaluate(self.slices.full_params(), self.clock.now() if t is None else t,
                              self.slices.local.version, self.ledger.epoch if epoch is None else epoch)
        self.eval_timer.reset(time.monotonic())

    def final_evaluation(self) -> None:
        """Serving ended: the evaluations still running or queued are logged, then the final
        parameters are evaluated unless the last evaluation read them. After an epoch whose
        end stopped the run, its row has the epoch's end for its time (the parameters have
        not changed since: every sample of the epoch was applied) and its progress line
        follows."""
        self.session.collect(wait=True)
        if self.session.eval_version != self.slices.local.version:   # every stop ends with the final metric
            self.evaluate(t=None if self.stopped_at is None else self.stopped_at[1])
        if self.stopped_at is not None:
            self.progress.epoch_done(self.stopped_at[0], self.session.accuracy)

    def evaluate_interval(self) -> None:
        """An --eval-interval evaluation. The run goes on meanwhile: it runs in the
        background (Session.evaluate_later) and a --target-* stop it fires comes with its
        result; one that falls due while the last still runs is skipped, so that
        evaluations never queue up. Rank 0 used to evaluate these in its own loop, every
        worker waiting: a run that evaluated every 0.1 s spent 45% of its time so
        (docs/architecture.md, Evaluation)."""
        self._evaluate_meanwhile(skip_if_running=True)
        self.eval_timer.reset(time.monotonic())

    def applied(self, samples: int) -> None:
        """`samples` more were applied: an --eval-every evaluation where they pass a multiple
        of N, as an --eval-interval one but queued behind one still running rather than
        skipped (Session.evaluate_later waits only when its queue is full), so that every
        count is evaluated whatever the machine's speed."""
        if self.session.eval_samples.add(samples):
            self._evaluate_meanwhile(skip_if_running=False)

    def _evaluate_meanwhile(self, skip_if_running: bool) -> None:
        """Evaluate in the background while the run goes on, a --target-* it meets stopping
        the run when its result is in (`skip_if_running`: not at all while another still
        runs). Models whose state the pushes update (BatchNorm statistics) are evaluated at
        once, as before."""
        if self.model.num_state:
            self.evaluate()
            self._after_interval()
            return
        if skip_if_running:
            self.session.collect()
            if self.session.evaluating:
                return
        self.session.evaluate_later(self.slices.full_params(), self.clock.now(),
                                    self.slices.local.version, self.ledger.epoch,
                                    then=self._after_interval)

    def _after_interval(self) -> None:
        """An --eval-interval evaluation is in: a --target-* it met stops the run."""
        if not self.stop.reason and self.stop.check(self.tracker.epoch, self.clock.now(),
                                                    self.session.evaluation):
            self.replies.begin_stop()
