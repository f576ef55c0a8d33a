"""The wire protocol between the server and the workers: the only code that indexes a header.

Every message is one contiguous byte buffer: a fixed-size float64 header followed by a float32
payload (a gradient or the parameters), so a push or a pull is one buffer message and nothing
is pickled in the hot path. This module names the header slots, the tags and the commands,
and encodes and decodes each kind of message into preallocated views. It imports numpy only:
the server, the worker and the benchmark all use it, and tests pin its encoding byte for byte.

Messages, per worker w (DESIGN.md):
  w -> server  PUSH    [header | gradient]  positions [lo, hi) of a shard it covered, timings
  server -> w  REPLY   [header | params]    version, batch size, tasks, send orders, a cut
  server -> w  ORDERS  [header]             rows to send, for a worker waiting on a reply
  server -> w  STOP    [header]             finish
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple, Optional, Sequence

import numpy as np

HEADER_FIELDS = 48
HEADER_BYTES = HEADER_FIELDS * 8

# Tags. PUSH: worker -> server gradient; REPLY: server -> worker parameters or command;
# ERROR: a worker's exception text (pickled, rare); SHARD: samples sent between workers.
TAG_PUSH = 11
TAG_REPLY = 12
TAG_ERROR = 13
TAG_PREEMPT = 15
TAG_SHARD_BASE = 1000   # shard rows between workers: tag and tag+1 (samples, labels)
SHARD_TAGS = 10000      # transfer tags cycle through this many pairs


class Push(IntEnum):
    """Header slots of a worker -> server push (float64)."""

    KIND = 0          # PushKind
    STEP = 1          # worker's step counter (pushes so far)
    VERSION = 2       # server version the gradient was computed on
    EPOCH = 3
    SHARD = 4
    LO = 5            # sample positions [LO, HI) of the shard's permuted order
    HI = 6
    BATCH = 7
    LOSS = 8          # loss summed over the batch
    COMPUTE_S = 9     # since the previous push
    IO_S = 10
    COMM_S = 11
    IDLE_S = 12
    NEXT_SHARD = 13   # pipeline: the batch already being computed (-1 if none)
    NEXT_LO = 14
    NEXT_HI = 15
    NEXT_EPOCH = 16
    NONFINITE = 17    # 1 if the gradient holds NaN/Inf (payload not to be applied)
    T = 18            # worker wall clock (seconds since training start)


class PushKind(IntEnum):
    GRAD = 1


class Reply(IntEnum):
    """Header slots of a server -> worker reply (float64)."""

    CMD = 0           # Cmd
    VERSION = 1       # version of the parameters in the payload
    BATCH = 2         # batch size to use from now on
    HELD_S = 3        # seconds the server held this reply (ssp/sync wait): idle, not comm
    RETRY = 4         # 1: the last gradient was rejected (non-finite); recompute the batch once
    N_ASSIGN = 5      # tasks handed to the worker: epoch, shard, start, end, src, tag
    ASSIGN = 6        # src -1: read from own store; else receive rows from rank src (tag)
    N_ORDER = 18      # rows this worker must send: epoch, shard, start, end, dst, tag
    ORDER = 19
    TRUNC_EPOCH = 31  # stop the task on this shard at TRUNC_END (the rest went elsewhere)
    TRUNC_SHARD = 32
    TRUNC_END = 33
    DROP = 34         # 1: forget every task held (the server took them back: sit rounds out)


class Cmd(IntEnum):
    PARAMS = 1        # payload holds parameters; carry on
    STOP = 2          # finish: no payload
    ORDERS = 3        # header only, not a reply: send these rows, then keep waiting


TASK_FIELDS = 6       # per assignment / per send order
MAX_ASSIGN = 2
MAX_ORDER = 2


class TaskMsg(NamedTuple):
    """A task handed to a worker: positions [start, end) of a shard's order in an epoch.
    `src` -1: read the rows from its own store; else receive them from rank `src` (`tag`)."""

    epoch: int
    shard: int
    start: int
    end: int
    src: int = -1
    tag: int = 0


class OrderMsg(NamedTuple):
    """Rows [start, end) of a shard a worker must send to rank `dst` with `tag`."""

    epoch: int
    shard: int
    start: int
    end: int
    dst: int
    tag: int


class Cut(NamedTuple):
    """Stop the task on (epoch, shard) at position `end`: the rest went elsewhere."""

    epoch: int
    shard: int
    end: int


class PushMsg(NamedTuple):
    """A decoded push header."""

    step: int
    version: int
    epoch: int
    shard: int
    lo: int
    hi: int
    batch: int
    loss: float
    compute_s: float
    io_s: float
    comm_s: float
    idle_s: float
    next_epoch: int
    next_shard: int
    next_lo: int
    next_hi: int
    nonfinite: bool
    t: float


class ReplyMsg(NamedTuple):
    """A decoded reply (or ORDERS, or STOP) header."""

    cmd: Cmd
    version: int
    batch: int
    held_s: float
    retry: bool
    drop: bool
    assigns: list
    orders: list
    cut: Optional[Cut]


def new_message(payload_floats: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Allocate one message buffer and its header/payload views.

    Returns:
        (buf, header, payload): `buf` uint8 of HEADER_BYTES + 4*payload_floats bytes,
        `header` float64 view of its first HEADER_FIELDS slots, `payload` float32 view of
        the rest.
    """
    buf = np.zeros(HEADER_BYTES + 4 * payload_floats, dtype=np.uint8)
    return buf, header_view(buf), buf[HEADER_BYTES:].view(np.float32)


def header_view(buf: np.ndarray) -> np.ndarray:
    """The float64 header slots at the start of a host message buffer."""
    return buf[:HEADER_BYTES].view(np.float64)


def new_header() -> np.ndarray:
    """A header on its own (e.g. the host copy of a header whose buffer is on a GPU)."""
    return np.zeros(HEADER_FIELDS, np.float64)


# ------------------------------------------------------------------ push
def encode_push(hdr: np.ndarray, *, step: int, version: int, epoch: int, shard: int, lo: int,
                hi: int, batch: int, loss: float, compute_s: float, io_s: float, comm_s: float,
                idle_s: float, nonfinite: bool, t: float,
                next_range: Optional[Sequence[int]] = None) -> None:
    """Write a push header. `next_range`: (epoch, shard, lo, hi) of the batch being computed
    while this push travels (--pipeline 1), None if none."""
    hdr[:] = 0
    hdr[Push.KIND] = PushKind.GRAD
    hdr[Push.STEP] = step
    hdr[Push.VERSION] = version
    hdr[Push.EPOCH] = epoch
    hdr[Push.SHARD] = shard
    hdr[Push.LO] = lo
    hdr[Push.HI] = hi
    hdr[Push.BATCH] = batch
    hdr[Push.LOSS] = loss
    hdr[Push.COMPUTE_S] = compute_s
    hdr[Push.IO_S] = io_s
    hdr[Push.COMM_S] = comm_s
    hdr[Push.IDLE_S] = idle_s
    hdr[Push.NONFINITE] = 1 if nonfinite else 0
    hdr[Push.NEXT_SHARD] = -1
    if next_range is not None:
        hdr[Push.NEXT_EPOCH], hdr[Push.NEXT_SHARD], hdr[Push.NEXT_LO], hdr[Push.NEXT_HI] = next_range
    hdr[Push.T] = t


def decode_push(hdr: np.ndarray) -> PushMsg:
    v = hdr[:Push.T + 1].tolist()
    return PushMsg(step=int(v[Push.STEP]), version=int(v[Push.VERSION]), epoch=int(v[Push.EPOCH]),
                   shard=int(v[Push.SHARD]), lo=int(v[Push.LO]), hi=int(v[Push.HI]),
                   batch=int(v[Push.BATCH]), loss=v[Push.LOSS], compute_s=v[Push.COMPUTE_S],
                   io_s=v[Push.IO_S], comm_s=v[Push.COMM_S], idle_s=v[Push.IDLE_S],
                   next_epoch=int(v[Push.NEXT_EPOCH]), next_shard=int(v[Push.NEXT_SHARD]),
                   next_lo=int(v[Push.NEXT_LO]), next_hi=int(v[Push.NEXT_HI]),
                   nonfinite=bool(v[Push.NONFINITE]), t=v[Push.T])


# ------------------------------------------------------------------ reply, orders, stop
def _put_rows(hdr: np.ndarray, count_slot: int, first_slot: int, rows: Sequence, limit: int) -> None:
    if len(rows) > limit:
        raise ValueError(f"{len(rows)} rows in one header (at most {limit})")
    hdr[count_slot] = len(rows)
    n = TASK_FIELDS
    for i, row in enumerate(rows):
        hdr[first_slot + n * i: first_slot + n * (i + 1)] = row


def _get_rows(hdr: np.ndarray, count_slot: int, first_slot: int, kind) -> list:
    n = TASK_FIELDS
    count = int(hdr[count_slot])
    return [kind(*(int(v) for v in hdr[first_slot + n * i: first_slot + n * (i + 1)]))
            for i in range(count)]


def encode_reply(hdr: np.ndarray, cmd: Cmd, *, version: int, batch: int, held_s: float = 0.0,
                 retry: bool = False, drop: bool = False, assigns: Sequence = (),
                 orders: Sequence = (), cut: Optional[Sequence[int]] = None) -> None:
    """Write a reply header (Cmd.PARAMS with parameters to follow, or Cmd.STOP).

    `assigns`: at most MAX_ASSIGN (epoch, shard, start, end, src, tag); `orders`: at most
    MAX_ORDER (epoch, shard, start, end, dst, tag); `cut`: (epoch, shard, end) or None.
    A STOP carries no tasks, orders or cut.
    """
    hdr[:] = 0
    hdr[Reply.CMD] = cmd
    hdr[Reply.VERSION] = version
    hdr[Reply.BATCH] = batch
    hdr[Reply.HELD_S] = held_s
    hdr[Reply.RETRY] = 1 if retry else 0
    hdr[Reply.DROP] = 1 if drop else 0
    if cmd == Cmd.STOP:
        return
    _put_rows(hdr, Reply.N_ASSIGN, Reply.ASSIGN, assigns, MAX_ASSIGN)
    _put_rows(hdr, Reply.N_ORDER, Reply.ORDER, orders, MAX_ORDER)
    if cut is not None:
        hdr[Reply.TRUNC_EPOCH], hdr[Reply.TRUNC_SHARD], hdr[Reply.TRUNC_END] = cut


def encode_orders(hdr: np.ndarray, orders: Sequence) -> None:
    """Write an ORDERS header: rows to send, for a worker that waits for its reply."""
    hdr[:] = 0
    hdr[Reply.CMD] = Cmd.ORDERS
    _put_rows(hdr, Reply.N_ORDER, Reply.ORDER, orders, MAX_ORDER)


def command(hdr: np.ndarray) -> Cmd:
    """The command of a server -> worker header."""
    return Cmd(int(hdr[Reply.CMD]))


def decode_orders(hdr: np.ndarray) -> list[OrderMsg]:
    return _get_rows(hdr, Reply.N_ORDER, Reply.ORDER, OrderMsg)


def decode_reply(hdr: np.ndarray) -> ReplyMsg:
    """Decode a server -> worker header (PARAMS, ORDERS or STOP)."""
    cut = None
    if hdr[Reply.TRUNC_END] > 0 or hdr[Reply.TRUNC_SHARD] > 0:
        cut = Cut(int(hdr[Reply.TRUNC_EPOCH]), int(hdr[Reply.TRUNC_SHARD]), int(hdr[Reply.TRUNC_END]))
    return ReplyMsg(cmd=command(hdr), version=int(hdr[Reply.VERSION]), batch=int(hdr[Reply.BATCH]),
                    held_s=float(hdr[Reply.HELD_S]), retry=bool(hdr[Reply.RETRY]),
                    drop=bool(hdr[Reply.DROP]),
                    assigns=_get_rows(hdr, Reply.N_ASSIGN, Reply.ASSIGN, TaskMsg),
                    orders=decode_orders(hdr), cut=cut)
