"""A store other than rank 0 stepping several streamed pushes at once (server/store_streams.py),
driven without MPI: chunks arrive in any order, each push keeps its own settings, a chunk
that never comes counts as zeros, and every reply chunk is a copy of the floats it was."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest

from mpilb.core.corrections import build_correction
from mpilb.core.optimizers import build_optimizer
from mpilb.mpi import wire_format
from mpilb.mpi.wire import CtrlMsg, Op
from mpilb.server.modes import ParamRing
from mpilb.server.store_streams import ChunkStreams, eligible

N, SPANS, LR = 8, [(0, 4), (4, 8)], 0.5


class Req:
    def __init__(self, done=False):
        self.done = done

    def Test(self):
        return self.done


class Comm:
    def __init__(self):
        self.sent = []   # (dest, the values sent, as they were when sent)

    def Isend(self, buf, dest, tag):
        self.sent.append((dest, np.array(buf)))
        return Req(True)


class TunesBy:
    """A correction that sets the momentum from the staleness alone."""
    needs_old_params = False

    def __init__(self, momenta):
        self.momenta = momenta

    def tune(self, optimizer, staleness):
        optimizer.momentum = self.momenta[staleness]

    def apply(self, grad, staleness, params_now, params_then):
        return 1.0


def store(optimizer="sgd", correction=None, workers=(1, 2), fmt=wire_format.Float32()):
    comm = Comm()
    opt = build_optimizer(optimizer, N, lr=LR)
    ring = ParamRing(np.ones(N, np.float32), opt, correction or build_correction("none"), 1)
    posted = []
    grads = {}
    for w in workers:
        grads[w] = np.empty(N, fmt.wire_dtype)
        fmt.encode(np.full(N, float(w), np.float32), grads[w])
    st = SimpleNamespace(ring=ring, queue=deque(), n=N, fmt=fmt, lost=set(),
                         recvs={w: [Req(), Req()] for w in workers}, grads=grads,
                         joins=SimpleNamespace(link=lambda w: (comm, w)),
                         _spans=lambda w: SPANS, _post=posted.append, _poll_ctrl=lambda: False)
    return st, comm, posted


def stream(w, staleness=0):
    return CtrlMsg(Op.STREAM, w, 1, staleness, 0, 1.0)


def test_the_later_push_whose_chunks_came_first_is_answered_first():
    st, comm, posted = store()
    cs = ChunkStreams(st)
    cs.start(stream(1))
    cs.start(stream(2))
    assert not cs.progress() and comm.sent == []
    for r in st.recvs[2]:   # worker 2's chunks are in, worker 1's still coming
        r.done = True
    assert cs.progress()
    assert [d for d, _ in comm.sent] == [2, 2] and posted == [2]
    assert np.array_equal(np.concatenate([v for _, v in comm.sent]), np.full(N, 1 - LR * 2, np.float32))
    for r in st.recvs[1]:
        r.done = True
    cs.finish()
    assert posted == [2, 1] and not cs.active
    assert np.allclose(st.ring.params, 1 - LR * (1 + 2))   # both applied, in place
    assert np.allclose(comm.sent[-1][1], 1 - LR * 3)
    assert st.ring.version == 2 and st.ring.updates == 2


def test_in_bf16_each_chunk_is_expanded_stepped_and_answered_in_bf16():
    fmt = wire_format.wire_format("bf16")
    st, comm, _ = store(fmt=fmt)
    cs = ChunkStreams(st)
    cs.start(stream(1))
    cs.start(stream(2))
    st.recvs[1][0].done = st.recvs[2][0].done = st.recvs[2][1].done = True
    cs.progress()
    st.recvs[1][1].done = True
    cs.finish()
    assert np.allclose(st.ring.params, 1 - LR * 3)
    last = np.empty(4, np.float32)
    fmt.decode(comm.sent[-1][1], last)   # worker 1's second chunk, after both pushes
    assert comm.sent[-1][0] == 1 and comm.sent[-1][1].dtype == fmt.wire_dtype
    assert np.allclose(last, 1 - LR * 3)


def test_a_push_is_answered_chunk_after_chunk_whatever_order_they_complete_in():
    """The worker's receives take a reply's chunks in order (MPI matches them by order, not
    by size): a chunk in before the one ahead of it waits for it."""
    st, comm, _ = store()
    cs = ChunkStreams(st)
    cs.start(stream(1))
    st.recvs[1][1].done = True
    assert not cs.progress() and comm.sent == []
    st.recvs[1][0].done = True
    assert cs.progress()
    assert [len(v) for _, v in comm.sent] == [4, 4] and np.allclose(st.ring.params, 1 - LR)


def test_each_push_steps_its_chunks_with_its_own_momentum():
    """Push A (momentum 0.9) steps its first chunk, push B (momentum 0.1) both of its
    chunks, then A its second chunk: with A's momentum, not the last one set."""
    st, comm, _ = store("momentum", TunesBy({0: 0.9, 5: 0.1}))
    cs = ChunkStreams(st)
    cs.start(stream(1, staleness=0))
    cs.start(stream(2, staleness=5))
    st.recvs[1][0].done = True
    cs.progress()
    st.recvs[2][0].done = st.recvs[2][1].done = True
    cs.progress()
    st.recvs[1][1].done = True
    cs.finish()
    p = st.ring.params
    # chunk 0: A then B; chunk 1: B then A (velocity from 0; grads 1 and 2; lr 0.5)
    v_a0 = 1.0
    v_b0 = 0.1 * v_a0 + 2.0
    assert np.allclose(p[:4], 1 - LR * v_a0 - LR * v_b0)
    v_b1 = 2.0
    v_a1 = 0.9 * v_b1 + 1.0
    assert np.allclose(p[4:], 1 - LR * v_b1 - LR * v_a1)


def test_a_worker_declared_lost_has_its_missing_chunks_count_as_zeros():
    st, comm, posted = store()
    cs = ChunkStreams(st)
    cs.start(stream(1))
    st.recvs[1][0].done = True
    cs.progress()
    cs.finish(lose=1)   # rank 0's LOSE for it is the next command
    assert np.allclose(st.ring.params, [1 - LR] * 4 + [1] * 4)
    assert len(comm.sent) == 1 and not cs.active


def test_sends_reading_the_parameters_move_them_before_they_are_stepped_in_place():
    st, comm, _ = store()
    before = st.ring.params
    st.ring.sending(Req(False))   # a whole reply still reads the current buffer
    cs = ChunkStreams(st)
    cs.start(stream(1))
    assert st.ring.params is not before and np.array_equal(st.ring.params, before)
    for r in st.recvs[1]:
        r.done = True
    cs.finish()
    assert np.all(before == 1) and np.allclose(st.ring.params, 1 - LR)


@pytest.mark.parametrize("optimizer, correction, ok", [
    ("sgd", "none", True), ("momentum", "lookahead", True), ("adam", "none", False),
    ("momentum", "dc", False)])
def test_which_stores_step_several_pushes_at_once(optimizer, correction, ok):
    ring = ParamRing(np.zeros(N, np.float32), build_optimizer(optimizer, N, lr=LR),
                     build_correction(correction), 1)
    assert eligible(ring) is ok
