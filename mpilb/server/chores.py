"""What rank 0 does between pushes: errors, preemption, lost workers, leave requests, and
its timers.

Every 10 ms at most (25 ms where every worker rings, and at least every 100 ms then: see
``RUNG_NAP_S``), not at every poll, the loop checks for a worker's error report
or a preemption notice (stopsignals.py), declares silent workers lost (liveness.py: their
tasks go to the others), and runs the timers: checkpoints, rebalancing and batch sizes (the
pure decisions of :mod:`mpilb.core.decisions`), evaluation, --max-seconds, the log's flush
and the progress line.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional

from mpilb.core.decisions import CHORES_S, Interval, RebalanceTimer
from mpilb.mpi import comm as C
from mpilb.run import signals
from mpilb.run.signals import PREEMPTED
from mpilb.server.liveness import WorkerFailed


class Checkpoints:
    """Rank 0's checkpoints: at --checkpoint-interval, at a preemption, at the end.

    Args:
        cfg: --checkpoint and the configuration saved with it.
        session: the run (its log, and the one checkpoint writer).
        state: the server (``params``, ``version``, ``epoch``, ``now()``).
    """

    def __init__(self, cfg, session, state):
        self.cfg = cfg
        self.session = session   # the one checkpoint writer (Session.write_checkpoint)
        self.log = session.log
        self.state = state
        self.last_checkpoint = time.monotonic()
        self.checkpointed_at: Optional[int] = None   # version of the last checkpoint written

    @property
    def params(self):
        return self.state.params

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def epoch(self) -> int:
        return self.state.epoch

    def now(self) -> float:
        return self.state.now()

    def due(self, mono: float) -> bool:
        return mono - self.last_checkpoint >= self.cfg.output.checkpoint_interval

    def checkpoint(self) -> None:
        self.last_checkpoint = time.monotonic()
        if not self.cfg.output.checkpoint:
            return
        self.log.flush()   # the log holds everything up to the checkpoint: a resume continues it
        self._save_checkpoint()

    def rescue_checkpoint(self) -> str:
        """The run log cannot be written: the weights go into the checkpoint all the same
        (its disk may have room). Returns what the run's last line says of it."""
        return self.session.rescue_checkpoint(self._save_checkpoint)

    def _save_checkpoint(self) -> None:
        self.checkpointed_at = self.version
        self.session.write_checkpoint(self.params, self.version, self.epoch, self.now())


class Chores:
    """Timers and liveness of the parameter server between pushes.

    Args:
        cfg: the intervals (--rebalance-interval, --eval-interval, --max-seconds ...).
        comm: the world communicator (workers' error reports).
        session: the evaluations, run log, progress, stop rule, balancer, tracker.
        clock: the run's clock.
        roster: the workers.
        slices: rank 0's parameter slices (:class:`~mpilb.server.group.SliceGroup`) (their `servers/` rows).
        epochs: evaluations and the decisions (:class:`~mpilb.server.epochs.Epochs`).
        liveness: lost workers (:class:`~mpilb.server.liveness.Liveness`).
        signals: stop signals (:class:`~mpilb.server.stopsignals.StopSignals`).
        checkpoints: the :class:`Checkpoints`.
        eval_timer: the --eval-interval timer.
        begin_stop: stops every worker (the server's protocol).
    """

    CHORES_S = CHORES_S   # how often the main loop checks errors, lost workers and timers
    CHORES_RUNG_S = 0.025   # the same where every worker rings (no polls to piggyback on)
    # ... and the longest such a server sleeps: chores due meanwhile wait for the next push
    # to wake it, or for this (each wake-up of its own costs CPU: 25 -> 100 ms took the
    # server's CPU from 0.050-0.057 to 0.046-0.048 of the wall time, workers at 50 ms a step)
    RUNG_NAP_S = 0.1

    def __init__(self, cfg, comm, session, clock, roster, slices, epochs, liveness, signals,
                 checkpoints: Checkpoints, eval_timer: Interval, begin_stop: Callable[[], None]):
        self.cfg = cfg
        self.comm = comm
        self.session = session
        self.clock = clock
        self.roster = roster
        self.slices = slices
        self.epochs = epochs
        self.liveness = liveness
        self.signals = signals
        self.checkpoints = checkpoints
        self.eval_timer = eval_timer
        self.begin_stop = begin_stop
        self.balancer, self.tracker, self.stop = session.balancer, session.tracker, session.stop
        self.log, self.progress = session.log, session.progress
        self.rebalance_timer = RebalanceTimer(cfg.balancing.rebalance_interval,
                                              cfg.balancing.batch_policy == "proportional")
        self.preempted = False

    def start(self, t0: float) -> None:
        """The run's clock started at ``t0`` (earlier on a resume: its timers are due)."""
        self.checkpoints.last_checkpoint = time.monotonic()
        self.eval_timer.reset(t0)
        self.rebalance_timer.done(t0)

    def run(self) -> None:
        self.liveness.note_unwatched()
        self.session.collect()   # an evaluation done in the background
        err = C.poll_error(self.comm)
        if err is not None:
            raise WorkerFailed(*err)
        self.signals.poll()
        ended = self.signals.judge(self.preempted)
        if ended is not None:
            self.liveness.declare_lost(self.roster.peers[ended], "sent nothing since the SIGTERM")
        mono = time.monotonic()
        self.liveness.check(mono)
        if self.liveness.members is not None:
            self.liveness.members.poll(mono)   # `mpilb leave` requests (roster.py)
        self.timers()

    def next_push_due(self) -> tuple[Optional[float], float, Optional[float]]:
        """(due, grace, span) of the next push expected, for the backoff (see C.Backoff):
        span, the worker's usual gap, sets how finely it is polled for."""
        now = time.monotonic()
        best: tuple[Optional[float], float, Optional[float]] = (None, 0.0, None)
        for w in self.roster.peers.values():
            if not w.awaiting or w.lost:
                continue
            due, grace = w.push_gap.window(w.last_seen)
            if due is not None and due + grace > now and (best[0] is None or due < best[0]):
                best = (due, grace, w.push_gap.value)
        return best

    # ----------------------------------------------------------------- timers
    def timers(self) -> None:
        mono = time.monotonic()
        if PREEMPTED.is_set() and not self.preempted:
            self.preempt()
        if self.cfg.output.checkpoint and not self.stop.reason and self.checkpoints.due(mono):
            self.checkpoints.checkpoint()
        if self.rebalance_timer.due(mono, self.roster.present(), self.balancer.rate_known):
            self.rebalance(mono)
        if self.eval_timer.due(mono):
            self.epochs.evaluate_interval()
        if (self.cfg.stopping.max_seconds is not None and self.clock.now() >= self.cfg.stopping.max_seconds
                and not self.stop.reason):
            self.stop.check(self.tracker.epoch, self.clock.now(), self.session.evaluation)
            self.begin_stop()
        self.log.maybe_flush()
        if self.progress.enabled:
            self.progress.update(self.epochs.ledger.epoch, self.tracker.distinct,
                                 self.slices.local.version, self.session.accuracy,
                                 [w.rank for w in self.roster.present()], lost=self.roster.lost)

    def rebalance(self, mono: float) -> None:
        self.rebalance_timer.done(mono)
        self.epochs.decisions.rebalance(self.clock.now(), mono)
        self.log_worker_rows()

    def log_worker_rows(self) -> None:
        """One `workers/` row per worker with what it reported since the previous row."""
        t = self.clock.now()
        self.slices.log_rows(self.log, t)
        for w in self.roster.peers.values():
            if not (w.lost or w.left):   # (a worker that left had its last row then)
                self.log_worker_row(w, t)

    def log_worker_row(self, w, t: float) -> None:
        self.log.append("workers", t=t, worker=w.rank, batch=w.batch,
                        rate=self.balancer.rate(w.rank),
                        predicted_rate=self.balancer.predicted_rate(w.rank),
                        throughput=self.balancer.measured_rate(w.rank), **w.take_row())

    def preempt(self) -> None:
        """SIGTERM/SIGUSR1 on some rank: checkpoint, tell every worker to stop, exit 0."""
        self.preempted = True
        self.signals.poll()   # a signal of rank 0's own since this round's poll: the line names it
        print(f"mpilb: {signals.stop_text(self.signals.stop_signal)}: checkpointing and stopping",
              file=sys.stderr, flush=True)
        if not self.stop.reason:
            self.checkpoints.checkpoint()
        self.stop.reason = self.stop.reason or "preempted"
        self.begin_stop()
