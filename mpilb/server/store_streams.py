"""A store other than rank 0 answering the pushes rank 0 streams (Op.STREAM) chunk by chunk
as their chunks come, several pushes at once.

One push at a time, a store waited for each chunk of the push rank 0 decided first while the
chunks of the next ones were already in: on the cluster in a box a store per node (`bench
ps --servers per-node`, `-hosts n0:2,n1:2,n2:2`) kept its links at 0.80 of their bound that
way. Here every push commanded is started at once, and each steps (in place, the optimizers
being elementwise) and answers its chunks in order as they come, a chunk once every push
decided before it has stepped those floats (the pushes' chunks may be cut differently: a
worker on the store's node sends its slice whole). Each float thus sees the same steps in
the same order as one push at a time, and each chunk of a reply carries the same floats:
what changes is only that a push whose chunks are in need not wait for the whole of the one
before it. Each push keeps its own settings (its lr, its correction's scale, the momentum its
staleness gave), set before each of its chunks. Replies go from a copy per worker (in the
wire format), since the parameters are stepped in place.

Used for async pushes with an optimizer that steps parts in place and keeps no step count
(sgd, momentum) and no correction that reads old parameters (dc); a command other than
STREAM (a reply of the whole slice, a round, a gather, a loss...) waits until every push
started is done (:meth:`ChunkStreams.finish`). Rank 0's own slice is still stepped one push
at a time, in the order it decides. ``MPILB_STORE_FIFO=1`` makes the other stores do the
same (the comparison `benchmarks/cluster.py` measures).
"""

from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np

from mpilb.core.optimizers import SGD, Momentum
from mpilb.mpi import comm as C
from mpilb.mpi import wire
from mpilb.mpi.wire import Op

FIFO_ENV = "MPILB_STORE_FIFO"
"""Set to 1, a store steps one push at a time in rank 0's order, as rank 0 does."""


def eligible(ring) -> bool:
    """Whether the store's pushes may be stepped several at once (see the module)."""
    return (type(ring.optimizer) in (SGD, Momentum) and not ring.correction.needs_old_params
            and os.environ.get(FIFO_ENV, "") != "1")


class _Push:
    __slots__ = ("w", "spans", "todo", "lr", "staleness", "momentum", "first", "gone", "busy")

    def __init__(self, w: int, spans, lr: float, staleness: int):
        self.w, self.spans, self.lr, self.staleness = w, spans, lr, staleness
        self.todo = list(range(len(spans)))
        self.momentum: Optional[float] = None
        self.first = True
        self.gone = False
        self.busy = 0.0


class ChunkStreams:
    """The pushes a store (store.SliceRank) has started and not finished, by worker."""

    def __init__(self, store):
        self.store = store
        self.active: dict[int, _Push] = {}
        self.grad: Optional[np.ndarray] = None   # a chunk expanded to float32 (wire != fp32)
        self.reply: dict[int, np.ndarray] = {}   # w -> its reply's copy, wire format
        self.sends: dict[int, list] = {}          # w -> the sends of its last reply

    def start(self, m: wire.CtrlMsg) -> None:
        """Op.STREAM for worker m.rank: its chunks are stepped as they come (:meth:`progress`)."""
        st, w = self.store, m.rank
        if w in self.active:   # (never: a worker pushes again once answered)
            self.finish()
        if not self.active:
            st.ring.writable()   # stepped in place from now: no send may read it
        for req in self.sends.pop(w, ()):   # its last reply is in (it pushed again)
            C.wait(req, timeout=1.0)
        lr = m.batch / st.ring.nominal_batch * m.lr
        self.active[w] = _Push(w, st._spans(w), lr, m.staleness)
        self.progress()

    def progress(self) -> bool:
        """Step and answer every chunk that has come; True if any did."""
        moved = False
        before: list = []
        for p in list(self.active.values()):
            if not p.gone and any(q.op == Op.LOSE and q.rank == p.w for q in self.store.queue):
                p.gone = True
            reqs = self.store.recvs[p.w]
            while p.todo:   # its chunks in order: the worker's receives take them in order
                i = p.todo[0]
                hi = p.spans[i][1]   # pushes decided before it must have stepped all below hi
                if any(q.todo and q.spans[q.todo[0]][0] < hi for q in before):   # (their
                    break   # chunks may be cut otherwise: a worker on the store's node sends one)
                if not p.gone:
                    try:
                        if not reqs[i].Test():
                            break
                    except C.MPIError:
                        p.gone = True
                self._step(p, i)
                moved = True
            before.append(p)
            if not p.todo:
                self._done(p)
        return moved

    def finish(self, lose: int = -1) -> None:
        """Every push started is applied (waiting for its chunks); `lose`: a worker rank 0
        declared lost (the command about to run), whose missing chunks count as zero."""
        if lose in self.active:
            self.active[lose].gone = True
        backoff = C.Backoff()
        while self.active:
            if self.progress():
                backoff.reset()
            elif self.active:
                self.store._poll_ctrl()
                backoff.sleep()

    def _step(self, p: _Push, i: int) -> None:
        st = self.store
        ring, opt, fmt = st.ring, st.ring.optimizer, st.fmt
        lo, hi = p.spans[i]
        t0 = time.perf_counter()
        wire_grad = st.grads[p.w]
        if fmt.is_fp32:
            grad = wire_grad
        else:   # (one vector for all: each chunk is expanded and stepped at once)
            if self.grad is None:
                self.grad = np.empty(st.n, np.float32)
            grad = self.grad
        if p.gone:   # (a chunk that did not come counts as zeros, as one push at a time)
            grad[lo:hi] = 0
        elif grad is not wire_grad:
            fmt.decode(wire_grad[lo:hi], grad[lo:hi])
        params = ring.params
        ring.correction.source(opt, p.w)   # (pushes interleave: each chunk its worker's)
        if p.first:
            ring.correction.tune(opt, p.staleness)
            p.momentum = getattr(opt, "momentum", None)
            p.lr *= ring.correction.apply(grad[lo:hi], p.staleness, params[lo:hi], None)
        if p.momentum is not None:
            opt.momentum = p.momentum
        opt.step_range(params, grad, p.lr, params, lo, hi, first=p.first)
        p.first = False
        p.todo.pop(0)
        if not p.gone:
            out = self.reply.get(p.w)
            if out is None:
                out = self.reply[p.w] = np.empty(st.n, fmt.wire_dtype)
            if fmt.is_fp32:
                out[lo:hi] = params[lo:hi]
            else:
                fmt.encode(params[lo:hi], out[lo:hi])
            comm, dest = st.joins.link(p.w)
            self.sends.setdefault(p.w, []).append(
                comm.Isend(out[lo:hi], dest=dest, tag=wire.TAG_PARAMS))
        p.busy += time.perf_counter() - t0

    def _done(self, p: _Push) -> None:
        st, ring = self.store, self.store.ring
        del self.active[p.w]
        ring.version = ring.version + 1
        ring.updates += 1
        ring.apply_s += p.busy
        if not p.gone:
            nbytes = st.grads[p.w].nbytes
            ring.bytes_in += nbytes
            ring.bytes_out += nbytes
        if p.w not in st.lost:
            st._post(p.w)

    def pending(self) -> list:
        """Reply sends not known to be done (to wait for at the end)."""
        return [r for reqs in self.sends.values() for r in reqs]
