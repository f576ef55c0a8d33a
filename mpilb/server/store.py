"""Parameter stores beyond rank 0 (--servers K): the other store ranks, and rank 0's handle on them.

The K store ranks (topology.store_ranks: one per node where there are K nodes, ranks
0..K-1 on one node; store 0 is rank 0) each hold a contiguous slice [bounds[s], bounds[s+1]) of the flat parameter
vector (wire.cut_slices: balanced by floats, cut at layer boundaries when that costs under
5 %), with the optimizer state and the staleness correction of that slice. A worker sends
each store its slice of every gradient (TAG_GRAD) and the header to rank 0 alone; it pulls
each slice of the reply from its store (TAG_PARAMS).

Rank 0 alone decides (coverage, strays, rejected gradients, the update rule's holds and sync
rounds, lost workers). It tells the other stores what to do with each push in the order it
decided (TAG_CTRL, wire.Op): apply it, add it to the round, drop it, close the round, send
a worker its slice, forget a lost worker. Every store therefore applies the same gradients
in the same order as rank 0: with sync rounds the sliced parameters are the same floats as
one store's. A command is 64 bytes; the slices carry the bytes, so rank 0 moves 1/K of them.

    SliceRank(cfg, dataset, comm, rank).run()    # a store rank other than 0, until Op.END
    RemoteSlices(comm, bounds, stores)             # on rank 0 (in its SliceGroup, group.py)
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

import numpy as np

from mpilb.mpi import comm as C
from mpilb.mpi import wire, wire_format
from mpilb.core.corrections import build_correction
from mpilb.errors import MpilbError
from mpilb.core.topology import stores_of, workers_of
from mpilb.mpi.watchdog import Rank0Watch
from mpilb.mpi.wire import Op
from mpilb.server.modes import ParamRing
from mpilb.server.store_joins import StoreJoins

END_TIMEOUT_S = 30.0
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


def store_bounds(cfg, model) -> list[int]:
    """Slice bounds of the --servers stores for `model` (the same on every rank): store s
    (rank stores_of(cfg)[s]) holds [bounds[s], bounds[s+1])."""
    return wire.cut_slices(model.num_params, len(stores_of(cfg)), wire.layer_sizes(model))


def slice_ring(cfg, params: np.ndarray, optimizer, new_buffer=None) -> ParamRing:
    """A ParamRing over `params` with the run's correction (and dc's kept versions);
    `new_buffer`: see ParamRing."""
    correction = build_correction(cfg.updates.correction, cfg.updates.dc_lambda)
    keep = (2 if cfg.updates.pipeline else 1) if correction.needs_old_params else 0
    clip = cfg.optim.clip_norm if cfg.updates.mode == "sync" and cfg.updates.servers == 1 else None   # (workers
    # clip what is applied on arrival; sync with K > 1 is refused: config/validate.check_optimizer)
    return ParamRing(params, optimizer, correction, cfg.balancing.batch, keep_sent=keep,
                      new_buffer=new_buffer, finished=C.finished, clip_norm=clip)


def _send_state(comm, dest: int, tag: int, params, optimizer, lo: int, hi: int) -> None:
    comm.Send(np.ascontiguousarray(params[lo:hi]), dest=dest, tag=tag)
    for name in optimizer._buffers:   # as checkpointed: the stores' kernels may differ
        comm.Send(optimizer.state_slice(name, lo, hi), dest=dest, tag=tag)


def _recv_state(comm, source: int, tag: int, params, optimizer, lo: int, hi: int) -> None:
    buf = np.empty(hi - lo, np.float32)
    C.wait(comm.Irecv(buf, source=source, tag=tag))
    params[lo:hi] = buf
    for name in optimizer._buffers:
        C.wait(comm.Irecv(buf, source=source, tag=tag))
        optimizer.load_state_slice(name, lo, hi, buf)


class SliceRank:
    """A store rank other than 0 (store s of stores_of(cfg)): its slice, applied and sent as
    rank 0's commands say."""

    def __init__(self, cfg, dataset, comm, rank: int):
        from mpilb.run.components import config_model, config_optimizer

        self.comm = comm
        self.rank = rank
        model = config_model(cfg, dataset)
        self.bounds = store_bounds(cfg, model)
        s = stores_of(cfg).index(rank)
        self.n = self.bounds[s + 1] - self.bounds[s]
        self.ring = slice_ring(cfg, np.zeros(self.n, np.float32), config_optimizer(cfg.optim, self.n))
        self.workers = workers_of(cfg, comm.Get_size())
        self.joins = StoreJoins(comm, stores_of(cfg))   # workers that joined (store_joins.py)
        # --wire: slices arrive in that format and are expanded into `grad` (float32);
        # replies go from `encoded`, the slice converted once per version
        self.fmt = wire_format.wire_format(cfg.updates.wire)
        self.grads = {w: np.empty(self.n, self.fmt.wire_dtype) for w in self.workers}
        self.grad = None if self.fmt.is_fp32 else np.empty(self.n, np.float32)
        self.encoded = (None if self.fmt.is_fp32
                        else wire_format.EncodedParams(self.fmt, self.n, C.finished))
        self.recvs: dict = {}
        self.round = np.zeros(self.n, np.float32)
        self.ctrl = np.zeros(wire.CTRL_FIELDS, np.float64)
        self.ctrl_req = None
        self.queue: deque = deque()
        self.lost: set[int] = set()
        self.stats = np.zeros(wire.STATS_FIELDS, np.float64)
        self.stats_req = None
        self.backoff = C.Backoff()
        self.rank0 = Rank0Watch(cfg.faults.worker_timeout, rank)
        self.cpu0 = time.process_time()

    def abandon(self) -> None:
        """Set-up failed elsewhere: nothing to close here."""

    # ----------------------------------------------------------------- messages
    def _post(self, w: int) -> None:
        comm, source = self.joins.link(w)
        self.recvs[w] = comm.Irecv(self.grads[w], source=source, tag=wire.TAG_GRAD)

    def _poll_ctrl(self) -> bool:
        got = False
        while self.ctrl_req.Test():
            self.queue.append(wire.decode_ctrl(self.ctrl))
            self.ctrl_req = self.comm.Irecv(self.ctrl, source=0, tag=wire.TAG_CTRL)
            got = True
        if got:
            self.rank0.heard()
        else:
            self.rank0.check()   # rank 0 asks for counters every PING_S: silence means gone
        return got

    def _next(self) -> wire.CtrlMsg:
        self.backoff.reset()
        while not self.queue:
            if not self._poll_ctrl():
                self.backoff.sleep()
        return self.queue.popleft()

    def _take(self, w: int) -> Optional[np.ndarray]:
        """Worker w's gradient slice (it is on its way: rank 0 has its header), or None if
        rank 0 declared w lost meanwhile (a LOSE further down the queue)."""
        self.backoff.reset()
        req = self.recvs[w]
        while not req.Test():
            self._poll_ctrl()
            if any(m.op == Op.LOSE and m.rank == w for m in self.queue):
                return None
            self.backoff.sleep()
        self.ring.bytes_in += self.grads[w].nbytes
        if self.grad is None:
            return self.grads[w]
        self.fmt.decode(self.grads[w], self.grad)
        return self.grad

    def _send_stats(self) -> None:
        if self.stats_req is not None:
            C.wait(self.stats_req, timeout=END_TIMEOUT_S)
        s = self.ring
        self.stats[:] = (s.updates, s.bytes_in, s.bytes_out, s.apply_s,
                         time.process_time() - self.cpu0, s.version)
        self.stats_req = self.comm.Isend(self.stats, dest=0, tag=wire.TAG_STATS)

    # ----------------------------------------------------------------- commands
    def _do(self, m: wire.CtrlMsg) -> None:
        s = self.ring
        if m.op in (Op.APPLY, Op.ADD, Op.DISCARD):
            if m.rank in self.lost:
                return
            grad = self._take(m.rank)
            if grad is None:
                return
            if m.op == Op.APPLY:
                s.follow(m.lr)
                then = s.params_of(m.version) if s.correction.needs_old_params else None
                s.apply(grad, m.batch, m.staleness, then, consume=True)
                given = s.exchange()
                if given is not None:   # the gradient's buffer holds the parameters now
                    if self.grad is None:
                        self.grads[m.rank] = given
                    else:
                        self.grad = given
            elif m.op == Op.ADD:   # the same arithmetic as the sync rule on rank 0
                np.multiply(grad, m.batch, out=grad)
                self.round += grad
            self._post(m.rank)
        elif m.op == Op.ROUND:
            s.follow(m.lr)
            s.apply_sum(self.round, m.batch, consume=True)
            given = s.exchange()
            if given is not None:
                self.round = given
            self.round[:] = 0
        elif m.op == Op.REPLY:
            # not waiting for the previous reply to this worker: one that died after its push
            # never receives it (the ring keeps the buffer such a send reads from)
            params = s.params if self.encoded is None else self.encoded.of(s.params, s.version)
            comm, dest = self.joins.link(m.rank)
            req = comm.Isend(params, dest=dest, tag=wire.TAG_PARAMS)
            if self.encoded is None:
                s.sending(req, m.rank)
            else:
                self.encoded.sending(req)
                s.sent_version(m.rank)
            s.bytes_out += params.nbytes
        elif m.op == Op.LOSE:
            self.lost.add(m.rank)
            req = self.recvs.pop(m.rank, None)
            if req is not None and not req.Test():
                req.Cancel()
                C.wait(req, timeout=1.0)
        elif m.op == Op.GATHER:
            _send_state(self.comm, 0, wire.TAG_GATHER, s.params, s.optimizer, 0, self.n)
            if m.batch:
                self.comm.Send(np.array([s.optimizer.steps], np.float64), dest=0, tag=wire.TAG_GATHER)
        elif m.op == Op.LOAD:
            _recv_state(self.comm, 0, wire.TAG_GATHER, s.params, s.optimizer, 0, self.n)
            s.version = m.version
            s.optimizer.steps = m.batch
            if self.encoded is not None:
                self.encoded.forget()
        elif m.op == Op.STATS:
            self._send_stats()
        elif m.op == Op.ACCEPT and self.joins.accept(m.rank, m.batch):   # a joiner
            self.grads[m.rank] = np.empty(self.n, self.fmt.wire_dtype)
            self._post(m.rank)

    def run(self) -> None:
        """Serve rank 0's commands until END."""
        for w in self.workers:
            self._post(w)
        self.ctrl_req = self.comm.Irecv(self.ctrl, source=0, tag=wire.TAG_CTRL)
        try:
            while True:
                m = self._next()
                if m.op == Op.END:
                    self._send_stats()
                    return
                self._do(m)
        finally:
            self._close()

    def disconnect_joined(self) -> None:
        """After the job's end barrier: the joiners' communicators (store_joins.py)."""
        self.joins.disconnect(self.lost)

    def _close(self) -> None:
        deadline = time.monotonic() + 5.0   # a lost worker's never complete
        for req in list(self.recvs.values()) + [self.ctrl_req]:
            if req is not None and not req.Test():
                req.Cancel()
                C.wait(req, timeout=1.0)
        copies = [] if self.encoded is None else self.encoded.pending()
        for req in self.ring.pending() + copies + [self.stats_req]:
            if req is not None:
                C.wait(req, timeout=max(0.0, deadline - time.monotonic()))


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
                 version: int = 0, lr: float = 1.0) -> None:
        if not self.ranks:   # --servers 1
            return
        wire.encode_ctrl(self.ctrl, op, rank, batch, staleness, version, lr)
        for s in self.ranks:   # 64 bytes: sent eagerly, Send returns at once
            self.comm.Send(self.ctrl, dest=s, tag=wire.TAG_CTRL)

    # ----------------------------------------------------------------- per push
    def pushed(self, rank: int) -> None:
        """Rank 0 received w's header: its slices are on their way to every store."""
        self.owed.add(rank)

    def gradient(self, rank: int, batch: int, staleness: int, version: int, rounds: bool,
                 lr: float = 1.0) -> None:
        """Apply w's gradient (or add it to the sync round), as rank 0 does now; `lr` is rank
        0's schedule factor for this update."""
        self.owed.discard(rank)
        self._command(Op.ADD if rounds else Op.APPLY, rank, batch, staleness, version, lr)

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
            _send_state(self.comm, s, wire.TAG_GATHER, params, optimizer, *self.slices[s])

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
