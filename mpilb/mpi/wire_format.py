"""The element type of gradients and parameters on the wire (--wire fp32, bf16, fp16).

The stores keep float32 parameters and optimizer state whatever the wire carries: a worker
converts its gradient to the wire type before it pushes and expands each reply's parameters
after it arrives (with the backend's array module: numpy, or CuPy on a GPU); a store expands
each gradient it receives into a float32 buffer it keeps, and converts its parameters for the
replies once per version (:class:`EncodedParams`), not once per reply. A worker's pushes
carry each push's rounding to the next (:class:`Residual`, error feedback), since the stores
add the gradients up and a rounding that always goes one way would add up with them.

A 16-bit format travels as uint16 (numpy has no bfloat16, and MPI needs no datatype for it):

- bf16 is the top half of a float32. Encoding rounds to nearest, ties to even, with integer
  operations only (add 0x7FFF plus the lowest kept bit, shift right by 16); NaN stays NaN
  (a quiet NaN) and infinities stay infinite. Expanding is a shift left by 16, in place.
- fp16 is IEEE half precision (numpy's and CuPy's float16 casts: round to nearest even);
  magnitudes from 65520 up become infinite, below 6e-8 zero.

On the CPU, in a process that has imported torch already (a torch model's), the casts are
torch's (:func:`_torch_cast`): one vectorized pass, the same bits (NaN stays a NaN); on
270,000 floats, one thread, bf16 encodes 3.6x as fast and fp16 27x
(benchmarks/wire_casts.py, docs/benchmarks.md).

A message is laid out as [float64 header | wire payload, padded to 4 bytes | float32 model
state] (:func:`new_message`): the model's state floats (BatchNorm statistics) after a push's
gradient stay float32, whatever the wire. With fp32 the layout is wire.new_message's.

    fmt = wire_format("bf16")
    fmt.encode(grad32, wire_view, np, scratch)   # scratch: fmt.scratch(n, np)
    fmt.decode(wire_view, params32, np)
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import numpy as np

from mpilb.errors import UsageError
from mpilb.mpi import wire

FORMATS: dict[str, type] = {}

# Magnitudes from these up round to infinity (half-way above the largest finite value).
BF16_OVERFLOW = float(np.array(0x7F7F8000, np.uint32).view(np.float32))
FP16_OVERFLOW = 65520.0

TORCH_CAST_MIN = 4096
"""Vectors shorter than this are cast by numpy (a torch view costs a few microseconds)."""


def _torch_cast(dst: np.ndarray, src: np.ndarray, dst_type: str, src_type: str) -> bool:
    """Copy `src` into `dst` with torch's cast, each array read as the named torch dtype
    (``float32``, ``bfloat16``, ``float16``; a 16-bit array is numpy uint16): True when
    done, False where torch is not imported in this process or the arrays do not suit
    (short, not contiguous, unaligned, read-only), and the caller casts with numpy. Never
    imports torch: that costs a second or more, and a run without a torch model has none."""
    torch = sys.modules.get("torch")
    if (torch is None or src.size < TORCH_CAST_MIN or not isinstance(src, np.ndarray)
            or not isinstance(dst, np.ndarray)):
        return False
    for a in (src, dst):
        if not (a.flags.c_contiguous and a.flags.aligned and a.flags.writeable):
            return False

    def tensor(a: np.ndarray, kind: str):
        if kind == "float32":
            return torch.from_numpy(a)
        return torch.from_numpy(a.view(np.int16)).view(getattr(torch, kind))

    tensor(dst, dst_type).copy_(tensor(src, src_type))
    return True


def register(name: str):
    """Class decorator: a wire format selectable as ``--wire name``."""
    def deco(cls):
        cls.name = name
        FORMATS[name] = cls
        return cls
    return deco


class WireFormat:
    """fp32: the parameters' own type; nothing is converted."""

    name = ""
    itemsize = 4
    wire_dtype: Any = np.float32
    overflow = float("inf")

    @property
    def is_fp32(self) -> bool:
        return self.itemsize == 4

    def scratch(self, n: int, xp=np) -> Optional[Any]:
        """Working memory :meth:`encode` needs for `n` floats (allocated once)."""
        return None

    def encode(self, src, dst, xp=np, scratch=None, finite: bool = False) -> None:
        """float32 `src` -> `dst` (wire_dtype, the same length). `finite`: the caller knows
        `src` holds no NaN (a pass is saved)."""
        xp.copyto(dst, src)

    def decode(self, src, dst, xp=np) -> None:
        """Wire `src` -> float32 `dst`, in place (no allocation)."""
        xp.copyto(dst, src)

    def overflows(self, src) -> bool:
        """Whether some finite value of float32 `src` becomes infinite on the wire (two
        reductions, no allocation)."""
        if self.overflow == float("inf") or src.size == 0:
            return False
        return float(src.max()) >= self.overflow or float(src.min()) <= -self.overflow

    def nbytes(self, floats: int) -> int:
        """Bytes of `floats` values on the wire, padded to 4 (float32 state may follow)."""
        return (self.itemsize * floats + 3) // 4 * 4


@register("fp32")
class Float32(WireFormat):
    pass


@register("bf16")
class BFloat16(WireFormat):
    """bfloat16 as uint16: the upper half of the float32, rounded to nearest even."""

    itemsize = 2
    wire_dtype = np.uint16
    overflow = BF16_OVERFLOW

    def scratch(self, n, xp=np):
        return xp.empty(n, xp.uint32)

    def encode(self, src, dst, xp=np, scratch=None, finite=False):
        u = src.view(xp.uint32)
        if xp is np and _torch_cast(dst, src, "bfloat16", "float32"):
            pass   # (torch rounds the same way: NaNs are made quiet NaNs below)
        elif xp is np:   # fewer bytes moved: the uint16 output holds the kept bit meanwhile
            tmp = scratch if scratch is not None else self.scratch(src.size, xp)
            np.right_shift(u, 16, out=dst, casting="unsafe")
            np.bitwise_and(dst, 1, out=dst)        # the lowest bit kept: ties go to even
            np.add(u, dst, out=tmp)
            np.add(tmp, 0x7FFF, out=tmp)
            np.right_shift(tmp, 16, out=dst, casting="unsafe")
        else:
            tmp = scratch if scratch is not None else self.scratch(src.size, xp)
            xp.right_shift(u, 16, out=tmp)
            xp.bitwise_and(tmp, 1, out=tmp)
            xp.add(tmp, u, out=tmp)
            xp.add(tmp, 0x7FFF, out=tmp)
            xp.right_shift(tmp, 16, out=tmp)
            xp.copyto(dst, tmp, casting="unsafe")
        # rounding a NaN's low bits could carry it into an infinity: a max propagates NaN,
        # one read of the input and no allocation (the repair, when needed, allocates)
        if not finite and src.size and bool(xp.isnan(src.max())):
            xp.copyto(dst, np.uint16(0x7FC0), where=xp.isnan(src))   # a quiet NaN

    def decode(self, src, dst, xp=np):
        if xp is np and _torch_cast(dst, src, "float32", "bfloat16"):
            return
        xp.left_shift(src, 16, out=dst.view(xp.uint32), dtype=xp.uint32)


@register("fp16")
class Float16(WireFormat):
    """IEEE half precision, carried as uint16."""

    itemsize = 2
    wire_dtype = np.uint16
    overflow = FP16_OVERFLOW

    def encode(self, src, dst, xp=np, scratch=None, finite=False):
        if xp is np and _torch_cast(dst, src, "float16", "float32"):
            return
        with np.errstate(over="ignore"):   # beyond 65504: infinite (a push says so: overflows)
            xp.copyto(dst.view(xp.float16), src, casting="same_kind")

    def decode(self, src, dst, xp=np):
        if xp is np and _torch_cast(dst, src, "float32", "float16"):
            return
        xp.copyto(dst, src.view(xp.float16))


class Residual:
    """Error feedback for a worker's pushes: what rounding to the wire format took off one
    push's gradient is added to the next push's, so that the sum of what the stores receive
    stays within one rounding of the sum of the float32 gradients, however many pushes
    there are (rounding each push alone lets a value that always rounds the same way drift:
    1 + 2^-9 arrives as 1 in bf16, push after push). One float32 vector on the worker's
    device, three passes over it per push, no allocation.

    Args:
        fmt: the wire format (not fp32: nothing is rounded there).
        n: floats of the gradient; xp: the array module where it lies (numpy or CuPy).
    """

    def __init__(self, fmt: WireFormat, n: int, xp=np):
        self.fmt = fmt
        self.xp = xp
        self.carry = xp.zeros(n, dtype=xp.float32)   # rounding not yet sent
        self.scratch = fmt.scratch(n, xp)

    def encode(self, grad, dst, finite: bool = True) -> bool:
        """`grad` (float32, overwritten by grad + carry) -> `dst` in the wire format, and
        this push's rounding carried to the next. `finite`: `grad` holds no NaN or infinity.
        Returns True when a finite value became infinite on the wire. A push the stores
        reject (non-finite, or made so) leaves the carry as it was, for the next push."""
        xp, fmt = self.xp, self.fmt
        if finite:
            xp.add(grad, self.carry, out=grad)
        overflow = finite and fmt.overflows(grad)
        fmt.encode(grad, dst, xp, self.scratch, finite=finite)
        if finite and not overflow:
            fmt.decode(dst, self.carry, xp)                  # what the stores will read
            xp.subtract(grad, self.carry, out=self.carry)   # what it lacks (exact in float32)
        return overflow


def wire_format(name: str) -> WireFormat:
    """The format registered as `name`; UsageError (one line) for any other."""
    if name not in FORMATS:
        raise UsageError(f"--wire {name!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[name]()


def check_convertible(fmt: WireFormat, xp, where: str) -> None:
    """Convert a few values on the device (`xp`) both ways and compare them with numpy's
    result: UsageError naming `where` when the device cannot (or converts differently)."""
    if fmt.is_fp32:
        return
    probe = np.array([1.0, -2.5, 1 / 3, 1e-3, 65504.0, 3.0e38, np.inf, np.nan], np.float32)
    try:   # (on a CPU numpy is the device: its own failure is the device's)
        want = np.empty(probe.size, fmt.wire_dtype)
        fmt.encode(probe, want, np)
        back = np.empty(probe.size, np.float32)
        fmt.decode(want, back, np)
        src = xp.asarray(probe)
        enc = xp.empty(probe.size, fmt.wire_dtype)
        fmt.encode(src, enc, xp, fmt.scratch(probe.size, xp))
        dec = xp.empty(probe.size, np.float32)
        fmt.decode(enc, dec, xp)
        got, got_back = _host(enc), _host(dec)
    except Exception as exc:  # noqa: BLE001 - whatever the device lacks, the run cannot use it
        raise UsageError(f"--wire {fmt.name}: {where} cannot convert float32 to {fmt.name} "
                         f"({type(exc).__name__}: {exc}); use --wire fp32") from None
    if not (np.array_equal(got, want) and np.array_equal(got_back, back, equal_nan=True)):
        raise UsageError(f"--wire {fmt.name}: {where} converts float32 to {fmt.name} unlike "
                         f"numpy (round to nearest even); use --wire fp32")


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


# ------------------------------------------------------------------ messages
def state_offset(fmt: WireFormat, floats: int) -> int:
    """Byte offset of the float32 state after `floats` wire values in a message."""
    return wire.HEADER_BYTES + fmt.nbytes(floats)


def message_bytes(fmt: WireFormat, floats: int, state: int = 0) -> int:
    return state_offset(fmt, floats) + 4 * state


def views(buf, fmt: WireFormat, floats: int, state: int = 0) -> tuple:
    """(payload, state) views of a message buffer `buf` (uint8, host or device): `floats`
    wire values, then `state` float32 values."""
    at = state_offset(fmt, floats)
    payload = buf[wire.HEADER_BYTES:wire.HEADER_BYTES + fmt.itemsize * floats].view(fmt.wire_dtype)
    return payload, buf[at:at + 4 * state].view(np.float32)


def new_message(fmt: WireFormat, floats: int, state: int = 0) -> wire.MessageBuffer:
    """A host message of `floats` wire values and `state` float32 values (the payload
    view holds the wire values only; :func:`views` gives the state)."""
    buf = np.zeros(message_bytes(fmt, floats, state), dtype=np.uint8)
    return wire.MessageBuffer(buf, wire.header_view(buf), views(buf, fmt, floats)[0])


class EncodedParams:
    """A store's parameters in the wire format, encoded once per version and sent from
    there: a small ring of encoded copies, each kept until the sends reading it are done.

    Args:
        fmt: the wire format (not fp32: replies then go straight from the parameters).
        n: floats of the parameters (a store's slice).
        finished: request -> whether a send is done (comm.finished).
    """

    def __init__(self, fmt: WireFormat, n: int, finished):
        self.fmt = fmt
        self.n = n
        self.finished = finished
        self.scratch = fmt.scratch(n, np)
        self.bufs: list = []
        self.versions: list[int] = []
        self.sends: list[list] = []
        self.cur = -1
        self.encodes = 0   # conversions so far (a test counts them)

    def forget(self) -> None:
        """The parameters were replaced without a new version (start, resume): encode anew."""
        self.versions = [-1] * len(self.versions)
        self.cur = -1

    def of(self, params: np.ndarray, version: int) -> np.ndarray:
        """The wire copy of `params` at `version` (encoded now unless it already is)."""
        if self.cur >= 0 and self.versions[self.cur] == version:
            return self.bufs[self.cur]
        buf = self.begin(version)
        self.fmt.encode(params, buf, np, self.scratch)
        return buf

    def begin(self, version: int) -> np.ndarray:
        """A free copy for `version` (no send reads it), which becomes the current copy:
        :meth:`of` encodes into it whole, a store that answers chunk by chunk
        (mpi/chunks.py) fills it with :meth:`encode_range` as it steps."""
        free = None
        for i in range(len(self.bufs)):
            self.sends[i] = [r for r in self.sends[i] if not self.finished(r)]
            if not self.sends[i]:
                free = i
                break
        if free is None:
            self.bufs.append(np.empty(self.n, self.fmt.wire_dtype))
            self.versions.append(-1)
            self.sends.append([])
            free = len(self.bufs) - 1
        self.versions[free], self.cur = version, free
        self.encodes += 1
        return self.bufs[free]

    def encode_range(self, params: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Values [lo, hi) of `params` into the copy :meth:`begin` gave; returns them."""
        dst = self.bufs[self.cur][lo:hi]
        scratch = None if self.scratch is None else self.scratch[:hi - lo]
        self.fmt.encode(params[lo:hi], dst, np, scratch)
        return dst

    def sending(self, req) -> None:
        """`req` (a send of the copy :meth:`of` returned last) reads it until it completes."""
        self.sends[self.cur].append(req)

    def pending(self) -> list:
        """Sends still reading some copy (to wait for at the end)."""
        return [r for reqs in self.sends for r in reqs]
