"""The push side of a worker: what a push carries besides the gradient (the timings since the
last one), the push buffers and the sends still in flight."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

from mpilb.mpi import comm as C
from mpilb.mpi import chunks, wire, wire_format
from mpilb.mpi.waiting import WaitEstimate
from mpilb.worker.messages import DeviceMessages


@dataclass
class Computed:
    """A gradient computed into a push buffer, not yet pushed."""

    batch: object
    loss: float
    compute_s: float
    nonfinite: bool
    version: int        # parameters it was computed on (pipelined: older than the latest)
    predicted: tuple = (0.0, -1)   # (factor, from version) of the weight prediction, if any


class TimeSincePush:
    """Where a worker's time went since its last push, reported in the next push's header.

    Communication and idle seconds accumulate between pushes; I/O is the feed's running total,
    reported as its growth since the last report. `reply_wait` learns how long the server
    holds a reply, so that the worker wakes up just in time for it.
    """

    def __init__(self):
        self.comm_s = self.idle_s = 0.0
        self.io_reported = 0.0
        self.reply_wait = WaitEstimate()   # push -> reply

    def reply_window(self, counts_as_idle: bool) -> tuple[Optional[float], float]:
        """(due, grace) for the wait for the server's next message."""
        return (None, 0.0) if counts_as_idle else self.reply_wait.window(time.monotonic())

    def waited(self, waited: float, held: float, counts_as_idle: bool) -> None:
        """Account a wait for the server's message (`held`: the server's hold of the reply)."""
        if counts_as_idle:
            self.idle_s += waited
        else:
            # the server's hold, not `waited`: that includes this rank's own lateness, and
            # waking later for having woken late would feed on itself
            self.reply_wait.update(held)
            self.idle_s += min(held, waited)
            self.comm_s += max(0.0, waited - held)

    def report(self, io_total: float) -> dict:
        """The push header's timing fields; starts the next interval."""
        fields = dict(io_s=io_total - self.io_reported, comm_s=self.comm_s, idle_s=self.idle_s)
        self.io_reported = io_total
        self.comm_s = self.idle_s = 0.0
        return fields


PAUSE_ENV = "MPILB_TEST_PUSH_PAUSE"
"""A test hook, ``N:S``: the worker's push number N sends its header, then waits S seconds
before its chunks (a worker that stops part-way through a push; tests/mpi)."""


def _pause_at() -> tuple[int, float]:
    step, _, seconds = os.environ.get(PAUSE_ENV, "").partition(":")
    return (int(step), float(seconds)) if step.isdigit() and seconds else (-1, 0.0)


def send_slices(comm, msg: wire.MessageBuffer, stores, bounds, plans, head_bytes: int,
                pause: float = 0.0) -> list:
    """Send every store its slice of the push in `msg` at once, each in the chunks of its
    plan (mpi/chunks.py) or as one message; rank 0 gets the header with its slice (with one
    store, followed by the model's state: the server keeps the latest), or the header
    alone, before its chunks. Returns the requests."""
    payload, b = msg.payload, bounds
    if plans[0] is not None:   # the header alone first: rank 0 decides while the bytes come
        reqs = [comm.Isend(msg.buf[:head_bytes], dest=0, tag=wire.TAG_PUSH)]
        if pause:
            time.sleep(pause)
        reqs += [comm.Isend(payload[lo:hi], dest=0, tag=wire.TAG_GRAD) for lo, hi in plans[0]]
    else:
        reqs = []
    for s, r in enumerate(stores):
        if s == 0:
            continue
        for lo, hi in plans[s] or chunks.whole(b[s + 1] - b[s]):
            reqs.append(comm.Isend(payload[b[s] + lo:b[s] + hi], dest=r, tag=wire.TAG_GRAD))
    if plans[0] is None:
        reqs.append(comm.Isend(msg.buf[:head_bytes], dest=0, tag=wire.TAG_PUSH))
    return reqs


class Pushes:
    """A worker's pushes: [header | gradient slice 0 (| model state)] to rank 0 and each
    other store's slice to it (--servers K), from one of the push buffers (two with
    --pipeline 1, so that one can be in flight while the next gradient is computed into the
    other).

    Args:
        comm: the world communicator.
        messages: where the buffers live (host, device, pinned host).
        floats: the gradient's length; num_state: the model's state floats after it.
        stores: the store ranks; bounds: store s holds parameters [bounds[s], bounds[s+1]).
        bell: rank 0's doorbell (doorbell.py), rung with each push.
        pipelined: --pipeline 1.
        on_poll: called while a send is finished (the watch on rank 0's silence: a store
            gone mid-transfer would keep the send from ever completing).
        fmt: the wire format (--wire): with fp32 the gradient is computed straight into the
            payload (on the CPU) and nothing is converted.
    """

    def __init__(self, comm, messages: DeviceMessages, floats: int, num_state: int, stores,
                 bounds, bell, pipelined: bool, on_poll=None,
                 fmt: wire_format.WireFormat = wire_format.Float32(), plans=None):
        self.comm = comm
        # per store: its slice's chunks (mpi/chunks.py), or None: one message
        self.plans = list(plans) if plans is not None else [None] * len(stores)
        self.on_poll = on_poll
        self.messages = messages
        self.num_state = num_state
        self.stores = stores
        self.bounds = bounds
        self.bell = bell
        self.fmt = fmt
        count = 2 if pipelined else 1
        # a push carries the gradient, then the model's state (e.g. BatchNorm statistics)
        if fmt.is_fp32:
            self.bufs = [messages.new(floats + num_state) for _ in range(count)]
            self.states = [m.payload[floats:] for m in self.bufs]
            self.staging = self.residual = None
        else:   # the wire values, then the state in float32
            made = [messages.new_wire(fmt, floats, num_state) for _ in range(count)]
            self.bufs = [m for m, _, _ in made]
            self.states = [st for _, st, _ in made]
            self.staging = made[0][2]   # device wire values, copied to the host buffer
            # each push's rounding goes with the next (error feedback): one float32 vector
            self.residual = wire_format.Residual(fmt, floats, messages.backend.xp)
        # rank 0 takes the header with slice 0 (with one store, followed by the state)
        if self.plans[0] is not None:   # the header alone, then rank 0's chunks
            self.head_bytes = wire.HEADER_BYTES
        elif len(bounds) == 2:
            self.head_bytes = wire_format.message_bytes(fmt, floats, num_state)
        else:
            self.head_bytes = wire.HEADER_BYTES + fmt.itemsize * bounds[1]
        self.reqs: list = []
        self.step = 0   # pushes so far
        self.pause = _pause_at()   # (a test hook: PAUSE_ENV)

    def state_of(self, msg: wire.MessageBuffer):
        """Where the model's state floats go in push buffer `msg`."""
        return self.states[0 if msg is self.bufs[0] else 1]

    def encode(self, grad, msg: wire.MessageBuffer, finite: bool) -> bool:
        """The float32 mean gradient `grad` (a backend array; it gains the rounding left
        over from the last push, wire_format.Residual) into `msg`'s payload in the wire
        format, converted where it lies (on a GPU: then copied to the host buffer).
        Returns True when a finite value became infinite (fp16 beyond 65504): the push
        must say it is not finite, as the server would otherwise apply it."""
        dst = msg.payload if self.staging is None else self.staging
        overflow = self.residual.encode(grad, dst, finite=finite)
        if self.staging is not None:
            self.messages.backend.to_host(self.staging, out=msg.payload)
        return overflow

    def send(self, msg: wire.MessageBuffer, done: Computed, next_range, t: float,
             timings: dict) -> float:
        """Push `done` from `msg` (`t`: the worker's clock; `timings`: TimeSincePush.report).
        Returns the seconds the push took this rank (communication)."""
        batch = done.batch
        wire.encode_push(msg.header, step=self.step, version=done.version, epoch=batch.epoch,
                         shard=batch.shard, lo=batch.lo, hi=batch.hi, batch=batch.size,
                         loss=done.loss, compute_s=done.compute_s, nonfinite=done.nonfinite,
                         t=t, next_range=next_range, predicted=done.predicted, **timings)
        t0 = time.perf_counter()
        self.settle()
        self.messages.header_to_buffer(msg)
        self.reqs = send_slices(self.comm, msg, self.stores, self.bounds, self.plans,
                                self.head_bytes,
                                self.pause[1] if self.step == self.pause[0] else 0.0)
        self.bell.ring(0)
        self.step += 1
        # Not waited for here: the receivers have receives posted and, with MPICH's
        # shared-memory transport, fetch the message themselves (a rendezvous read), so
        # spinning on it would only take a core from the server that is to read it (where
        # the sender must move it, it moves at this rank's next MPI call: pipelined, after
        # the compute). The push is complete once its reply has come (settle), or at the
        # latest before its buffer is written again.
        C.Request.Testall(self.reqs)
        return time.perf_counter() - t0

    def settle(self) -> None:
        """The server replied to the last push, so it has it: finish the sends' requests."""
        for req in self.reqs:
            C.complete(req, self.on_poll)
        self.reqs = []

    def finish(self) -> None:
        """At the end of the run: the last push's sends, waited for a few seconds at most."""
        for req in self.reqs:
            C.wait(req, timeout=5.0)
