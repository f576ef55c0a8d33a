"""Which workers are still there (rank 0): silence, losses, stalls, keep-alives.

A worker silent past --worker-timeout (not counting the time rank 0 itself did not watch)
is declared lost: its tasks go to the others, rows it owed come from another copy, and the
run goes on without it. Every worker hears from rank 0 at least every KEEP_ALIVE_S.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from mpilb.mpi.watchdog import KEEP_ALIVE_S


class WorkerFailed(Exception):
    def __init__(self, rank: int, text: str, code: int = 1):
        super().__init__(f"rank {rank}: {text}")
        self.rank = rank
        self.text = text
        self.code = code   # 2: the user's input (e.g. a model that breaks the protocol)


class Liveness:
    """Rank 0's watch over its workers.

    Args:
        cfg: --worker-timeout, --balancer (for the stall's message).
        roster: the workers (:class:`~mpilb.server.peers.Roster`).
        ledger: the task ledger (a lost worker's tasks, rows it owed).
        balancer: drops a lost worker.
        remote: the other parameter stores (judged first; they stop listening to the lost).
        bell: the doorbell (a lost worker's ring will not come).
        outbox: orders and keep-alives.
        tracker: the epoch's coverage (for the stall check).
        stop: the stop rule (no stall once stopping).
        signals: the stop signals' vote (:class:`~mpilb.server.stopsignals.StopSignals`).
        log_shards: logs the ledger's shard events.
        after_loss: the protocol's part after a loss (wake idle workers, a round, held replies).
        members: the membership log (:class:`~mpilb.server.roster.Members`; a `lost` row).
    """

    UNWATCHED_S = 0.25  # a longer gap between chores: rank 0 was busy or stopped, not watching
    LIVENESS_S = 0.05   # how often lost workers and stalls are looked for

    def __init__(self, cfg, roster, ledger, balancer, remote, bell, outbox, tracker, stop,
                 signals, log_shards: Callable[[], None], after_loss: Callable[[], None],
                 members=None, ring=None):
        self.cfg = cfg
        self.roster = roster
        self.ledger = ledger
        self.balancer = balancer
        self.remote = remote
        self.ring = ring   # rank 0's slice (ParamRing)
        self.bell = bell
        self.outbox = outbox
        self.tracker = tracker
        self.stop = stop
        self.signals = signals
        self.log_shards = log_shards
        self.after_loss = after_loss
        self.members = members
        self.next_check = 0.0
        self.last_watch = None
        self.unwatched: list[tuple[float, float]] = []   # (start, end) rank 0 did not watch

    def check(self, mono: float) -> None:
        """Silence is judged in seconds: 20 times a second at most."""
        if mono < self.next_check:
            return
        self.next_check = mono + self.LIVENESS_S
        self.remote.watch(mono)   # a silent store ends the run before its workers are judged
        self.check_lost()
        self.check_stalled()
        self.keep_alive(mono)

    def keep_alive(self, mono: float) -> None:
        """Every worker hears from rank 0 at least every KEEP_ALIVE_S, also while it is idle,
        held (ssp, sync) or blocked for rows: its watchdog tells a silent rank 0 from a
        gone one by that (watchdog.py)."""
        for w in self.roster.present():
            if mono - w.told_at > KEEP_ALIVE_S:
                self.outbox.keep_alive(w)

    def note_unwatched(self) -> None:
        """Remember when rank 0 did not watch (a long checkpoint or evaluation, SIGSTOP):
        that time does not count as the workers' silence (their pushes wait unread)."""
        mono = time.monotonic()
        last = self.last_watch
        gaps = self.unwatched
        if last is not None and mono - last > self.UNWATCHED_S:
            gaps.append((last, mono))
        horizon = mono - 2 * self.cfg.faults.worker_timeout
        while gaps and gaps[0][1] < horizon:
            gaps.pop(0)
        self.last_watch = mono

    def silence(self, w, mono: float) -> float:
        """Seconds rank 0 watched for w's next message in vain since it last heard of it."""
        watched = mono - w.last_seen
        for start, end in self.unwatched:
            watched -= max(0.0, min(end, mono) - max(start, w.last_seen))
        return watched

    def check_lost(self) -> None:
        """Declare lost every worker silent past --worker-timeout. A worker blocked waiting
        for rows that another silent worker owes it is silent through no fault of its own:
        the one that owes the rows goes first, its rows are re-sourced (which restarts the
        receiver's clock, see declare_lost), and the receiver is judged again."""
        while True:
            silent = self.silent()
            if not silent:
                return
            ranks = {w.rank for w in silent}
            first = next((w for w in silent if self.ledger.awaits_rows(w.rank) not in ranks), silent[0])
            self.declare_lost(first)

    def silent(self) -> list:
        mono = time.monotonic()
        out = []
        if self.remote.doubtful(mono):
            return out   # workers may be waiting on a store's reply: the store is judged first
        for w in self.roster.present():
            if w.idle or w.held:
                continue
            if self.silence(w, mono) > self.cfg.faults.worker_timeout:
                req = w.link.recv_req
                if req is not None and req.Get_status():
                    continue   # its push has arrived and waits to be read: not silent
                out.append(w)
        return out

    def check_stalled(self) -> None:
        """Every worker idle with the epoch unfinished would wait forever: a bug, say so."""
        if self.stop.reason or self.tracker.complete:
            return
        present = self.roster.present()
        if present and all(w.idle for w in present) and not any(self.balancer.queued(w.rank) for w in present):
            missing = self.tracker.total - self.tracker.distinct
            raise RuntimeError(f"epoch {self.ledger.epoch + 1}: every worker is idle but {missing} samples "
                               f"were never handed out (balancer {self.cfg.balancing.balancer})")

    def declare_lost(self, w, why: str = "") -> None:
        why = why or f"silent for {self.cfg.faults.worker_timeout:g} s"
        # a launcher's SIGTERM after a death: the job ends, and not as preempted
        fails, note = self.signals.on_loss(w.rank, why)
        print(f"mpilb: rank {w.rank} {why}: declared lost"
              + ("" if fails else "; its shards go to the other workers"),
              file=sys.stderr, flush=True)
        if note:
            print(f"mpilb: {note}", file=sys.stderr, flush=True)
        w.lose()
        self.roster.lost.append(w.rank)
        if self.members is not None:
            self.members.lost(w.rank)   # (--respawn: its replacement, roster.py)
        self.forget(w)
        if fails:   # the job ends: log `failed`
            raise WorkerFailed(w.rank, fails)
        if all(o.lost or o.left for o in self.roster.peers.values()):
            raise RuntimeError("every worker was lost")
        self.resource(w)
        self.after_loss()

    def hand_back(self, w) -> None:
        """`w` left the run (roster.py): as for a loss, but at once and without a failure:
        its work goes to the others, and nothing more is heard from it or sent to it."""
        self.forget(w)
        self.resource(w)
        self.after_loss()

    def forget(self, w) -> None:
        """No more from `w`: its rings, its stores' receives, its place in the balancer;
        its unfinished tasks go back to the ledger."""
        self.bell.forget(w.rank)   # a push it rang will not come
        self.remote.lose(w.rank)   # every store stops listening to it (and forgets its momentum)
        if self.ring is not None:
            self.ring.forget(w.rank)
        self.balancer.remove_worker(w.rank)
        self.ledger.take_back(w.rank, lost=True)
        self.log_shards()

    def resource(self, w) -> None:
        """Rows `w` owed others come from another copy (--store local)."""
        if self.ledger.holders is not None:
            peers = self.roster.peers
            # rows it owed come from another copy (--replicas >= 2); else resource() raises
            for receiver, t in self.ledger.resource(w.rank):
                # it waited for rows that could not come: its silence counts from now
                peer = peers[receiver]
                peer.last_seen = max(peer.last_seen, time.monotonic())
                print(f"mpilb: rows of shard {t.shard} that rank {w.rank} owed rank {receiver} "
                      f"come from rank {t.src} instead", file=sys.stderr, flush=True)
            self.log_shards()
            # Now, whatever the holder is doing: it may itself be blocked waiting for rows
            # (from the lost rank, re-sourced to the receiver), and serves orders meanwhile.
            for r in self.ledger.take_ordered():
                if self.ledger.has_orders(r) and peers[r].present and not peers[r].lost:
                    self.outbox.orders(peers[r])
