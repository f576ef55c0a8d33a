"""Unit tests for mpilb.core.optimizers: update formulas, weight decay, state, lr_scale, errors."""

import numpy as np
import pytest

from mpilb.errors import UsageError
from mpilb.core.optimizers import OPTIMIZERS, build_optimizer

P0 = np.array([1.0, -2.0, 0.5, 3.0])
G1 = np.array([0.1, -0.4, 2.0, 0.0])
G2 = np.array([-0.3, 0.2, 1.0, 0.5])


def _run(name, grads, dtype=np.float64, scales=None, **kw):
    opt = build_optimizer(name, len(P0), dtype=dtype, **kw)
    params = P0.astype(dtype)
    for i, g in enumerate(grads):
        grad = g.astype(dtype)
        before = grad.copy()
        opt.step(params, grad, *(() if scales is None else (scales[i],)))
        np.testing.assert_array_equal(grad, before)  # the caller's gradient is untouched
    return params


def test_sgd():
    np.testing.assert_allclose(_run("sgd", [G1, G2], lr=0.1), P0 - 0.1 * G1 - 0.1 * G2)


def test_sgd_weight_decay_is_l2_added_to_the_gradient():
    p1 = P0 - 0.1 * (G1 + 0.01 * P0)
    np.testing.assert_allclose(_run("sgd", [G1], lr=0.1, weight_decay=0.01), p1)


def test_lr_scale_multiplies_the_learning_rate():
    expected = P0 - 0.1 * 0.5 * G1 - 0.1 * 0.25 * G2
    np.testing.assert_allclose(_run("sgd", [G1, G2], lr=0.1, scales=[0.5, 0.25]), expected)
    m1 = build_optimizer("adam", 4, lr=0.1, dtype=np.float64)
    m2 = build_optimizer("adam", 4, lr=0.05, dtype=np.float64)
    a, b = P0.copy(), P0.copy()
    m1.step(a, G1, lr_scale=0.5)
    m2.step(b, G1)
    np.testing.assert_allclose(a, b)


def test_heavy_ball_momentum():
    v1 = G1
    p1 = P0 - 0.1 * v1
    v2 = 0.9 * v1 + G2
    p2 = p1 - 0.1 * v2
    np.testing.assert_allclose(_run("momentum", [G1, G2], lr=0.1, momentum=0.9), p2)


def test_nesterov_momentum_with_weight_decay():
    wd, mu, lr = 0.01, 0.8, 0.1
    g1 = G1 + wd * P0
    v1 = g1
    p1 = P0 - lr * (g1 + mu * v1)
    g2 = G2 + wd * p1
    v2 = mu * v1 + g2
    p2 = p1 - lr * (g2 + mu * v2)
    got = _run("momentum", [G1, G2], lr=lr, momentum=mu, nesterov=True, weight_decay=wd)
    np.testing.assert_allclose(got, p2)


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adam_with_bias_correction(wd):
    lr, b1, b2, eps = 0.01, 0.9, 0.99, 1e-8
    p, m, v = P0.copy(), np.zeros(4), np.zeros(4)
    for t, g in enumerate([G1, G2], start=1):
        g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    got = _run("adam", [G1, G2], lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
    np.testing.assert_allclose(got, p, rtol=1e-12)
    # first step of Adam moves every coordinate with a nonzero gradient by about lr
    one = _run("adam", [G1], lr=lr)
    np.testing.assert_allclose(np.abs(one - P0)[G1 != 0], lr, rtol=1e-5)


def test_adamw_decays_the_parameters_apart_from_the_moments():
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.99, 1e-8, 0.1
    p, m, v = P0.copy(), np.zeros(4), np.zeros(4)
    for t, g in enumerate([G1, G2], start=1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    got = _run("adamw", [G1, G2], lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
    np.testing.assert_allclose(got, p, rtol=1e-12)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("out", ["params", "other", "grad"])
def test_adamw_steps_as_torch_optim_adamw(fused, out):
    torch = pytest.importorskip("torch")
    from mpilb.models.torch_adapter import FusedAdam

    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(300).astype(np.float32)
    grads = rng.standard_normal((4, 300)).astype(np.float32)
    opt = build_optimizer("adamw", 300, lr=0.01, weight_decay=0.05, beta2=0.99)
    opt.use_fused(FusedAdam if fused else None)
    p = p0.copy()
    for g in grads:
        g = g.copy()
        target = {"params": p, "other": np.empty_like(p), "grad": g}[out]
        opt.step(p, g, 0.5, out=target)
        p = target
    ref = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    torch_opt = torch.optim.AdamW([ref], lr=0.005, weight_decay=0.05, betas=(0.9, 0.99))
    for g in grads:
        ref.grad = torch.from_numpy(g.copy())
        torch_opt.step()
    np.testing.assert_allclose(p, ref.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,kw", [("sgd", {}), ("momentum", {"nesterov": True}),
                                     ("adam", {"weight_decay": 1e-3}),
                                     ("adamw", {"weight_decay": 1e-2})])
def test_state_dict_round_trip_gives_identical_next_steps(name, kw):
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((5, 50)).astype(np.float32)
    a = build_optimizer(name, 50, lr=0.01, **kw)
    pa = rng.standard_normal(50).astype(np.float32)
    for g in grads[:3]:
        a.step(pa, g)
    state = a.state_dict()
    assert state["name"] == name and state["steps"] == 3
    for value in state.values():
        assert not isinstance(value, np.ndarray) or not np.shares_memory(value, pa)
    b = build_optimizer(name, 50, lr=0.01, **kw)
    b.load_state_dict({k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()})
    pb = pa.copy()
    for g in grads[3:]:
        a.step(pa, g)
        b.step(pb, g)
    np.testing.assert_array_equal(pa, pb)
    assert b.state_dict()["steps"] == 5


def test_load_state_dict_rejects_other_optimizer_or_size():
    state = build_optimizer("adam", 8, lr=0.1).state_dict()
    with pytest.raises(UsageError, match="'adam'.*'momentum'"):
        build_optimizer("momentum", 8, lr=0.1).load_state_dict(state)
    with pytest.raises(UsageError, match="shape"):
        build_optimizer("adam", 9, lr=0.1).load_state_dict(state)


def test_float32_step_keeps_dtype():
    opt = build_optimizer("adam", 4, lr=0.1)
    params = P0.astype(np.float32)
    opt.step(params, G1.astype(np.float32))
    assert params.dtype == np.float32 and opt.exp_avg.dtype == np.float32


def test_registry_and_unknown_name():
    assert set(OPTIMIZERS) == {"sgd", "momentum", "adam", "adamw"}
    with pytest.raises(UsageError, match="valid optimizers: adam, adamw, momentum, sgd"):
        build_optimizer("rmsprop", 4, lr=0.1)


@pytest.mark.parametrize("kw,option", [
    ({"lr": 0.0}, "--lr"), ({"lr": -1.0}, "--lr"), ({"lr": float("nan")}, "--lr"),
    ({"lr": 0.1, "momentum": 1.0}, "--momentum"), ({"lr": 0.1, "momentum": -0.1}, "--momentum"),
    ({"lr": 0.1, "weight_decay": -1e-4}, "--weight-decay"),
    ({"lr": 0.1, "beta2": 1.0}, "--beta2"), ({"lr": 0.1, "eps": 0.0}, "--eps"),
])
def test_bad_values(kw, option):
    with pytest.raises(UsageError, match=option):
        build_optimizer("sgd", 4, **kw)


@pytest.mark.parametrize("name,kw", [("sgd", {"weight_decay": 1e-4}), ("momentum", {}),
                                     ("momentum", {"nesterov": True, "weight_decay": 1e-4}),
                                     ("adam", {}), ("adam", {"weight_decay": 1e-4})])
def test_step_allocates_no_arrays(name, kw):
    import tracemalloc

    n = 100_000
    opt = build_optimizer(name, n, lr=1e-3, **kw)
    params, grad = np.ones(n, dtype=np.float32), np.full(n, 0.5, dtype=np.float32)
    opt.step(params, grad)
    tracemalloc.start()
    opt.step(params, grad, lr_scale=0.5)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4096, peak  # a temporary would be 400 kB


def _reference(name, p, grads, lr, wd, mu=0.9, nesterov=False, b1=0.9, b2=0.999, eps=1e-8):
    """The textbook update in float64, written as plainly as possible (temporaries and all)."""
    p = p.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64) + wd * p
        if name == "sgd":
            p = p - lr * g
        elif name == "momentum":
            m = mu * m + g
            p = p - lr * (g + mu * m if nesterov else m)
        else:
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p, m, v


@pytest.mark.parametrize("name,kw", [
    ("adam", {}), ("adam", {"weight_decay": 1e-2}), ("adam", {"beta1": 0.0, "beta2": 0.5}),
    ("sgd", {}), ("sgd", {"weight_decay": 1e-2}),
    ("momentum", {}), ("momentum", {"nesterov": True, "weight_decay": 1e-2}),
])
def test_blocked_float32_step_matches_a_float64_reference(name, kw):
    """Several blocks and a short last one: the blocked step is the textbook update."""
    from mpilb.core import optimizers

    n = 2 * optimizers.OPTIMIZERS[name]._block + 1234   # (sgd's blocks are twice as long)
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) * s for s in (1.0, 0.1, 3.0, 1e-3, 0.5)]
    opt = build_optimizer(name, n, lr=1e-2, **kw)
    assert len(opt._spans) == 3
    params = p0.copy()
    for g in grads:
        opt.step(params, g)
    ref_kw = {k: v for k, v in kw.items() if k != "weight_decay"}
    ref_kw = {{"beta1": "b1", "beta2": "b2"}.get(k, k): v for k, v in ref_kw.items()}
    expected, m, v = _reference(name, p0, grads, 1e-2, kw.get("weight_decay", 0.0), **ref_kw)
    # float32 rounding of a few steps of size ~lr around values ~1: well under 1e-5
    np.testing.assert_allclose(params, expected, rtol=0, atol=2e-6)
    assert np.abs(params - p0).max() > 1e-3   # and the parameters did move
    state = opt.state_dict()   # checkpoints hold the textbook moments, however they are kept
    if name == "adam":
        close(state["exp_avg"], m)
        close(state["exp_avg_sq"], v)
    elif name == "momentum":
        close(state["velocity"], m)


def close(got, want):
    """Equal to float32 rounding, relative to the vector's scale (entries near 0 cancel)."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_block_size_does_not_change_the_result(name, monkeypatch):
    from mpilb.core import optimizers

    n = 5000
    rng = np.random.default_rng(2)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = rng.standard_normal((3, n)).astype(np.float32)
    results = []
    for block in (n, 4096, 999):
        monkeypatch.setattr(optimizers, "BLOCK", block)
        opt = build_optimizer(name, n, lr=1e-2, weight_decay=1e-3)
        params = p0.copy()
        for g in grads:
            opt.step(params, g)
        results.append(params)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])   # same arithmetic element by element


def _adam(n, kernel, **kw):
    """An Adam forced onto one kernel ("numpy" or "torch-fused")."""
    from mpilb.core import optimizers as O

    opt = build_optimizer("adam", n, lr=0.01, **kw)
    if kernel == "numpy":
        opt.use_fused(None)
    elif opt.kernel != "torch-fused":
        pytest.skip("torch's fused Adam is not available here")
    assert opt.kernel == kernel and O.FUSED_MIN_PARAMS <= n
    return opt


def test_fused_adam_steps_like_the_numpy_blocks():
    """The fused kernel (torch installed, >= FUSED_MIN_PARAMS floats) and the numpy blocks give
    the same parameters and the same checkpointed moments, to float rounding; a slice of the
    state moves between the two (parameter stores of one run may step with either)."""
    n = 70000
    rng = np.random.default_rng(3)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    a, b = _adam(n, "numpy", weight_decay=0.01), _adam(n, "torch-fused", weight_decay=0.01)
    pa, pb = p0.copy(), p0.copy()
    for i, g in enumerate(grads):
        a.step(pa, g, 0.5 + i)
        out = np.empty_like(pb)
        b.step(pb, g, 0.5 + i, out=out)
        pb = out
    np.testing.assert_allclose(pa, pb, rtol=1e-5, atol=1e-7)
    sa, sb = a.state_dict(), b.state_dict()
    for buf in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_allclose(sa[buf], sb[buf], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a.state_slice(buf, 10, 500), b.state_slice(buf, 10, 500),
                                   rtol=1e-5, atol=1e-6)
    # the numpy one takes the fused one's moments for a slice, and steps on as it would have
    c = _adam(n, "numpy", weight_decay=0.01)
    c.load_state_dict(sb)
    for buf in ("exp_avg", "exp_avg_sq"):
        c.load_state_slice(buf, 0, 1000, b.state_slice(buf, 0, 1000))
    pc = pb.copy()
    g = grads[0]
    c.step(pc, g)
    b.step(pb, g)
    np.testing.assert_allclose(pc, pb, rtol=1e-5, atol=1e-7)
