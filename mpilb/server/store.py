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
in the same order as rank 0 (streamed async pushes several at once, each chunk in that order:
store_streams.py): with sync rounds the sliced parameters are the same floats as one store's.
A command is 64 bytes; the slices carry the bytes, so rank 0 moves 1/K of them.

    SliceRank(cfg, dataset, comm, rank).run()    # a store rank other than 0, until Op.END
    RemoteSlices(comm, bounds, stores)             # on rank 0 (remote.py, in its SliceGroup)
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

import numpy as np

from mpilb.mpi import comm as C
from mpilb.mpi import chunks, wire, wire_format
from mpilb.core.corrections import build_correction
from mpilb.core.schedules import parse_warmup
from mpilb.core.topology import stores_of, workers_of
from mpilb.mpi.watchdog import Rank0Watch
from mpilb.mpi.wire import Op
from mpilb.server.modes import ParamRing
from mpilb.server.store_joins import StoreJoins
from mpilb.server import store_streams

END_TIMEOUT_S = 30.0


def store_bounds(cfg, model) -> list[int]:
    """Slice bounds of the --servers stores for `model` (the same on every rank): store s
    (rank stores_of(cfg)[s]) holds [bounds[s], bounds[s+1])."""
    return wire.cut_slices(model.num_params, len(stores_of(cfg)), wire.layer_sizes(model))


def slice_ring(cfg, params: np.ndarray, optimizer, new_buffer=None) -> ParamRing:
    """A ParamRing over `params` with the run's correction (and dc's kept versions);
    `new_buffer`: see ParamRing."""
    correction = build_correction(cfg.updates.correction, cfg.updates.dc_lambda,
                                  own_warmup=any(parse_warmup(cfg.optim.warmup)))
    keep = ((2 if cfg.updates.pipeline else 1) + correction.reads_kept - 1
            if correction.needs_old_params else 0)
    clip = cfg.optim.clip_norm if cfg.updates.mode == "sync" and cfg.updates.servers == 1 else None   # (workers
    # clip what is applied on arrival; sync with K > 1 is refused: config/validate.check_optimizer)
    return ParamRing(params, optimizer, correction, cfg.balancing.batch, keep_sent=keep,
                      new_buffer=new_buffer, finished=C.finished, clip_norm=clip)


def send_state(comm, dest: int, tag: int, params, optimizer, lo: int, hi: int) -> None:
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


def stream_calls(spans, grad, wire_grad, fmt, encoded, ring, arrived, send, stopped):
    """The ``arrive`` and ``answer`` of :meth:`ParamRing.apply_chunks` for a slice streamed
    (Op.STREAM) by rank 0 (``SliceGroup.stream``) or another store (``SliceRank._stream``):
    ``arrived(i)`` waits for chunk i of the push, which lands in ``wire_grad`` and is
    decoded into ``grad`` (nothing to decode where they are one array; False: it did not
    come, and counts as zeros); ``send(array)`` sends a chunk of the new slice (in the wire
    format, from ``encoded``'s copy) and returns its request, unless ``stopped()`` (the
    worker is gone)."""

    def arrive(i: int) -> None:
        lo, hi = spans[i]
        if not arrived(i):
            grad[lo:hi] = 0
        elif grad is not wire_grad:
            fmt.decode(wire_grad[lo:hi], grad[lo:hi])

    def answer(i: int, new: np.ndarray) -> list:
        if stopped():
            return []
        lo, hi = spans[i]
        if encoded is None:
            return [send(new[lo:hi])]
        if i == 0:
            encoded.begin(ring.version + 1)
        encoded.sending(send(encoded.encode_range(new, lo, hi)))
        return []

    return arrive, answer


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
        self.recvs: dict = {}   # worker -> the receives of its next push (one per chunk)
        # --chunk-kb: a worker on another node sends its slice, and takes its reply, in chunks
        self.plans = {w: chunks.plan(cfg, w, rank, self.n, self.fmt.itemsize) for w in self.workers}
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
        # async pushes streamed several at once, each chunk stepped as it comes (store_streams.py)
        self.streams = (store_streams.ChunkStreams(self) if store_streams.eligible(self.ring)
                        else None)

    def abandon(self) -> None:
        """Set-up failed elsewhere: nothing to close here."""

    # ----------------------------------------------------------------- messages
    def _spans(self, w: int) -> chunks.Spans:
        return self.plans.get(w) or chunks.whole(self.n)

    def _post(self, w: int) -> None:
        comm, source = self.joins.link(w)
        buf = self.grads[w]
        self.recvs[w] = [comm.Irecv(buf[lo:hi], source=source, tag=wire.TAG_GRAD)
                         for lo, hi in self._spans(w)]

    def _arrived(self, w: int, i: int) -> bool:
        """Wait for chunk i of w's gradient slice (it is on its way: rank 0 has its header);
        False if rank 0 declared w lost meanwhile (a LOSE further down the queue)."""
        self.backoff.reset()
        req = self.recvs[w][i]
        while not req.Test():
            self._poll_ctrl()
            if any(m.op == Op.LOSE and m.rank == w for m in self.queue):
                return False
            self.backoff.sleep()
        return True

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
        while not self.queue:   # (stepping what has come of the pushes started meanwhile)
            moved = self.streams is not None and self.streams.progress()
            if self._poll_ctrl() or moved:
                self.backoff.reset()
            else:
                self.backoff.sleep()
        return self.queue.popleft()

    def _take(self, w: int) -> Optional[np.ndarray]:
        """Worker w's gradient slice (it is on its way: rank 0 has its header), or None if
        rank 0 declared w lost meanwhile (a LOSE further down the queue)."""
        for i in range(len(self.recvs[w])):
            if not self._arrived(w, i):
                return None
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
        if self.streams is not None and m.op == Op.STREAM:
            if m.rank not in self.lost:
                self.streams.start(m)
            return
        if self.streams is not None and m.op != Op.STATS:   # the pushes started are done first
            self.streams.finish(lose=m.rank if m.op == Op.LOSE else -1)
        if m.op == Op.STREAM:
            if m.rank not in self.lost:
                self._stream(m)
                self._post(m.rank)
        elif m.op in (Op.APPLY, Op.ADD, Op.DISCARD):
            if m.rank in self.lost:
                return
            grad = self._take(m.rank)
            if grad is None:
                return
            if m.op == Op.APPLY:
                s.follow(m.lr)
                then = s.params_then(m.version, m.predicted)
                s.apply(grad, m.batch, m.staleness, then, consume=True, worker=m.rank)
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
            for lo, hi in self._spans(m.rank):
                req = comm.Isend(params[lo:hi], dest=dest, tag=wire.TAG_PARAMS)
                if self.encoded is None:
                    s.sending(req)
                else:
                    self.encoded.sending(req)
            s.sent_version(m.rank)
            s.bytes_out += params.nbytes
        elif m.op == Op.LOSE:
            self.lost.add(m.rank)
            s.forget(m.rank)
            for req in self.recvs.pop(m.rank, ()):
                if not req.Test():
                    req.Cancel()
                    C.wait(req, timeout=1.0)
        elif m.op == Op.GATHER:
            send_state(self.comm, 0, wire.TAG_GATHER, s.params, s.optimizer, 0, self.n)
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
            self.plans.pop(m.rank, None)   # (whole messages: it is outside the job's layout)
            self.grads[m.rank] = np.empty(self.n, self.fmt.wire_dtype)
            self._post(m.rank)

    def _stream(self, m: wire.CtrlMsg) -> None:
        """Op.STREAM: apply w's gradient slice chunk by chunk as it arrives, sending w each
        chunk of the new slice once stepped (a worker lost meanwhile: the chunks that did
        not come count as zero, and nothing more is sent to it)."""
        s, w = self.ring, m.rank
        wire_grad = self.grads[w]
        grad = wire_grad if self.grad is None else self.grad
        spans = self._spans(w)
        comm, dest = self.joins.link(w)
        gone = [False]

        def arrived(i: int) -> bool:
            if not gone[0] and not self._arrived(w, i):
                gone[0] = True
            return not gone[0]

        def send(chunk: np.ndarray):
            return comm.Isend(chunk, dest=dest, tag=wire.TAG_PARAMS)

        arrive, answer = stream_calls(spans, grad, wire_grad, self.fmt, self.encoded, s, arrived,
                                      send, lambda: gone[0])
        s.follow(m.lr)
        then = s.params_then(m.version, m.predicted)
        s.apply_chunks(grad, m.batch, m.staleness, spans, arrive, answer, then, consume=True,
                       worker=m.rank)
        given = s.exchange()
        if given is not None:   # the gradient's buffer holds the parameters now
            if self.grad is None:
                self.grads[w] = given
            else:
                self.grad = given
        if gone[0]:
            return
        s.bytes_in += wire_grad.nbytes
        s.sent_version(w)
        s.bytes_out += wire_grad.nbytes

    def run(self) -> None:
        """Serve rank 0's commands until END."""
        for w in self.workers:
            self._post(w)
        self.ctrl_req = self.comm.Irecv(self.ctrl, source=0, tag=wire.TAG_CTRL)
        try:
            while True:
                m = self._next()
                if m.op == Op.END:
                    if self.streams is not None:
                        self.streams.finish()
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
        for req in [r for reqs in self.recvs.values() for r in reqs] + [self.ctrl_req]:
            if req is not None and not req.Test():
                req.Cancel()
                C.wait(req, timeout=1.0)
        copies = [] if self.encoded is None else self.encoded.pending()
        if self.streams is not None:
            copies += self.streams.pending()
        for req in self.ring.pending() + copies + [self.stats_req]:
            if req is not None:
                C.wait(req, timeout=max(0.0, deadline - time.monotonic()))
