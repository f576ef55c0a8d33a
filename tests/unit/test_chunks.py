"""--chunk-kb (mpi/chunks.py): which pairs go in chunks, how a slice is cut, and that a step
taken chunk by chunk (ParamRing.apply_chunks, Optimizer.step_range) gives the floats of the
whole step, with its reply chunks sent as each is stepped."""

from __future__ import annotations

import numpy as np
import pytest

from mpilb.core.corrections import build_correction
from mpilb.core.optimizers import build_optimizer
from mpilb.mpi import chunks, wire_format
from mpilb.server.modes import ParamRing
from mpirun import config_stub


def cfg(nodes, kb=128):
    c = config_stub(chunk_kb=kb)
    c.rank_nodes = tuple(nodes)
    return c


def test_spans_cover_the_slice_in_chunks_of_about_kb():
    s = chunks.spans(1_000_000, 4, 128)   # 4 MB in 128 KB pieces
    assert len(s) == 31 and s[0][0] == 0 and s[-1][1] == 1_000_000
    assert all(a[1] == b[0] for a, b in zip(s, s[1:]))
    assert max(hi - lo for lo, hi in s) - min(hi - lo for lo, hi in s) <= 1
    assert chunks.spans(1_000_000, 2, 128) and len(chunks.spans(1_000_000, 2, 128)) == 16  # bf16
    assert chunks.spans(30_000, 4, 128) is None          # one chunk: one message
    assert chunks.spans(1_000_000, 4, 0) is None         # --chunk-kb 0
    assert len(chunks.spans(10**8, 4, 128)) == chunks.MAX_CHUNKS


def test_only_pairs_on_different_nodes_are_chunked(monkeypatch):
    monkeypatch.delenv(chunks.LOCAL_ENV, raising=False)
    c = cfg([0, 0, 1, 1])
    n = 1_000_000
    assert chunks.plan(c, 1, 0, n, 4) is None            # rank 0's node: shared memory
    assert chunks.plan(c, 2, 0, n, 4) is not None        # across the network
    assert chunks.plan(c, 7, 0, n, 4) is None            # a joiner: outside the layout
    assert chunks.plan(cfg([0, 0, 1, 1], kb=0), 2, 0, n, 4) is None
    # a model with state (BatchNorm) sends rank 0's slice whole: the state follows it
    plans = chunks.store_plans(cfg([0, 1, 1]), 1, [0, 2], [0, n, 2 * n], 4, num_state=10)
    assert plans[0] is None and plans[1] is None         # rank 2 shares rank 1's node
    plans = chunks.store_plans(cfg([0, 1, 2]), 1, [0, 2], [0, n, 2 * n], 4, num_state=10)
    assert plans[0] is None and plans[1] is not None
    monkeypatch.setenv(chunks.LOCAL_ENV, "1")           # the test hook: one node as if apart
    assert chunks.plan(c, 1, 0, n, 4) is not None


@pytest.mark.parametrize("optimizer,kw,correction", [
    ("sgd", {}, "none"),
    ("sgd", {"weight_decay": 1e-2}, "inverse"),
    ("momentum", {"nesterov": True}, "lookahead"),
    ("adam", {}, "dc"),
    ("adamw", {"weight_decay": 0.1}, "dynamic"),
])
@pytest.mark.parametrize("consume", [False, True])
def test_a_step_in_chunks_gives_the_whole_steps_floats(optimizer, kw, correction, consume):
    n = 100_003
    rng = np.random.default_rng(1)
    spans = chunks.spans(n, 4, 64)

    def ring():
        opt = build_optimizer(optimizer, n, lr=0.05, **kw)
        if hasattr(opt, "use_fused"):
            opt.use_fused(None)   # (the fused kernel steps whole vectors: checked below)
        return ParamRing(rng_params.copy(), opt, build_correction(correction), 32, keep_sent=1)

    rng_params = rng.standard_normal(n).astype(np.float32)
    whole, pieces = ring(), ring()
    for step in range(3):
        g = rng.standard_normal(n).astype(np.float32)
        then = whole.params_of(whole.version) if step else None
        whole.apply(g.copy(), 32, step, then, consume=consume)
        whole.exchange()
        order, sent = [], []
        grad = g.copy()

        def arrive(i):
            order.append(("in", i))

        def answer(i, new):
            lo, hi = spans[i]
            order.append(("out", i))
            sent.append(new[lo:hi].copy())   # what goes on the wire, as it is stepped
            return []

        then = pieces.params_of(pieces.version) if step else None
        pieces.apply_chunks(grad, 32, step, spans, arrive, answer, then, consume=consume)
        pieces.exchange()
        assert pieces.version == whole.version == step + 1
        assert np.array_equal(pieces.params, whole.params)
        assert np.array_equal(np.concatenate(sent), whole.params)
        # each chunk answered before the next is waited for
        assert order == [(k, i) for i in range(len(spans)) for k in ("in", "out")]
    assert pieces.optimizer.steps == whole.optimizer.steps == 3


def test_an_optimizer_that_steps_whole_vectors_takes_every_chunk_first():
    n = 70_000
    spans = chunks.spans(n, 4, 64)
    opt = build_optimizer("sgd", n, lr=0.1)
    opt.ranged = False   # as the fused Adam kernel and torch.optim classes
    r = ParamRing(np.ones(n, np.float32), opt, build_correction("none"), 32)
    order = []
    r.apply_chunks(np.ones(n, np.float32), 32, 0, spans, lambda i: order.append(("in", i)),
                   lambda i, new: order.append(("out", i)) or [])
    k = len(spans)
    assert order == [("in", i) for i in range(k)] + [("out", i) for i in range(k)]
    assert np.allclose(r.params, 0.9)


def test_a_wire_copy_is_made_chunk_by_chunk():
    fmt = wire_format.wire_format("bf16")
    n = 1000
    p = np.linspace(-3, 3, n).astype(np.float32)
    enc = wire_format.EncodedParams(fmt, n, lambda r: True)
    whole = enc.of(p, 1).copy()
    enc.begin(2)
    for lo, hi in chunks.spans(n, 2, 1):
        enc.encode_range(p, lo, hi)
    assert np.array_equal(enc.of(p, 2), whole)   # (version 2 is current: not encoded again)
    assert enc.encodes == 2
