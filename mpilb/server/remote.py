"""Rank 0's handle on the other parameter stores (--servers K): its commands to them, in
the order it decides, their slices gathered and loaded, their counters and their liveness.
The stores' side is store.py (SliceRank); the protocol is described there.

    RemoteSlices(comm, bounds, stores)   # on rank 0 (in its SliceGroup, group.py)
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from mpilb.errors import MpilbError
from mpilb.mpi import comm as C
from mpilb.mpi import wire
from mpilb.mpi.wire import Op
from mpilb.server.store import END_TIMEOUT_S, send_state

PING_S = 0.25        # how often rank 0 asks every store for its counters (its liveness)
DOUBT_S = 0.75       # a store this late with an answer may hold up the workers' replies
GIVE_UP_S = 3.0      # how long a stop (SIGTERM) still waits for a store that keeps silent


class StoreLost(MpilbError):
    """A parameter store did not answer for --worker-timeout s: its slice is lost, and the
    run cannot go on (exit 1; a stop asked for meanwhile ends it as preempted)."""

    def __init__(self, rank: int, what: str, timeout: float):
        super().__init__(f"rank {rank} (a parameter store) did not answer {what} for "
                         f"{timeout:g} s: stalled, or its node unreachable; its slice of the "
                         f"parameters is lost and the run ends (--resume continues from the "
                         f"last checkpoint)")
        self.rank = rank


class RemoteSlices:
    """Rank 0's handle on the other stores: commands in the order rank 0 decides (with K = 1
    there are none, and every command is a no-op). Everything here is keyed by store rank.

    Args:
        comm: the world communicator.
        bounds: slice bounds (store_bounds).
        stores: the store ranks, in slice order (stores_of; default ranks 0..K-1).
    """

    def __init__(self, comm, bounds: list[int], timeout: float = 60.0, give_up=None,
                 stores: Optional[list] = None):
        self.comm = comm
        stores = list(stores) if stores is not None else list(range(len(bounds) - 1))
        self.ranks = stores[1:]
        # the slice [lo, hi) of each store rank
        self.slices = {r: (bounds[s], bounds[s + 1]) for s, r in enumerate(stores)}
        self.ctrl = np.zeros(wire.CTRL_FIELDS, np.float64)
        self.owed: set[int] = set()   # workers whose last push has no command yet
        self.stats = {s: np.zeros(wire.STATS_FIELDS, np.float64) for s in self.ranks}
        self.stats_reqs: dict = {}
        self.last: dict = {s: np.zeros(wire.STATS_FIELDS) for s in self.ranks}
        # liveness: no wait on a store without a deadline (--worker-timeout), and none that a
        # stop (SIGTERM) cannot cut short: `give_up()` True ends a wait at once
        self.timeout = timeout
        self.give_up = give_up or (lambda: False)
        self.asked_at = 0.0              # when the counters now awaited were asked for
        self.unlogged: dict = {}         # increments received between two log rows

    def _wait(self, req, store: int, what: str) -> None:
        """Wait for `req` from `store` up to the deadline; StoreLost after it (or at once
        when `give_up()` says a stop is asked for while the store keeps silent)."""
        start = time.monotonic()
        while not C.wait(req, timeout=0.25):
            now = time.monotonic()
            if now > start + self.timeout or (self.give_up() and now > start + GIVE_UP_S):
                req.Cancel()
                raise StoreLost(store, what, self.timeout)

    def watch(self, mono: float) -> None:
        """Liveness, every few tens of ms: StoreLost for a store whose counters, asked for
        --worker-timeout s ago, have not come; else ask again every PING_S."""
        if not self.ranks:
            return
        for s, inc in self._poll().items():
            self.unlogged[s] = self.unlogged.get(s, 0) + inc
        if self.stats_reqs and mono - self.asked_at > self.timeout:
            raise StoreLost(min(self.stats_reqs), "for its counters", self.timeout)
        if not self.stats_reqs and mono - self.asked_at >= PING_S:
            self.request_stats()

    def doubtful(self, mono: float) -> bool:
        """A store is late with its counters: workers silent now may be waiting on it (it
        is judged first, see watch)."""
        return bool(self.stats_reqs) and mono - self.asked_at > DOUBT_S

    def _command(self, op: Op, rank: int = -1, batch: int = 0, staleness: int = 0,
                 version: int = 0, lr: float = 1.0, predicted: tuple = (0.0, -1)) -> None:
        if not self.ranks:   # --servers 1
            return
        wire.encode_ctrl(self.ctrl, op, rank, batch, staleness, version, lr, predicted)
        for s in self.ranks:   # 64 bytes: sent eagerly, Send returns at once
            self.comm.Send(self.ctrl, dest=s, tag=wire.TAG_CTRL)

    # ----------------------------------------------------------------- per push
    def pushed(self, rank: int) -> None:
        """Rank 0 received w's header: its slices are on their way to every store."""
        self.owed.add(rank)

    def gradient(self, rank: int, batch: int, staleness: int, version: int, rounds: bool,
                 lr: float = 1.0, stream: bool = False, predicted: tuple = (0.0, -1)) -> None:
        """Apply w's gradient (or add it to the sync round), as rank 0 does now; `lr` is rank
        0's schedule factor for this update. `stream`: each store sends w its new slice as
        it applies it (Op.STREAM), chunk by chunk where it exchanges chunks with w; w's reply
        then commands no REPLY. `predicted`: the push's weight prediction (wire.Push.PRED_F)."""
        self.owed.discard(rank)
        op = Op.ADD if rounds else Op.STREAM if stream else Op.APPLY
        self._command(op, rank, batch, staleness, version, lr, predicted)

    def settle(self, rank: int) -> None:
        """After a push was handled: a gradient rank 0 did not take is dropped everywhere."""
        if rank in self.owed:
            self.owed.discard(rank)
            self._command(Op.DISCARD, rank)

    def round(self, batch: int, lr: float = 1.0) -> None:
        self._command(Op.ROUND, batch=batch, lr=lr)

    def reply(self, rank: int) -> None:
        self._command(Op.REPLY, rank)

    def answering(self) -> None:
        """Every store has carried out rank 0's commands so far and answered: its counters,
        asked for now, have come (StoreLost after --worker-timeout otherwise). Called before
        a collective call that would wait for a store without a bound (the stores' accept
        of a joiner), so that a store stalled or cut off fails here, named, and not there."""
        for _ in range(2):   # the answers to a request out already, then to a fresh one
            self.request_stats()
            for s, req in sorted(self.stats_reqs.items()):
                self._wait(req, s, "before the accept of a joiner")
            for s, inc in self._poll().items():
                self.unlogged[s] = self.unlogged.get(s, 0) + inc

    def accepting(self, rank: int, timeout: int) -> None:
        """Every store takes part in rank 0's accept of joiner `rank` (store_joins.py)."""
        self._command(Op.ACCEPT, rank, batch=timeout)

    def lose(self, rank: int) -> None:
        self.owed.discard(rank)
        self._command(Op.LOSE, rank)

    # ----------------------------------------------------------------- whole vector
    def load(self, params: np.ndarray, optimizer, version: int) -> None:
        """Every store takes its slice of `params` and of the optimizer state (start, resume)."""
        for s in self.ranks:
            wire.encode_ctrl(self.ctrl, Op.LOAD, batch=optimizer.steps, version=version)
            self.comm.Send(self.ctrl, dest=s, tag=wire.TAG_CTRL)
            send_state(self.comm, s, wire.TAG_GATHER, params, optimizer, *self.slices[s])

    def gather(self, params: np.ndarray, optimizer=None) -> None:
        """Fill `params` (and the optimizer state, if given) with every store's slice
        (slice 0 is rank 0's own: the caller fills it)."""
        self._command(Op.GATHER, batch=1 if optimizer is not None else 0)
        for s in self.ranks:
            lo, hi = self.slices[s]
            buf = np.empty(hi - lo, np.float32)
            self._wait(self.comm.Irecv(buf, source=s, tag=wire.TAG_GATHER), s, "with its slice")
            params[lo:hi] = buf
            if optimizer is not None:
                for name in optimizer._buffers:
                    self._wait(self.comm.Irecv(buf, source=s, tag=wire.TAG_GATHER), s,
                               "with its optimizer state")
                    optimizer.load_state_slice(name, lo, hi, buf)
                steps = np.zeros(1, np.float64)   # the same count as rank 0's
                self._wait(self.comm.Irecv(steps, source=s, tag=wire.TAG_GATHER), s,
                           "with its optimizer state")

    # ----------------------------------------------------------------- counters
    def request_stats(self) -> None:
        """Ask every store for its counters (they come back with poll_stats), unless they
        are still owed from an earlier request."""
        if self.stats_reqs:
            return
        self._command(Op.STATS)
        self.asked_at = time.monotonic()
        for s in self.ranks:
            self.stats_reqs[s] = self.comm.Irecv(self.stats[s], source=s, tag=wire.TAG_STATS)

    def _poll(self) -> dict:
        out = {}
        for s, req in list(self.stats_reqs.items()):
            if req.Test():
                del self.stats_reqs[s]
                out[s] = self.stats[s] - self.last[s]
                self.last[s] = self.stats[s].copy()
        return out

    def poll_stats(self) -> dict:
        """{store: counter increments since its last logged report} of the reports arrived."""
        for s, inc in self._poll().items():
            self.unlogged[s] = self.unlogged.get(s, 0) + inc
        out, self.unlogged = self.unlogged, {}
        return out

    def end(self) -> dict:
        """Tell every store the run is over; returns their last counter increments."""
        pending = dict(self.stats_reqs)
        self._command(Op.END)
        out = {}
        for s in self.ranks:
            if s in pending:   # a STATS report still to come, then END's
                C.wait(pending[s], timeout=END_TIMEOUT_S)
                out[s] = self.stats[s] - self.last[s]
                self.last[s] = self.stats[s].copy()
            req = self.comm.Irecv(self.stats[s], source=s, tag=wire.TAG_STATS)
            if C.wait(req, timeout=END_TIMEOUT_S):
                inc = self.stats[s] - self.last[s]
                out[s] = out[s] + inc if s in out else inc
                self.last[s] = self.stats[s].copy()
        self.stats_reqs.clear()
        return out
