"""What rank 0 does between pushes: errors, preemption, lost workers, and its timers.

Every 10 ms at most (25 ms where every worker rings, and at least every 100 ms then: see
``RUNG_NAP_S``), not at every poll, the loop checks for a worker's error report
or a preemption notice, declares silent workers lost (their tasks go to the others), and runs
the timers: checkpoints, rebalancing and batch sizes, evaluation, --max-seconds, the log's
flush and the progress line. Mixed into :class:`~mpilb.server.loop.ParameterServer`.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import Optional

from mpilb.run import signals
from mpilb.mpi import comm as C
from mpilb.run.signals import PREEMPTED, USR1_NOTICE
from mpilb.mpi.watchdog import KEEP_ALIVE_S
from mpilb.server.vote import SignalVote

FIRST_SIZES_STEPS = 16   # proportional batches are first sized after this many steps each
WARMUP_FIRST_S = 0.25    # after the first rates, rebalance after 0.25, 0.5, 1 ... s
# a SIGUSR1 this soon after MPI reported a rank's end is the launcher's notice of it (the
# vote of Chores._signal_from cannot tell: the dead rank is no longer among those it awaits)
DEATH_NOTICE_S = 5.0


class WorkerFailed(Exception):
    def __init__(self, rank: int, text: str, code: int = 1):
        super().__init__(f"rank {rank}: {text}")
        self.rank = rank
        self.text = text
        self.code = code   # 2: the user's input (e.g. a model that breaks the protocol)


class Chores:
    """Timers and liveness of the parameter server (a mixin: it reads the server's state)."""

    CHORES_S = 0.01    # how often the main loop checks errors, lost workers and timers
    CHORES_RUNG_S = 0.025   # the same where every worker rings (no polls to piggyback on)
    # ... and the longest such a server sleeps: chores due meanwhile wait for the next push
    # to wake it, or for this (each wake-up of its own costs CPU: 25 -> 100 ms took the
    # server's CPU from 0.050-0.057 to 0.046-0.048 of the wall time, workers at 50 ms a step)
    RUNG_NAP_S = 0.1
    UNWATCHED_S = 0.25  # a longer gap between chores: rank 0 was busy or stopped, not watching
    LIVENESS_S = 0.05   # how often lost workers and stalls are looked for
    _next_liveness = 0.0
    _warmup_gap: Optional[float] = None   # see _warmup_due
    _vote: Optional[SignalVote] = None    # see vote.py
    _own_signals = 0                      # of signals.RECEIVED, those already counted
    _stop_signal: Optional[int] = None    # the signal that stops the run (its line names it)
    _died: Optional[tuple] = None         # (when, rank, said) of the last death MPI reported

    def _chores(self) -> None:
        self._note_unwatched()
        self.session.collect()   # an evaluation done in the background
        err = C.poll_error(self.comm)
        if err is not None:
            raise WorkerFailed(*err)
        while (notice := C.poll_preempt(self.comm)) is not None:
            src, signum = notice
            if signum != signal.SIGUSR1:
                PREEMPTED.set()   # a stop whatever the vote says (its checkpoint comes first)
            self._signal_from(src, signum)
        USR1_NOTICE.clear()   # rank 0's own signals, SIGUSR1 included, are in RECEIVED
        while self._own_signals < len(signals.RECEIVED):
            self._own_signals += 1
            self._signal_from(0, signals.RECEIVED[self._own_signals - 1])
        self._judge_signals()
        mono = time.monotonic()
        if mono >= self._next_liveness:   # silence is judged in seconds: 20 times a second
            self._next_liveness = mono + self.LIVENESS_S
            self.remote.watch(mono)   # a silent store ends the run before its workers are judged
            self._check_lost()
            self._check_stalled()
            self._keep_alive(mono)
        self._timers()

    def _next_push_due(self) -> tuple[Optional[float], float, Optional[float]]:
        """(due, grace, span) of the next push expected, for the backoff (see C.Backoff):
        span, the worker's usual gap, sets how finely it is polled for."""
        now = time.monotonic()
        best: tuple[Optional[float], float, Optional[float]] = (None, 0.0, None)
        for w in self.peers.values():
            if not w.awaiting or w.lost:
                continue
            due, grace = w.push_gap.window(w.last_seen)
            if due is not None and due + grace > now and (best[0] is None or due < best[0]):
                best = (due, grace, w.push_gap.value)
        return best

    # ----------------------------------------------------------------- timers
    def _timers(self) -> None:
        mono = time.monotonic()
        if PREEMPTED.is_set() and not self.preempted:
            self._preempt()
        if (self.cfg.checkpoint and not self.stop.reason
                and mono - self.last_checkpoint >= self.cfg.checkpoint_interval):
            self._checkpoint()
        if (mono - self.last_rebalance >= self.cfg.rebalance_interval or self._first_sizes_due()
                or self._warmup_due(mono)):
            self._rebalance(mono)
        if mono - self.last_eval >= self.cfg.eval_interval:
            self._evaluate()
            if self.stop.check(self.tracker.epoch, self.now(), self.session.evaluation):
                self._begin_stop()
        if self.cfg.max_seconds is not None and self.now() >= self.cfg.max_seconds and not self.stop.reason:
            self.stop.check(self.tracker.epoch, self.now(), self.session.evaluation)
            self._begin_stop()
        self.log.maybe_flush()
        if self.progress.enabled:
            self.progress.update(self.epoch, self.tracker.distinct, self.version, self.accuracy,
                                 [w.rank for w in self.present()], lost=self.lost)

    def _first_sizes_due(self) -> bool:
        """Proportional batches: size them as soon as every worker has taken a few steps,
        not only at the first --rebalance-interval (a slow worker costs every round)."""
        if self.sized_early or self.cfg.batch_policy != "proportional":
            return False
        busy = [w for w in self.present() if not w.idle]
        if busy and all(w.step >= FIRST_SIZES_STEPS for w in busy):
            self.sized_early = True
        return self.sized_early

    def _warmup_due(self, mono: float) -> bool:
        """Rates learnt from the first steps are used at once: a rebalance as soon as every
        busy worker has a first estimate (a bucket of its first steps), then after 0.25,
        0.5, 1 ... s while the estimates settle, until the gap reaches --rebalance-interval.
        A run of a few seconds would otherwise spend its first interval on a blind plan."""
        gap = self._warmup_gap
        if gap is None:
            busy = [w for w in self.present() if not w.idle]
            if busy and all(self.balancer.rate_known(w.rank) for w in busy):
                self._warmup_gap = WARMUP_FIRST_S
                return True
            return False
        if gap < self.cfg.rebalance_interval and mono - self.last_rebalance >= gap:
            self._warmup_gap = 2 * gap
            return True
        return False

    def _rebalance(self, mono: float) -> None:
        self.last_rebalance = mono
        t = self.now()
        committed = self.ledger.committed(w.rank for w in self.present())
        if self.rule.sitout is not None:
            self.rule.sitout.start_probes(self.present(), mono)
        self.balancer.rebalance(t, committed)
        self.ledger.collect_moves()
        self._log_shards()
        self._wake_idle()
        self._update_batches()
        self._log_worker_rows()

    def _update_batches(self) -> None:
        sitout = self.rule.sitout
        present = self.present()
        # judged on the interval that just ended
        slow = sitout.slow(present) if sitout is not None else set()
        sizes = self.balancer.batch_sizes(frozenset(slow))
        for w in present:
            w.batch = int(sizes.get(w.rank, self.cfg.batch))
            if w.probing:
                w.batch = sitout.probe_batch()
            elif w.rank in slow:
                w.batch = 0
            if w.batch == 0 and sitout is not None and not w.benched and w.idle:
                sitout.bench(w, self.present(), time.monotonic())   # nothing in flight: at once
                self._log_shards()                                  # (else after its next push)
            w.lags.clear()

    def _log_worker_rows(self) -> None:
        """One `workers/` row per worker with what it reported since the previous row."""
        t = self.now()
        self.stores.log_rows(self.log, t)
        for w in self.peers.values():
            if w.lost:
                continue
            self.log.append("workers", t=t, worker=w.rank, batch=w.batch,
                            rate=self.balancer.rate(w.rank),
                            predicted_rate=self.balancer.predicted_rate(w.rank),
                            throughput=self.balancer.measured_rate(w.rank), **w.take_row())

    # ----------------------------------------------------------------- liveness
    def _keep_alive(self, mono: float) -> None:
        """Every worker hears from rank 0 at least every KEEP_ALIVE_S, also while it is idle,
        held (ssp, sync) or blocked for rows: its watchdog tells a silent rank 0 from a
        gone one by that (watchdog.py)."""
        for w in self.present():
            if mono - w.told_at > KEEP_ALIVE_S:
                self.outbox.keep_alive(w)

    def _note_unwatched(self) -> None:
        """Remember when rank 0 did not watch (a long checkpoint or evaluation, SIGSTOP):
        that time does not count as the workers' silence (their pushes wait unread)."""
        mono = time.monotonic()
        last = getattr(self, "_last_watch", None)
        gaps = self.__dict__.setdefault("_unwatched", [])
        if last is not None and mono - last > self.UNWATCHED_S:
            gaps.append((last, mono))
        horizon = mono - 2 * self.cfg.worker_timeout
        while gaps and gaps[0][1] < horizon:
            gaps.pop(0)
        self._last_watch = mono

    def silence(self, w, mono: float) -> float:
        """Seconds rank 0 watched for w's next message in vain since it last heard of it."""
        watched = mono - w.last_seen
        for start, end in getattr(self, "_unwatched", ()):
            watched -= max(0.0, min(end, mono) - max(start, w.last_seen))
        return watched

    def _check_lost(self) -> None:
        """Declare lost every worker silent past --worker-timeout. A worker blocked waiting
        for rows that another silent worker owes it is silent through no fault of its own:
        the one that owes the rows goes first, its rows are re-sourced (which restarts the
        receiver's clock, see _declare_lost), and the receiver is judged again."""
        while True:
            silent = self._silent()
            if not silent:
                return
            ranks = {w.rank for w in silent}
            first = next((w for w in silent if self.ledger.awaits_rows(w.rank) not in ranks), silent[0])
            self._declare_lost(first)

    def _silent(self) -> list:
        mono = time.monotonic()
        out = []
        if self.remote.doubtful(mono):
            return out   # workers may be waiting on a store's reply: the store is judged first
        for w in self.present():
            if w.idle or w.held:
                continue
            if self.silence(w, mono) > self.cfg.worker_timeout:
                req = w.link.recv_req
                if req is not None and req.Get_status():
                    continue   # its push has arrived and waits to be read: not silent
                out.append(w)
        return out

    def _check_stalled(self) -> None:
        """Every worker idle with the epoch unfinished would wait forever: a bug, say so."""
        if self.stop.reason or self.tracker.complete:
            return
        present = self.present()
        if present and all(w.idle for w in present) and not any(self.balancer.queued(w.rank) for w in present):
            missing = self.tracker.total - self.tracker.distinct
            raise RuntimeError(f"epoch {self.epoch + 1}: every worker is idle but {missing} samples "
                               f"were never handed out (balancer {self.cfg.balancer})")

    def _declare_lost(self, w, why: str = "") -> None:
        why = why or f"silent for {self.cfg.worker_timeout:g} s"
        vote = self._vote
        came_with_loss = vote is not None and vote.came_with_loss(w.rank)
        fails = came_with_loss and vote.signum != signal.SIGUSR1   # see below
        print(f"mpilb: rank {w.rank} {why}: declared lost"
              + ("" if fails else "; its shards go to the other workers"),
              file=sys.stderr, flush=True)
        if came_with_loss and not fails:
            self._vote = None
            print(f"mpilb: {vote.loss_text(w.rank)}", file=sys.stderr, flush=True)
        if why.startswith("ended"):   # MPI saw it die: Hydra's SIGUSR1 may follow (_signal_from)
            self._died = (time.monotonic(), w.rank, False)
        w.lose()
        self.bell.forget(w.rank)   # a push it rang will not come
        self.remote.lose(w.rank)   # every store stops listening to it
        self.lost.append(w.rank)
        self.balancer.remove_worker(w.rank)
        self.ledger.take_back(w.rank, lost=True)
        self._log_shards()
        if fails:   # a launcher's SIGTERM after a death: the job ends, and not as preempted
            raise WorkerFailed(w.rank, vote.loss_text(w.rank))   # the job ends: log `failed`
        if all(o.lost for o in self.peers.values()):
            raise RuntimeError("every worker was lost")
        if self.ledger.holders is not None:
            # rows it owed come from another copy (--replicas >= 2); else resource() raises
            for receiver, t in self.ledger.resource(w.rank):
                # it waited for rows that could not come: its silence counts from now
                peer = self.peers[receiver]
                peer.last_seen = max(peer.last_seen, time.monotonic())
                print(f"mpilb: rows of shard {t.shard} that rank {w.rank} owed rank {receiver} "
                      f"come from rank {t.src} instead", file=sys.stderr, flush=True)
            self._log_shards()
            # Now, whatever the holder is doing: it may itself be blocked waiting for rows
            # (from the lost rank, re-sourced to the receiver), and serves orders meanwhile.
            for r in self.ledger.take_ordered():
                if self.ledger.has_orders(r) and self.peers[r].present and not self.peers[r].lost:
                    self.outbox.orders(self.peers[r])
        self._wake_idle()
        if self.rule.round_complete(self.present()):
            self._close_round()
        self._release_held()

    # ----------------------------------------------------------------- stop signals
    def _signal_from(self, rank: int, signum: int) -> None:
        """Stop signal `signum` reached `rank` (0: this one): it starts a vote over the
        workers present, or counts as a report in the one under way (vote.py). A SIGTERM
        during a SIGUSR1 vote starts its own: the run stops now."""
        if signum == signal.SIGINT:
            return   # Ctrl-C: the user's own stop, no launcher's notice
        died = self._died
        if (signum == signal.SIGUSR1 and died is not None
                and time.monotonic() - died[0] < DEATH_NOTICE_S):
            if not died[2]:   # the notice reaches every rank: said once
                self._died = (*died[:2], True)
                print(f"mpilb: the SIGUSR1 of {self.now():.1f} s came after rank {died[1]} ended: "
                      f"taken as the launcher's notice of it (MPICH -disable-auto-cleanup), not as "
                      f"a preemption", file=sys.stderr, flush=True)
            return
        if signum == signal.SIGTERM:
            self._stop_signal = self._stop_signal or signum
        vote = self._vote
        if vote is None or (signum == signal.SIGTERM and vote.signum != signum):
            vote = self._vote = SignalVote.start(signum, self.now(), time.monotonic(),
                                                 self.present(), C.launcher_kill_grace())
        vote.report(rank)   # any stop signal a worker reports shows it alive

    def _judge_signals(self) -> None:
        vote = self._vote
        if vote is None:
            return
        vote.update(self.peers)
        if vote.signum == signal.SIGUSR1:
            if vote.passed and not self.preempted:
                self._vote = None
                self._stop_signal = self._stop_signal or signal.SIGUSR1
                PREEMPTED.set()
            return
        ended = vote.ended(self.peers, time.monotonic())
        if ended is not None:
            self._declare_lost(self.peers[ended], "sent nothing since the SIGTERM")

    # ----------------------------------------------------------------- checkpoints, signals
    def _checkpoint(self) -> None:
        self.last_checkpoint = time.monotonic()
        if not self.cfg.checkpoint:
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

    def _preempt(self) -> None:
        """SIGTERM/SIGUSR1 on some rank: checkpoint, tell every worker to stop, exit 0."""
        self.preempted = True
        print(f"mpilb: {signals.stop_text(self._stop_signal)}: checkpointing and stopping",
              file=sys.stderr, flush=True)
        if not self.stop.reason:
            self._checkpoint()
        self.stop.reason = self.stop.reason or "preempted"
        self._begin_stop()
