"""--wire bf16 / fp16: the conversions (round to nearest even, NaN and infinities kept, the
format's precision), in place without allocation, the message layout, the replies' copies
encoded once per version, the pushes a conversion made non-finite, and the refusals."""

from __future__ import annotations

import sys
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from mpilb.errors import UsageError
from mpilb.mpi import wire
from mpilb.mpi import wire_format as F


def _bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bits by arithmetic: the nearer of the two neighbours
    (truncation and the next value up), ties to the even one."""
    u = x.view(np.uint32).astype(np.uint64)
    down = (u >> 16).astype(np.uint64)
    lo = (down << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    hi = ((down + 1) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    xv = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        d_lo, d_hi = np.abs(xv - lo), np.abs(hi - xv)
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (down % 2 == 1))
    return np.where(up, down + 1, down).astype(np.uint16)


def _round_trip(name, x):
    fmt = F.wire_format(name)
    enc = np.empty(x.size, fmt.wire_dtype)
    fmt.encode(x, enc, np, fmt.scratch(x.size))
    back = np.empty(x.size, np.float32)
    fmt.decode(enc, back)
    return enc, back


def test_bf16_rounds_to_nearest_even_like_arithmetic():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) < F.BF16_OVERFLOW)]
    enc, _ = _round_trip("bf16", x)
    assert np.array_equal(enc, _bf16_reference(x))
    # the array-module path (CuPy's), through a stand-in that is not numpy itself
    xp = SimpleNamespace(**{k: getattr(np, k) for k in ("empty", "uint32", "right_shift", "add",
                                                        "bitwise_and", "copyto", "isnan")})
    fmt = F.wire_format("bf16")
    generic = np.empty(x.size, np.uint16)
    fmt.encode(x, generic, xp, fmt.scratch(x.size, xp))
    assert np.array_equal(generic, enc)
    # exact ties: 1 + 2^-8 lies half-way between 1 and 1 + 2^-7 (odd): down to 1.0;
    # 1 + 3 * 2^-8 half-way between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], np.float32)
    enc, back = _round_trip("bf16", ties)
    assert enc.tolist() == [0x3F80, 0x3F82, 0xBF80]
    assert back.tolist() == [1.0, 1 + 2**-6, -1.0]


@pytest.mark.parametrize("name,rel,smallest", [("bf16", 2.0**-8, 1e-37), ("fp16", 2.0**-11, 6.2e-5)])
def test_round_trip_within_the_formats_precision(name, rel, smallest):
    rng = np.random.default_rng(1)
    top = 6e4 if name == "fp16" else 1e30
    x = (rng.standard_normal(100_000) * np.exp(rng.uniform(np.log(smallest), np.log(top), 100_000)))
    x = x.astype(np.float32)
    x = x[(np.abs(x) >= smallest) & (np.abs(x) <= (65504 if name == "fp16" else 3e38))]
    _, back = _round_trip(name, x)
    err = np.abs(back.astype(np.float64) - x) / np.abs(x.astype(np.float64))
    assert err.max() <= rel   # half a unit in the last place of an 8 (11) bit significand
    exact = np.array([0.0, -0.0, 1.0, -2.0, 0.5, 3.0, 1024.0], np.float32)
    assert np.array_equal(_round_trip(name, exact)[1], exact)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_nan_and_infinities_are_kept(name):
    low_nan = np.array(0x7F800001, np.uint32).view(np.float32)   # mantissa only in the low half
    neg_nan = np.array(0xFFFFFFFF, np.uint32).view(np.float32)   # rounding would wrap around
    x = np.array([np.nan, low_nan, neg_nan, np.inf, -np.inf, 1.0], np.float32)
    _, back = _round_trip(name, x)
    assert np.isnan(back[:3]).all()
    assert back[3] == np.inf and back[4] == -np.inf and back[5] == 1.0


@pytest.mark.parametrize("name,big", [("bf16", 3.4e38), ("fp16", 7e4)])
def test_values_past_the_formats_range_overflow_and_are_said_to(name, big):
    fmt = F.wire_format(name)
    x = np.array([1.0, -big], np.float32)
    assert fmt.overflows(x) and not fmt.overflows(np.array([1.0, -1e3], np.float32))
    _, back = _round_trip(name, x)
    assert back[1] == -np.inf
    assert not F.wire_format("fp32").overflows(x)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_expanding_is_in_place_without_allocation(name):
    fmt = F.wire_format(name)
    n = 1_000_000
    enc = np.zeros(n, fmt.wire_dtype)
    out = np.empty(n, np.float32)
    fmt.decode(enc, out)   # (first call: numpy's own set-up)
    tracemalloc.start()
    fmt.decode(enc, out)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 1024, peak   # no temporary of n floats (4 MB)


def test_the_message_layout_keeps_state_float32_after_the_payload():
    fmt = F.wire_format("bf16")
    msg = F.new_message(fmt, 5, state=3)   # 10 bytes of gradient, padded to 12
    assert msg.payload.dtype == np.uint16 and msg.payload.size == 5
    assert msg.buf.nbytes == wire.HEADER_BYTES + 12 + 3 * 4
    payload, state = F.views(msg.buf, fmt, 5, 3)
    assert state.dtype == np.float32 and state.size == 3
    state[:] = [1.5, 2.5, 3.5]
    assert msg.buf[-12:].view(np.float32).tolist() == [1.5, 2.5, 3.5]
    fp32 = F.wire_format("fp32")   # the same bytes as wire.new_message
    assert F.message_bytes(fp32, 5, 3) == wire.new_message(8).buf.nbytes


class FakeSend:
    def __init__(self):
        self.done = False


def test_replies_are_encoded_once_per_version():
    fmt = F.wire_format("bf16")
    enc = F.EncodedParams(fmt, 4, finished=lambda req: req.done)
    params = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    a = enc.of(params, 7)
    sends = [FakeSend(), FakeSend()]
    enc.sending(sends[0])
    assert enc.of(params, 7) is a and enc.encodes == 1   # a second reply: the same copy
    enc.sending(sends[1])
    params *= 2
    b = enc.of(params, 8)   # a new version while sends still read the old copy: another
    assert b is not a and enc.encodes == 2 and a.tolist() == [0x3F80, 0x4000, 0x4040, 0x4080]
    for s in sends:
        s.done = True
    c = enc.of(params * 2, 9)   # the first copy is free again
    assert c is a and len(enc.bufs) == 2
    enc.forget()   # replaced parameters (a resume), same version number: encoded anew
    enc.of(params, 9)
    assert enc.encodes == 4


def test_unknown_wire_and_a_device_that_cannot_convert_are_one_line():
    with pytest.raises(UsageError, match=r"--wire 'bf8': choose one of fp32, bf16, fp16"):
        F.wire_format("bf8")
    from mpilb.config.build import build_config

    with pytest.raises(UsageError, match="--wire"):
        build_config({}, {"wire": "int8"})

    class NoHalf(SimpleNamespace):   # an array module without float16 casts
        def copyto(self, dst, src, **kw):
            if np.float16 in (getattr(dst, "dtype", None), getattr(src, "dtype", None)):
                raise TypeError("float16 is not supported")
            np.copyto(dst, src, **kw)

    xp = NoHalf(**{k: getattr(np, k) for k in ("asarray", "empty", "uint16", "uint32", "isnan",
                                                "float16", "right_shift", "left_shift", "add",
                                                "bitwise_and")})
    with pytest.raises(UsageError) as err:
        F.check_convertible(F.wire_format("fp16"), xp, "device gpu:0")
    assert str(err.value).startswith("--wire fp16: device gpu:0 cannot convert float32 to fp16")
    assert "\n" not in str(err.value) and "--wire fp32" in str(err.value)
    for name in F.FORMATS:
        F.check_convertible(F.wire_format(name), np, "cpu")
    # the array-module path (CuPy's: no casting arguments) gives numpy's bits too
    F.check_convertible(F.wire_format("bf16"), xp, "device gpu:0")


def test_a_push_a_conversion_made_infinite_is_flagged(monkeypatch):
    """fp16 holds magnitudes up to 65504: a finite gradient beyond it would reach the server
    infinite, so the worker's push says non-finite (the server rejects it, as any such)."""
    from mpilb.worker.messages import DeviceMessages
    from mpilb.worker.pushes import Pushes

    cpu = DeviceMessages(SimpleNamespace(name="cpu", xp=np), False)
    for name, big, flagged in [("fp16", 1e5, True), ("bf16", 1e5, False), ("bf16", 3.4e38, True)]:
        fmt = F.wire_format(name)
        pushes = Pushes(None, cpu, 3, 2, [0], [0, 3], None, pipelined=True, fmt=fmt)
        msg = pushes.bufs[1]
        grad = np.array([1.0, big, -2.0], np.float32)
        assert pushes.encode(grad, msg, finite=True) is flagged
        pushes.state_of(msg)[:] = [7.0, 8.0]
        back = np.empty(3, np.float32)
        fmt.decode(msg.payload, back)
        assert back[0] == 1.0 and back[2] == -2.0
        assert msg.buf[-8:].view(np.float32).tolist() == [7.0, 8.0]
        assert pushes.head_bytes == msg.buf.nbytes   # one store: header, gradient, state


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_torchs_casts_give_numpys_bits(name, monkeypatch):
    """In a process with torch imported (a torch model's), the CPU casts are torch's: the
    same bits as numpy's for every finite value, infinities and overflow (NaN stays NaN)."""
    torch = pytest.importorskip("torch")
    fmt = F.wire_format(name)
    rng = np.random.default_rng(3)
    n = 3 * F.TORCH_CAST_MIN + 5
    x = np.concatenate([rng.standard_normal(n - 40).astype(np.float32) * 10.0 ** rng.integers(-9, 9, n - 40),
                        np.array([0.0, -0.0, 1.0, 1 + 2**-8, 1 + 3 * 2**-9, 65504.0, 65519.0, 65520.0,
                                  F.BF16_OVERFLOW, 3.4e38, -3.4e38, np.inf, -np.inf, 1e-45, -1e-45,
                                  6e-8, 3e-8, np.nan] + [0.5] * 22, np.float32)]).astype(np.float32)
    assert x.size == n

    def both(monkeypatch_torch):
        with monkeypatch.context() as m:
            if not monkeypatch_torch:
                m.setitem(sys.modules, "torch", None)   # numpy's casts
            enc = np.empty(n, np.uint16)
            with np.errstate(invalid="ignore"):
                fmt.encode(x, enc, np, fmt.scratch(n, np))
            dec = np.empty(n, np.float32)
            fmt.decode(enc, dec, np)
            return enc, dec

    calls = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src: calls.append(1) or real(self, src))
    enc_t, dec_t = both(True)
    assert len(calls) == 2                  # the torch path was taken, both ways
    enc_n, dec_n = both(False)
    assert len(calls) == 2
    finite = ~np.isnan(x)
    assert np.array_equal(enc_t[finite], enc_n[finite])
    assert np.array_equal(dec_t[finite], dec_n[finite], equal_nan=True)
    assert np.isnan(dec_t[~finite]).all() and np.isnan(dec_n[~finite]).all()
    if name == "bf16":                      # its NaNs are made the same quiet NaN either way
        assert np.array_equal(enc_t, enc_n)
    # short, or not contiguous: numpy's casts (torch's would cost more than they save)
    short = x[:100].copy()
    out = np.empty(100, np.uint16)
    fmt.encode(short, out, np, fmt.scratch(100, np), finite=False)
    assert len(calls) == 2
