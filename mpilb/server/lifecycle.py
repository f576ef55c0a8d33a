"""Start and end of a parameter server's run (a part of the parameter server).

``_start`` sets the clocks, posts the first receives and begins the first (or resumed)
epoch; ``_begin_stop`` sends STOP to every waiting worker once a stop rule fired;
``finish`` closes the session with the run's summary attributes, ``abandon`` as failed.
Mixed into :class:`~mpilb.server.loop.ParameterServer`.
"""

from __future__ import annotations

import json
import time

from mpilb.core.epochs import EpochStats
from mpilb.mpi.wire import Cmd


class Lifecycle:
    """Starting, stopping and finishing a run (a mixin: it reads the server's state)."""

    # ----------------------------------------------------------------- stop
    def _begin_stop(self) -> None:
        if not self.stop.reason:
            self.stop.reason = "stopped"
        for w in self.present():
            if w.idle or w.held:
                self._reply(w, Cmd.STOP)

    def _all_stopped(self) -> bool:
        return all(w.stopped or w.lost for w in self.peers.values())

    # ----------------------------------------------------------------- start
    def _start(self) -> None:
        self.t0 = time.monotonic() - (self.resumed.train_s if self.resumed else 0.0)
        self.cpu0 = time.process_time()
        self.last_checkpoint = time.monotonic()
        self.last_eval = self.last_rebalance = self.t0
        for w in self.peers.values():
            w.last_seen = self.t0
            self._post_recv(w)
            w.go_idle()
        self.stores.start(self.resumed.version if self.resumed else 0)
        if not self.stop.waits_on_evaluations:
            # epochs' evaluations will run beside the pushes (epochs.py): their process
            # starts now, to be ready by the first epoch's end
            self.session.start_background_evaluation(self.ranks_here)
        ck = self.resumed
        self.progress.begin(ck.epoch if ck else 0, int((ck.counts > 0).sum()) if ck else 0, self.now())
        if ck is None:
            self._begin_epoch(0)
            return
        self.tracker.completed = [EpochStats(**e) for e in ck.completed]
        if ck.epoch >= self.cfg.epochs or self.stop.check(ck.epoch, self.now(), None):
            # nothing to do, but the interrupted epoch's counts must survive the checkpoint
            # this run ends with (they were zeroed, and a later resume's coverage lied)
            self.tracker.begin(ck.epoch, self.now(), ck.counts)
            self.stop.reason = self.stop.reason or "epochs"
            self._begin_stop()
        else:
            self._begin_epoch(ck.epoch, ck.counts)

    def abandon(self) -> None:
        """Set-up failed elsewhere: close the run log as failed."""
        self.log.close("failed")

    def finish(self, status: str) -> dict:
        servers = self.stores.end(self.log, self.now(),
                                  wait=status != "failed" and not self.store_lost)
        attrs = {
            "servers": json.dumps(servers),
            "train_s": getattr(self, "train_s", self.now()),
            "wall_s": self.now(),
            "server_cpu_s": time.process_time() - self.cpu0,
            "coverage": json.dumps(self.tracker.coverage()),
            "lost_workers": json.dumps(self.lost),
            "stop_reason": self.stop.reason,
            "rejected_gradients": self.rejected,
            "eval_s": self.evaluator.seconds,
            "stray_samples": self.tracker.stray,
        }
        return self.session.close(status, attrs)
