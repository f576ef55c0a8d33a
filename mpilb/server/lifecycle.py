"""Start and end of a parameter server's run (a part of the parameter server).

:class:`Clock` is the run's clock (from the start, or from where a resumed run left off).
:class:`Lifecycle`: ``start`` sets the clocks, posts the first receives and begins the first
(or resumed) epoch; ``wind_down`` and ``status`` end the serving (the last evaluation and
rows, the final checkpoint); ``finish`` closes the session with the run's summary
attributes, ``abandon`` as failed.
"""

from __future__ import annotations

import json
import time
from typing import Optional

from mpilb.core.epochs import EpochStats


class Clock:
    """Seconds of the run (``now()``) and rank 0's CPU seconds, from ``start``."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.cpu0 = time.process_time()

    def start(self, trained_s: float = 0.0) -> None:
        """The run starts now, ``trained_s`` into its training (a resumed run)."""
        self.t0 = time.monotonic() - trained_s
        self.cpu0 = time.process_time()

    def now(self) -> float:
        return time.monotonic() - self.t0


class Lifecycle:
    """Starting and finishing a run.

    Args:
        cfg: --epochs, --checkpoint.
        session: resume, evaluations, tracker, stop rule, progress, run log.
        clock: the run's :class:`Clock`.
        roster: the workers.
        slices: rank 0's parameter slices (:class:`~mpilb.server.group.SliceGroup`).
        receiver: posts the workers' receives (:class:`~mpilb.server.receive.Receiver`).
        epochs: begins epochs, evaluates (:class:`~mpilb.server.epochs.Epochs`).
        chores: the timers, the preemption flag, worker rows (:class:`~mpilb.server.chores.Chores`).
        server: the protocol (``begin_stop()``, ``rejected``, ``version``).
        ranks_here: ranks on rank 0's node (the background evaluation's cores).
    """

    def __init__(self, cfg, session, clock: Clock, roster, slices, receiver, epochs, chores,
                 server, ranks_here: int):
        self.cfg = cfg
        self.session = session
        self.clock = clock
        self.roster = roster
        self.slices = slices
        self.receiver = receiver
        self.epochs = epochs
        self.chores = chores
        self.server = server
        self.ranks_here = ranks_here
        self.resumed, self.tracker, self.stop = session.resumed, session.tracker, session.stop
        self.log, self.progress, self.evaluator = session.log, session.progress, session.evaluator
        self.train_s: Optional[float] = None   # seconds of training, set when serving ends
        self.store_lost = False   # a parameter store stopped answering: the run ends

    def now(self) -> float:
        return self.clock.now()

    # ----------------------------------------------------------------- start
    def start(self) -> None:
        self.clock.start(self.resumed.train_s if self.resumed else 0.0)
        t0 = self.clock.t0
        self.chores.start(t0)
        for w in self.roster.peers.values():
            w.last_seen = t0
            self.receiver.post(w)
            w.go_idle()
        self.slices.start(self.resumed.version if self.resumed else 0)
        if not self.stop.waits_on_evaluations:
            # epochs' evaluations will run beside the pushes (epochs.py): their process
            # starts now, to be ready by the first epoch's end
            self.session.start_background_evaluation(self.ranks_here)
        ck = self.resumed
        self.progress.begin(ck.epoch if ck else 0, int((ck.counts > 0).sum()) if ck else 0, self.now())
        if ck is None:
            self.epochs.begin(0)
            return
        self.tracker.completed = [EpochStats(**e) for e in ck.completed]
        if ck.epoch >= self.cfg.stopping.epochs or self.stop.check(ck.epoch, self.now(), None):
            # nothing to do, but the interrupted epoch's counts must survive the checkpoint
            # this run ends with (they were zeroed, and a later resume's coverage lied)
            self.tracker.begin(ck.epoch, self.now(), ck.counts)
            self.stop.reason = self.stop.reason or "epochs"
            self.server.begin_stop()
        else:
            self.epochs.begin(ck.epoch, ck.counts)

    # ----------------------------------------------------------------- end
    def wind_down(self) -> None:
        """Serving ended: the last evaluation and `workers/` rows."""
        self.train_s = self.now()
        self.epochs.final_evaluation()
        self.chores.log_worker_rows()

    def status(self) -> str:
        """The final checkpoint; returns the run's status."""
        checkpoints = self.chores.checkpoints
        preempted = self.chores.preempted
        # Every run ends with its final parameters in the checkpoint; a preemption that
        # came while the run was already stopping did not write one.
        if self.cfg.output.checkpoint and (not preempted or checkpoints.checkpointed_at != self.server.version):
            checkpoints.checkpoint()
        if preempted:
            return "preempted"
        return "degraded" if self.roster.lost else "finished"

    def abandon(self) -> None:
        """Set-up failed elsewhere: close the run log as failed."""
        self.log.close("failed")

    def finish(self, status: str) -> dict:
        servers = self.slices.end(self.log, self.now(),
                                  wait=status != "failed" and not self.store_lost)
        return self.session.finish(
            status, train_s=self.train_s if self.train_s is not None else self.now(),
            wall_s=self.now(), cpu_s=time.process_time() - self.clock.cpu0,
            lost=self.roster.lost, rejected=self.server.rejected,
            servers=json.dumps(servers), stray_samples=self.tracker.stray,
            doorbells=json.dumps(self.receiver.bell.report()))
