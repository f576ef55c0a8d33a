"""The wire protocol between the server and the workers: the only code that indexes a header.

Every message is one contiguous byte buffer: a fixed-size float64 header followed by a float32
payload (a gradient or the parameters), so a push or a pull is one buffer message and nothing
is pickled in the hot path. This module names the header slots, the tags and the commands,
and encodes and decodes each kind of message into preallocated views. It imports numpy only:
the server, the worker and the benchmark all use it, and tests pin its encoding byte for byte.

Messages, per worker w (docs/architecture.md, "Messages"):
  w -> server  PUSH    [header | gradient]  positions [lo, hi) of a shard it covered, timings
  server -> w  REPLY   [header] + PARAMS    version, batch size, tasks, send orders, a cut;
                                            then the parameters, one message per store
  server -> w  ORDERS  [header]             rows to send, for a worker waiting on a reply
  server -> w  STOP    [header]             finish

With --servers K, ranks 0..K-1 each hold a contiguous slice of the parameters (`slices`):
a push goes to rank 0 as [header | slice 0] and to store s > 0 as its slice (TAG_GRAD);
each store sends its slice of the reply (TAG_PARAMS) when rank 0 tells it to (TAG_CTRL,
`encode_ctrl`). With K = 1 a push is [header | gradient] as it always was.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

HEADER_FIELDS = 48
HEADER_BYTES = HEADER_FIELDS * 8

# Tags. PUSH: worker -> server gradient; REPLY: server -> worker parameters or command;
# ERROR: a worker's exception text (pickled, rare); SHARD: samples sent between workers.
TAG_PUSH = 11
TAG_REPLY = 12
TAG_ERROR = 13
TAG_PARAMS = 14    # store -> worker: its slice of the parameters, after a PARAMS reply header
TAG_PREEMPT = 15
TAG_GRAD = 16      # worker -> store s > 0: its slice of the gradient
TAG_CTRL = 17      # rank 0 -> store s > 0: what to do next (Op)
TAG_GATHER = 18    # store s > 0 <-> rank 0: a slice and its optimizer state (gather, load)
TAG_STATS = 19     # store s > 0 -> rank 0: its counters (STATS_FIELDS)
TAG_LEAVE = 20     # rank 0 -> the others: end now, with this exit code (comm.tell_leave)
TAG_END = 21       # the end of the job: every rank -> rank 0 "done", rank 0 -> them "go" (mpi/departure.py)
TAG_READY = 22     # a replacement (--respawn) -> rank 0: "my data and model are ready" (mpi/spawning.py)
TAG_SHARD_BASE = 1000   # shard rows between workers: tag and tag+1 (samples, labels)
SHARD_TAGS = 10000      # transfer tags cycle through this many pairs
# Rows sent again by another holder when the first was lost: a range of their own above the
# ordinary transfers (below 32767, the least MPI_TAG_UB a library may have).
RESOURCE_TAG_BASE = TAG_SHARD_BASE + 2 * SHARD_TAGS


def resource_tag(tag: int) -> int:
    """The tag another holder sends rows with when the one ordered with `tag` was lost."""
    if tag >= RESOURCE_TAG_BASE:
        return tag   # already re-sourced: each holder still has its own (source, tag) pair
    return RESOURCE_TAG_BASE + (tag - TAG_SHARD_BASE) % SHARD_TAGS


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
    PRED_F = 19       # computed on w_v + PRED_F (w_v - w_from) (weight prediction); PRED_FROM:
    PRED_FROM = 20    # from + 1 (0: on w_v itself, as before the slots existed)


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
    CUT_EPOCH = 31    # stop the task on this shard at CUT_END (the rest went elsewhere)
    CUT_SHARD = 32
    CUT_END = 33
    DROP = 34         # 1: forget every task held (the server took them back: sit rounds out)
    HAS_CUT = 35      # 1: CUT_* hold a cut (a cut at position 0 of shard 0 is all zeros)
    STREAMED = 36     # 1: the parameters were sent as the gradient was applied (Op.STREAM):
                      # they come even after a STOP or LEAVE header


class Cmd(IntEnum):
    PARAMS = 1        # payload holds parameters; carry on
    STOP = 2          # finish: no payload
    ORDERS = 3        # header only, not a reply: send these rows, then keep waiting
    LEAVE = 4         # finish alone: this worker leaves, the run goes on (no payload)


TASK_FIELDS = 6       # per assignment / per send order
MAX_ASSIGN = 2
MAX_ORDER = 2


class Op(IntEnum):
    """Commands of rank 0 to a store s > 0 (a CTRL message), carried out in order."""

    APPLY = 1         # apply worker RANK's gradient slice (BATCH, STALENESS, VERSION it used)
    ADD = 2           # add it to the sync round (weighted by BATCH)
    DISCARD = 3       # take it and drop it (stray, rejected, or the run is stopping)
    ROUND = 4         # apply the round's sum over BATCH samples
    REPLY = 5         # send worker RANK the current slice (TAG_PARAMS)
    LOSE = 6          # worker RANK is lost: stop listening to it
    GATHER = 7        # send rank 0 the slice (and with BATCH 1 the optimizer state)
    STATS = 8         # send rank 0 the counters (updates, bytes in/out, apply_s, cpu_s)
    END = 9           # the run is over: send the counters and finish
    LOAD = 10         # receive the slice and the optimizer state from rank 0 (resume)
    ACCEPT = 11       # take part in rank 0's accept of joiner RANK (BATCH: the timeout, s)
    STREAM = 12       # apply RANK's gradient slice as APPLY, answering it as it goes: each
                      # chunk of the new slice sent to RANK once stepped (mpi/chunks.py)


class Ctrl(IntEnum):
    OP = 0
    RANK = 1
    BATCH = 2
    STALENESS = 3
    VERSION = 4
    LR = 5            # rank 0's schedule factor for APPLY and ROUND, stored as factor - 1
    PRED_F = 6        # APPLY/STREAM: the push's weight prediction (Push.PRED_F, PRED_FROM)
    PRED_FROM = 7


CTRL_FIELDS = 8
STATS_FIELDS = 6      # updates, bytes_in, bytes_out, apply_s, cpu_s, version


class CtrlMsg(NamedTuple):
    op: Op
    rank: int
    batch: int
    staleness: int
    version: int
    lr: float = 1.0
    predicted: tuple = (0.0, -1)


def encode_ctrl(buf: np.ndarray, op: Op, rank: int = -1, batch: int = 0, staleness: int = 0,
                version: int = 0, lr: float = 1.0, predicted: tuple[float, int] = (0.0, -1)) -> None:
    """Write a CTRL message into `buf` (float64, CTRL_FIELDS). `lr` is stored as lr - 1 (and
    PRED_FROM + 1): a message without them is byte-identical to one from before the slots."""
    buf[:] = 0
    buf[Ctrl.OP], buf[Ctrl.RANK], buf[Ctrl.BATCH] = op, rank, batch
    buf[Ctrl.STALENESS], buf[Ctrl.VERSION], buf[Ctrl.LR] = staleness, version, lr - 1.0
    buf[Ctrl.PRED_F], buf[Ctrl.PRED_FROM] = predicted[0], predicted[1] + 1


def decode_ctrl(buf: np.ndarray) -> CtrlMsg:
    v = buf[:Ctrl.PRED_FROM + 1].tolist()
    return CtrlMsg(Op(int(v[Ctrl.OP])), int(v[Ctrl.RANK]), int(v[Ctrl.BATCH]),
                   int(v[Ctrl.STALENESS]), int(v[Ctrl.VERSION]), 1.0 + v[Ctrl.LR],
                   (v[Ctrl.PRED_F], int(v[Ctrl.PRED_FROM]) - 1))


def layer_sizes(model) -> list[int]:
    """Floats per parameter array of `model`, from its layout ((name, shape) pairs; an
    attribute or a method), [] when it has none."""
    layout = getattr(model, "layout", ())
    if callable(layout):
        layout = layout()
    return [int(np.prod(shape)) for _, shape in layout]


def cut_slices(n: int, k: int, layer_sizes: Sequence[int] = (), tolerance: float = 0.05) -> list[int]:
    """Bounds [0, b1, ..., n] of k contiguous slices of an n-float vector, as even as can be.

    A cut moves to the nearest layer boundary (from `layer_sizes`, which sum to n) when that
    keeps every slice within `tolerance` of n/k floats; otherwise it stays at the even point.
    """
    if not 1 <= k <= n:
        raise ValueError(f"{k} slices of {n} parameters")
    edges = np.cumsum([0, *layer_sizes]).tolist() if sum(layer_sizes) == n else [0, n]
    ideal = n / k
    even = [round(i * n / k) for i in range(k + 1)]
    bounds = list(even)
    for i in range(1, k):
        near = min(edges, key=lambda e: abs(e - even[i]))
        if abs(near - even[i]) <= tolerance * ideal:
            bounds[i] = near
    limit = max((1 + tolerance) * ideal, max(b - a for a, b in zip(even, even[1:])))
    while bounds != even:   # a slice grown past the tolerance by two moved ends: put them back
        over = [i for i in range(k) if bounds[i + 1] - bounds[i] > limit or bounds[i + 1] <= bounds[i]]
        if not over:
            break
        for i in over:
            bounds[i], bounds[i + 1] = even[i], even[i + 1]
    return bounds


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
    predicted: tuple = (0.0, -1)   # (factor, from version): Push.PRED_F


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
    streamed: bool = False   # the parameters were sent with the step (Reply.STREAMED)


class MessageBuffer(NamedTuple):
    """One message buffer and its views: `buf` is what MPI sends or receives (uint8, on the
    host or a GPU), `header` its float64 header slots (on the host: a GPU buffer's header
    is a copy), `payload` its float32 payload (a gradient or parameters). A tuple, so that
    ``buf, header, payload = msg`` unpacks it."""

    buf: Any
    header: np.ndarray
    payload: Any


def new_message(payload_floats: int) -> MessageBuffer:
    """Allocate one host message buffer and its views: `buf` uint8 of HEADER_BYTES +
    4*payload_floats bytes, `header` float64 view of its first HEADER_FIELDS slots,
    `payload` float32 view of the rest."""
    buf = np.zeros(HEADER_BYTES + 4 * payload_floats, dtype=np.uint8)
    return MessageBuffer(buf, header_view(buf), buf[HEADER_BYTES:].view(np.float32))


def message_of(payload: np.ndarray) -> MessageBuffer:
    """The message buffer a payload view (or a leading part of one, from
    :func:`new_message`) lies in: a buffer that held parameters can receive a push again."""
    buf = payload.base
    if buf is None or buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes < HEADER_BYTES:
        raise ValueError("not the payload of a message buffer from new_message()")
    return MessageBuffer(buf, header_view(buf), buf[HEADER_BYTES:].view(np.float32))


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
                next_range: Optional[Sequence[int]] = None,
                predicted: tuple[float, int] = (0.0, -1)) -> None:
    """Write a push header. `next_range`: (epoch, shard, lo, hi) of the batch computed while
    this push travels (--pipeline 1), or None; `predicted`: prediction.py's (factor, from)."""
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
    hdr[Push.PRED_F], hdr[Push.PRED_FROM] = predicted[0], predicted[1] + 1


def clear_push(hdr: np.ndarray) -> None:
    """Mark a push buffer as not received (before its receive is posted): see holds_push."""
    hdr[Push.KIND] = 0


def holds_push(hdr: np.ndarray) -> bool:
    """True if a push arrived in the buffer since :func:`clear_push`. A receive MPI failed
    may come back freed (MPI_REQUEST_NULL, which tests as complete) with nothing in it."""
    return hdr[Push.KIND] == PushKind.GRAD


def decode_push(hdr: np.ndarray) -> PushMsg:
    v = hdr[:Push.PRED_FROM + 1].tolist()
    return PushMsg(step=int(v[Push.STEP]), version=int(v[Push.VERSION]), epoch=int(v[Push.EPOCH]),
                   shard=int(v[Push.SHARD]), lo=int(v[Push.LO]), hi=int(v[Push.HI]),
                   batch=int(v[Push.BATCH]), loss=v[Push.LOSS], compute_s=v[Push.COMPUTE_S],
                   io_s=v[Push.IO_S], comm_s=v[Push.COMM_S], idle_s=v[Push.IDLE_S],
                   next_epoch=int(v[Push.NEXT_EPOCH]), next_shard=int(v[Push.NEXT_SHARD]),
                   next_lo=int(v[Push.NEXT_LO]), next_hi=int(v[Push.NEXT_HI]),
                   nonfinite=bool(v[Push.NONFINITE]), t=v[Push.T],
                   predicted=(v[Push.PRED_F], int(v[Push.PRED_FROM]) - 1))


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
                 orders: Sequence = (), cut: Optional[Sequence[int]] = None,
                 streamed: bool = False) -> None:
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
    hdr[Reply.STREAMED] = 1 if streamed else 0
    if cmd in (Cmd.STOP, Cmd.LEAVE):
        return
    _put_rows(hdr, Reply.N_ASSIGN, Reply.ASSIGN, assigns, MAX_ASSIGN)
    _put_rows(hdr, Reply.N_ORDER, Reply.ORDER, orders, MAX_ORDER)
    if cut is not None:
        hdr[Reply.CUT_EPOCH], hdr[Reply.CUT_SHARD], hdr[Reply.CUT_END] = cut
        hdr[Reply.HAS_CUT] = 1


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
    if hdr[Reply.HAS_CUT]:
        cut = Cut(int(hdr[Reply.CUT_EPOCH]), int(hdr[Reply.CUT_SHARD]), int(hdr[Reply.CUT_END]))
    return ReplyMsg(cmd=command(hdr), version=int(hdr[Reply.VERSION]), batch=int(hdr[Reply.BATCH]),
                    held_s=float(hdr[Reply.HELD_S]), retry=bool(hdr[Reply.RETRY]),
                    drop=bool(hdr[Reply.DROP]),
                    assigns=_get_rows(hdr, Reply.N_ASSIGN, Reply.ASSIGN, TaskMsg),
                    orders=decode_orders(hdr), cut=cut, streamed=bool(hdr[Reply.STREAMED]))
