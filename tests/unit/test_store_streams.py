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

    def bind(self, size):
        pass

    def source(self, optimizer, worker):
        pass

    def tune(self, optimizer, staleness):
        optimizer.momentum = self.momenta[staleness]

    def apply(self, grad, staleness, params_now, params_then, at=0):
        return 1.0


def store(optimizer="sgd", correction=None, workers=(1, 2), fmt=wire_format.Float32(),
          spans=None):
    comm = Comm()
    opt = build_optimizer(optimizer, N, lr=LR)
    ring = ParamRing(np.ones(N, np.float32), opt, correction or build_correction("none"), 1)
    posted = []
    grads = {}
    for w in workers:
        grads[w] = np.empty(N, fmt.wire_dtype)
        fmt.encode(np.full(N, float(w), np.float32), grads[w])
    st = SimpleNamespace(ring=ring, queue=deque(), n=N, fmt=fmt, lost=set(),
                         recvs={w: [Req() for _ in (spans or {}).get(w, SPANS)]
                                for w in workers}, grads=grads,
                         joins=SimpleNamespace(link=lambda w: (comm, w)),
                         _spans=lambda w: (spans or {}).get(w, SPANS), _post=posted.append,
                         _poll_ctrl=lambda: False)
    return st, comm, posted


def stream(w, staleness=0):
    return CtrlMsg(Op.STREAM, w, 1, staleness, 0, 1.0)


def test_a_later_push_steps_each_chunk_once_the_earlier_one_has_stepped_it():
    """Worker 2's push (decided second) is all in, worker 1's not: worker 2 waits for
    worker 1 chunk by chunk, not for the whole of it, and every chunk of both replies
    carries the floats of one push at a time."""
    st, comm, posted = store()
    cs = ChunkStreams(st)
    cs.start(stream(1))
    cs.start(stream(2))
    for r in st.recvs[2]:
        r.done = True
    assert not cs.progress() and comm.sent == []
    st.recvs[1][0].done = True
    assert cs.progress()
    # worker 1's chunk 0, then worker 2's chunk 0; worker 2's chunk 1 waits for worker 1's
    assert [(d, v.tolist()) for d, v in comm.sent] == [
        (1, [1 - LR * 1] * 4), (2, [1 - LR * 3] * 4)]
    st.recvs[1][1].done = True
    cs.finish()
    assert [(d, v.tolist()) for d, v in comm.sent[2:]] == [
        (1, [1 - LR * 1] * 4), (2, [1 - LR * 3] * 4)]
    assert posted == [1, 2] and not cs.active
    assert np.allclose(st.ring.params, 1 - LR * 3)
    assert st.ring.version == 2 and st.ring.updates == 2


@pytest.mark.parametrize("cuts", [{}, {1: [(0, 8)]}, {2: [(0, 8)]}, {1: [(0, 3), (3, 8)]},
                                  {2: [(0, 1), (1, 2), (2, 7), (7, 8)], 3: [(0, 8)]}])
def test_chunks_arriving_in_any_order_give_the_floats_of_one_push_at_a_time(cuts):
    """Three pushes (momentum, each its own), chunks completing in a random order, the pushes
    cut alike or not (a worker on the store's own node sends its slice whole): the parameters
    and every reply equal those of the pushes applied whole, in order."""
    rng = np.random.default_rng(5)
    momenta = {0: 0.9, 1: 0.5, 2: 0.2}
    for _ in range(20):
        st, comm, _ = store("momentum", TunesBy(momenta), workers=(1, 2, 3), spans=cuts)
        for w in (1, 2, 3):
            st.grads[w][:] = rng.standard_normal(N).astype(np.float32)
        ref = ParamRing(np.ones(N, np.float32), build_optimizer("momentum", N, lr=LR),
                        TunesBy(momenta), 1)
        want = {}
        for k, w in enumerate((1, 2, 3)):
            ref.apply(st.grads[w].copy(), 1, k)
            want[w] = ref.params.copy()
        cs = ChunkStreams(st)
        for k, w in enumerate((1, 2, 3)):
            cs.start(stream(w, staleness=k))
        pending = [(w, i) for w in (1, 2, 3) for i in range(len(st.recvs[w]))]
        rng.shuffle(pending)
        for w, i in pending:
            st.recvs[w][i].done = True
            cs.progress()
        assert not cs.active
        assert np.array_equal(st.ring.params, ref.params)
        got = {w: [] for w in (1, 2, 3)}
        for dest, v in comm.sent:
            got[dest].append(v)
        for w in (1, 2, 3):
            assert np.array_equal(np.concatenate(got[w]), want[w])


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
    fmt.decode(comm.sent[-1][1], last)   # worker 2's second chunk, after both pushes
    assert comm.sent[-1][0] == 2 and comm.sent[-1][1].dtype == fmt.wire_dtype
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
    """Push A (momentum 0.9) steps its first chunk, push B (momentum 0.1) its first, then A
    its second and B its second: each with its own momentum, not the last one set."""
    st, comm, _ = store("momentum", TunesBy({0: 0.9, 5: 0.1}))
    cs = ChunkStreams(st)
    cs.start(stream(1, staleness=0))
    cs.start(stream(2, staleness=5))
    st.recvs[1][0].done = True
    cs.progress()
    st.recvs[2][0].done = st.recvs[2][1].done = True
    cs.progress()   # B's chunk 0 (after A's), B's chunk 1 waits for A's
    st.recvs[1][1].done = True
    cs.finish()
    p = st.ring.params
    # every chunk: A then B (velocity from 0; grads 1 and 2; lr 0.5)
    v_a = 1.0
    v_b = 0.1 * v_a + 2.0
    assert np.allclose(p, 1 - LR * v_a - LR * v_b)


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


def test_under_dana_each_push_steps_its_chunks_with_its_worker_s_own_velocity():
    """Pushes of workers 1 and 2 interleaved chunk by chunk, each twice: every chunk steps
    with the velocity of the worker it came from (Nesterov's step), never the other's."""
    st, comm, _ = store("momentum", build_correction("dana", own_warmup=True))
    cs = ChunkStreams(st)
    for _ in range(2):
        cs.start(stream(1))
        cs.start(stream(2))
        st.recvs[1][0].done = True
        cs.progress()
        st.recvs[2][0].done = st.recvs[2][1].done = True
        cs.progress()
        st.recvs[1][1].done = True
        cs.finish()
        for rs in st.recvs.values():
            for r in rs:
                r.done = False
    want, v = 1.0, {1: 0.0, 2: 0.0}
    for _ in range(2):
        for w, g in ((1, 1.0), (2, 2.0)):
            v[w] = 0.9 * v[w] + g
            want -= LR * (g + 0.9 * v[w])
    assert np.allclose(st.ring.params, want)
