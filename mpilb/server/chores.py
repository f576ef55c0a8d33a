"""What rank 0 does between pushes: errors, preemption, lost workers, and its timers.

A few hundred times a second (not at every poll) the loop checks for a worker's error report
or a preemption notice, declares silent workers lost (their tasks go to the others), and runs
the timers: checkpoints, rebalancing and batch sizes, evaluation, --max-seconds, the log's
flush and the progress line. Mixed into :class:`~mpilb.server.loop.ParameterServer`.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

from .. import checkpoint
from .. import comm as C
from ..training import PREEMPTED

FIRST_SIZES_STEPS = 16   # proportional batches are first sized after this many steps each


class WorkerFailed(Exception):
    def __init__(self, rank: int, text: str):
        super().__init__(f"rank {rank}: {text}")
        self.rank = rank
        self.text = text


class Chores:
    """Timers and liveness of the parameter server (a mixin: it reads the server's state)."""

    CHORES_S = 0.002   # how often the main loop checks errors, lost workers and timers

    def _chores(self) -> None:
        err = C.poll_error(self.comm)
        if err is not None:
            raise WorkerFailed(*err)
        if C.poll_preempt(self.comm):
            PREEMPTED.set()
        self._check_lost()
        self._check_stalled()
        self._timers()

    def _next_push_due(self) -> tuple[Optional[float], float]:
        """(due, grace) of the next push expected, for the backoff (see C.Backoff)."""
        now = time.monotonic()
        best: tuple[Optional[float], float] = (None, 0.0)
        for w in self.peers.values():
            if not w.awaiting or w.lost:
                continue
            due, grace = w.push_gap.window(w.last_seen)
            if due is not None and due + grace > now and (best[0] is None or due < best[0]):
                best = (due, grace)
        return best

    # ----------------------------------------------------------------- timers
    def _timers(self) -> None:
        mono = time.monotonic()
        if PREEMPTED.is_set() and not self.preempted:
            self._preempt()
        if (self.cfg.checkpoint and not self.stop.reason
                and mono - self.last_checkpoint >= self.cfg.checkpoint_interval):
            self._checkpoint()
        if mono - self.last_rebalance >= self.cfg.rebalance_interval or self._first_sizes_due():
            self._rebalance(mono)
        if mono - self.last_eval >= self.cfg.eval_interval:
            self._evaluate()
            if self.stop.check(self.tracker.epoch, self.now(), self.session.evaluation):
                self._begin_stop()
        if self.cfg.max_seconds is not None and self.now() >= self.cfg.max_seconds and not self.stop.reason:
            self.stop.check(self.tracker.epoch, self.now(), self.session.evaluation)
            self._begin_stop()
        self.log.maybe_flush()
        rates = {w.rank: self.balancer.rate(w.rank) for w in self.present()}
        self.progress.update(self.epoch, self.tracker.distinct, self.version, self.accuracy, rates)

    def _first_sizes_due(self) -> bool:
        """Proportional batches: size them as soon as every worker has taken a few steps,
        not only at the first --rebalance-interval (a slow worker costs every round)."""
        if self.sized_early or self.cfg.batch_policy != "proportional":
            return False
        busy = [w for w in self.present() if not w.idle]
        if busy and all(w.step >= FIRST_SIZES_STEPS for w in busy):
            self.sized_early = True
        return self.sized_early

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
        for w in self.peers.values():
            if w.lost:
                continue
            self.log.append("workers", t=t, worker=w.rank, batch=w.batch,
                            rate=self.balancer.rate(w.rank),
                            predicted_rate=self.balancer.predicted_rate(w.rank), **w.take_row())

    # ----------------------------------------------------------------- liveness
    def _check_lost(self) -> None:
        mono = time.monotonic()
        for w in self.present():
            if w.idle or w.held:
                continue
            if mono - w.last_seen > self.cfg.worker_timeout:
                self._declare_lost(w)

    def _check_stalled(self) -> None:
        """Every worker idle with the epoch unfinished would wait forever: a bug, say so."""
        if self.stop.reason or self.tracker.complete:
            return
        present = self.present()
        if present and all(w.idle for w in present) and not any(self.balancer.queued(w.rank) for w in present):
            missing = self.tracker.total - self.tracker.distinct
            raise RuntimeError(f"epoch {self.epoch}: every worker is idle but {missing} samples "
                               f"were never handed out (balancer {self.cfg.balancer})")

    def _declare_lost(self, w) -> None:
        print(f"mpilb: rank {w.rank} silent for {self.cfg.worker_timeout:g} s: declared lost; "
              f"its shards go to the other workers", file=sys.stderr, flush=True)
        w.lose()
        self.lost.append(w.rank)
        self.balancer.remove_worker(w.rank)
        self.ledger.take_back(w.rank, lost=True)
        self._log_shards()
        if all(o.lost for o in self.peers.values()):
            raise RuntimeError("every worker was lost")
        for receiver, t in self.ledger.expects_rows_from(w.rank):   # they can no longer arrive
            raise RuntimeError(
                f"rank {w.rank} was lost before sending rows of shard {t.shard} to rank "
                f"{receiver}, which waits for them; this run cannot continue: resume from "
                f"the last checkpoint")
        self._wake_idle()
        if self.rule.round_complete(self.present()):
            self._close_round()
        self._release_held()

    # ----------------------------------------------------------------- checkpoints, signals
    def _checkpoint(self) -> None:
        self.last_checkpoint = time.monotonic()
        if not self.cfg.checkpoint:
            return
        self.log.flush()   # the log holds everything up to the checkpoint: a resume continues it
        checkpoint.save(self.cfg.checkpoint, cfg=self.cfg, model=self.model, dataset=self.dataset,
                        params=self.params, optimizer=self.optimizer, version=self.version,
                        epoch=self.epoch, tracker=self.tracker, balancer=self.balancer,
                        train_s=self.now())

    def _preempt(self) -> None:
        """SIGTERM/SIGUSR1 on some rank: checkpoint, tell every worker to stop, exit 0."""
        self.preempted = True
        print("mpilb: preemption signal: checkpointing and stopping", file=sys.stderr, flush=True)
        if not self.stop.reason:
            self._checkpoint()
        self.stop.reason = self.stop.reason or "preempted"
        self._begin_stop()
