"""--wire bf16 / fp16 pushes with error feedback (wire_format.Residual): what rounding took
off one push goes with the next, so the stores' sum of a worker's pushes stays within one
rounding of the float32 sum however many pushes there are; rejected pushes leave the carry
alone; no allocation per push; the array-module (CuPy) path gives numpy's bits."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from mpilb.mpi import wire_format as F


def _pushes(fmt, grads, feedback: bool) -> np.ndarray:
    """The float64 sum of what the stores read of each gradient in `grads` (rows)."""
    n = grads.shape[1]
    res = F.Residual(fmt, n)
    wire, back = np.empty(n, fmt.wire_dtype), np.empty(n, np.float32)
    total = np.zeros(n, np.float64)
    for g in grads:
        g = g.copy()
        if feedback:
            assert res.encode(g, wire) is False
        else:
            fmt.encode(g, wire, np, fmt.scratch(n))
        fmt.decode(wire, back)
        total += back
    return total


def _ulp(fmt, x: np.ndarray) -> np.ndarray:
    """The spacing of the wire format's values at magnitude `x` (normal range)."""
    mantissa = 7 if fmt.name == "bf16" else 10
    return np.exp2(np.floor(np.log2(np.abs(x))) - mantissa)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_the_sum_of_many_pushes_stays_within_one_ulp_of_the_float32_sum(name):
    fmt = F.wire_format(name)
    rng = np.random.default_rng(1)
    steps, n = 2000, 512
    # a steady part that rounds the same way push after push, and noise around it
    grads = (rng.uniform(0.5, 1.0, n) * (1 + rng.normal(0, 1e-3, (steps, n)))).astype(np.float32)
    exact = grads.astype(np.float64).sum(axis=0)
    ulp = _ulp(fmt, np.abs(grads).max(axis=0))
    fed = np.abs(_pushes(fmt, grads, feedback=True) - exact)
    assert np.all(fed <= ulp), (fed / ulp).max()
    # rounding each push alone drifts far beyond it (bias grows with the number of pushes)
    alone = np.abs(_pushes(fmt, grads, feedback=False) - exact)
    assert np.median(alone / ulp) > 4


def test_a_value_that_always_rounds_away_still_arrives():
    """1 + 2^-9 is 1 in bf16, and fp16 has nothing below 6e-8: rounded alone, those parts
    never reach the stores; carried, they arrive once they add up to a wire value."""
    for name, value, steps, ulp in [("bf16", 1 + 2**-9, 512, 2**-7), ("fp16", 1e-8, 400, 2**-24)]:
        fmt = F.wire_format(name)
        grads = np.full((steps, 4), value, np.float32)
        exact = steps * float(np.float32(value))
        assert abs(_pushes(fmt, grads, feedback=False)[0] - exact) > 50 * ulp   # 512 for 513; 0
        assert abs(_pushes(fmt, grads, feedback=True)[0] - exact) <= ulp


def test_a_rejected_push_leaves_the_carry_for_the_next():
    for name, bad, finite, flagged in [("bf16", np.nan, False, False), ("fp16", np.inf, False, False),
                                       ("fp16", 1e5, True, True), ("bf16", 3.4e38, True, True)]:
        fmt = F.wire_format(name)
        res = F.Residual(fmt, 3)
        wire = np.empty(3, fmt.wire_dtype)
        res.encode(np.array([1 + 2**-9, 1 / 3, -0.1], np.float32), wire)
        carry = res.carry.copy()
        assert np.any(carry != 0)
        # non-finite (the worker found it so) or made infinite by the conversion: rejected
        assert res.encode(np.array([bad, 1.0, 2.0], np.float32), wire, finite=finite) is flagged
        assert np.array_equal(res.carry, carry)


def test_feedback_allocates_nothing_per_push():
    fmt = F.wire_format("bf16")
    n = 1 << 18
    res = F.Residual(fmt, n)
    grad = np.random.default_rng(2).normal(size=n).astype(np.float32)
    wire = np.empty(n, fmt.wire_dtype)
    res.encode(grad.copy(), wire)
    tracemalloc.start()
    res.encode(grad, wire)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # (numpy's casting buffers take 32 KB; one temporary would be n * 4 bytes, 1 MB)
    assert peak < n, peak


def test_the_array_module_path_carries_numpys_bits():
    """CuPy's path (no casting arguments), through a stand-in that is not numpy itself."""
    xp = SimpleNamespace(**{k: getattr(np, k) for k in (
        "empty", "zeros", "float32", "uint32", "right_shift", "left_shift", "add", "subtract",
        "bitwise_and", "copyto", "isnan")})
    fmt = F.wire_format("bf16")
    grads = np.random.default_rng(3).normal(size=(5, 1000)).astype(np.float32)
    ours, theirs = F.Residual(fmt, 1000), F.Residual(fmt, 1000, xp)
    a, b = np.empty(1000, np.uint16), np.empty(1000, np.uint16)
    for g in grads:
        ours.encode(g.copy(), a)
        theirs.encode(g.copy(), b)
        assert np.array_equal(a, b)
    assert np.array_equal(ours.carry, theirs.carry)


def test_pushes_carry_the_rounding_from_one_push_to_the_next():
    from mpilb.worker.messages import DeviceMessages
    from mpilb.worker.pushes import Pushes

    cpu = DeviceMessages(SimpleNamespace(name="cpu", xp=np), False)
    fmt = F.wire_format("bf16")
    pushes = Pushes(None, cpu, 2, 0, [0], [0, 2], None, pipelined=True, fmt=fmt)
    got = []
    for msg in pushes.bufs:   # pipelined: the two buffers in turn
        assert pushes.encode(np.array([1 + 2**-8 + 2**-10, 3.0], np.float32), msg, finite=True) is False
        back = np.empty(2, np.float32)
        fmt.decode(msg.payload, back)
        got.append(back)
    # 1 + 2^-8 + 2^-10 rounds to 1 + 2^-7 (over by 3 * 2^-10), the next push 1 (the carry taken off)
    assert [g[0] for g in got] == [1 + 2**-7, 1.0] and [g[1] for g in got] == [3.0, 3.0]
    assert pushes.residual.carry[0] == np.float32(2 * (1 + 2**-8 + 2**-10) - (2 + 2**-7))
