"""A worker rank: compute gradients on assigned shards and push them to the server.

The loop reads like the protocol (wire.py): push [header | gradient], wait for the
reply [header | parameters], take the assignments it carries, repeat; with nothing to do,
wait for the server's next message. With --pipeline 1 the next gradient is computed on the
parameters at hand while the previous push is in flight.

GPU workers compute on CuPy arrays and synchronise the stream before MPI touches memory;
without CUDA-aware MPI (the default) gradients and parameters are staged through pinned host
buffers, one copy each way per step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import comm as C
from .backend import select_backend
from .batches import GradientStep, ShardFeed
from .inject import Injector, parse_injects
from .shards import ShardStore, placement
from .training import PREEMPTED, config_model
from . import wire
from .wire import Cmd


class StopWorker(Exception):
    pass


@dataclass
class Computed:
    """A gradient computed into a push buffer, not yet pushed."""

    batch: object
    loss: float
    compute_s: float
    nonfinite: bool
    version: int        # parameters it was computed on (pipelined: older than the latest)


class RemoteRows:
    """Rows of a shard arriving from the rank that holds them (posted at assignment time)."""

    def __init__(self, comm, src: int, tag: int, rows: int, sample_shape, backoff,
                 y_dtype="int64", target_shape=()):
        self.x = np.empty((rows, *sample_shape), dtype=np.float32)
        self.y = np.empty((rows, *target_shape), dtype=y_dtype)   # labels or float targets
        self.reqs = [comm.Irecv(self.x, source=src, tag=tag), comm.Irecv(self.y, source=src, tag=tag + 1)]
        self.backoff = backoff

    def wait(self):
        t0 = time.perf_counter()
        self.backoff.reset()
        while not C.Request.Testall(self.reqs):
            self.backoff.sleep()
        return self.x, self.y, time.perf_counter() - t0


class Worker:
    def __init__(self, cfg, dataset, comm, rank: int):
        self.cfg = cfg
        self.comm = comm
        self.rank = rank
        self.backend = select_backend(cfg.device, C.local_rank(comm))
        self.model = config_model(cfg, dataset)
        self.n = self.model.num_params
        self.injector = Injector(parse_injects(cfg.inject, comm.Get_size()), rank, cfg.seed)
        inj = self.injector
        self.store = ShardStore(dataset, seed=cfg.seed,
                                io_delay=lambda nbytes, s: inj.io_extra(time.monotonic(), nbytes, s))
        self.feed = ShardFeed(self.store, self.backend)
        self.step_fn = GradientStep(self.model, self.backend, self.injector)
        self.on_cpu = self.backend.name == "cpu"
        # With CUDA-aware MPI, messages live in device memory and MPI reads them there;
        # otherwise a GPU worker stages them through pinned host buffers.
        self.cuda_aware = cfg.workers_cuda_aware and not self.on_cpu
        # Two push buffers so that with --pipeline 1 one can be in flight while the next
        # gradient is computed into the other.
        # a push carries the gradient, then the model's state (e.g. BatchNorm statistics)
        self.push_bufs = [self._message(self.n + self.model.num_state)
                          for _ in range(2 if cfg.pipeline else 1)]
        self.recv_buf = self._message()
        # Where the message payload is already on the compute device (CPU, or CUDA-aware
        # GPU) and nothing reads the parameters while the next reply arrives (no
        # pipelining), the parameters live in the reply buffer itself: no copy per step.
        self.device_payload = self.on_cpu or self.cuda_aware
        if self.device_payload and not cfg.pipeline:
            self.params = self.recv_buf[2]
        else:
            self.params = self.backend.xp.zeros(self.n, dtype=np.float32)
        self.version = 0
        self.batch = cfg.batch
        self.step = 0
        self.backoff = C.Backoff()
        self.reply_wait = C.WaitEstimate()   # push -> reply, to wake up just in time
        self.push_req = None
        # timings since the last push
        self.compute_s = self.comm_s = self.idle_s = 0.0
        self.io_reported = 0.0
        self.retry = False
        self.preempt_sent = False
        self.preempt_req = None
        self.outgoing: list = []
        self.sample_shape = tuple(dataset.sample_shape)
        self.y_dtype, self.target_shape = dataset.label_dtype, tuple(dataset.target_shape)
        self.held = None
        if cfg.store == "local":
            ranks = list(range(1, comm.Get_size()))
            self.held = {s for s, hs in placement(len(dataset.shard_sizes), ranks, cfg.replicas).items()
                         if rank in hs}

    def _message(self, floats: Optional[int] = None):
        """(buffer MPI sends/receives, host header, payload on the compute device or host)."""
        floats = self.n if floats is None else floats
        if self.on_cpu:
            return wire.new_message(floats)
        nbytes = wire.HEADER_BYTES + 4 * floats
        if self.cuda_aware:
            buf = self.backend.xp.zeros(nbytes, dtype=np.uint8)
            return buf, wire.new_header(), buf[wire.HEADER_BYTES:].view(np.float32)
        buf = self.backend.empty_host(nbytes)
        buf[:] = 0
        return buf, wire.header_view(buf), buf[wire.HEADER_BYTES:].view(np.float32)

    def _header_to_buffer(self, msg) -> None:
        if self.cuda_aware:
            msg[0][:wire.HEADER_BYTES].set(msg[1].view(np.uint8))
            self.backend.synchronize()

    def _header_from_buffer(self, msg) -> None:
        if self.cuda_aware:
            msg[1][:] = msg[0][:wire.HEADER_BYTES].get().view(np.float64)

    # ---------------------------------------------------------------- messages
    def _wait_reply(self, counts_as_idle: bool) -> None:
        """Wait for the server's message (no spinning) and act on it."""
        t0 = time.perf_counter()
        due, grace = (None, 0.0) if counts_as_idle else self.reply_wait.window(time.monotonic())
        hdr = self.recv_buf[1]
        while True:
            C.recv_when_ready(self.comm, self.recv_buf[0], 0, wire.TAG_REPLY, self.backoff,
                              on_poll=self._check_fault, due=due, grace=grace)
            self._header_from_buffer(self.recv_buf)
            if wire.command(hdr) != Cmd.ORDERS:
                break
            self._serve_orders(wire.decode_orders(hdr))   # rows another rank needs; the reply is still to come
        reply = wire.decode_reply(hdr)
        waited = time.perf_counter() - t0
        held = reply.held_s
        if counts_as_idle:
            self.idle_s += waited
        else:
            # the server's hold, not `waited`: that includes this rank's own lateness, and
            # waking later for having woken late would feed on itself
            self.reply_wait.update(held)
            self.idle_s += min(held, waited)
            self.comm_s += max(0.0, waited - held)
        if reply.cmd == Cmd.STOP:
            raise StopWorker
        self.version = reply.version
        self.batch = max(1, reply.batch)
        self.retry = reply.retry
        if reply.drop:
            self.feed.drop()
        for epoch, shard, start, end, src, tag in reply.assigns:
            remote = None
            if src >= 0:
                remote = RemoteRows(self.comm, src, tag, end - start, self.sample_shape, self.backoff,
                                    self.y_dtype, self.target_shape)
            elif self.held is not None and shard not in self.held:
                raise RuntimeError(f"shard {shard} assigned for a local read, but this rank holds no copy")
            self.feed.assign(epoch, shard, start, end, remote)
        if reply.cut is not None:
            # after the assignments: a cut may concern a task handed out in this very reply
            self.feed.truncate(*reply.cut)
        self._serve_orders(reply.orders)
        payload = self.recv_buf[2]
        if self.params is not payload:
            if self.device_payload:
                self.backend.xp.copyto(self.params, payload)
            else:
                self.params.set(payload)   # host (pinned) -> device

    def _push(self, msg, done: Computed, next_range) -> None:
        buf, hdr, _ = msg
        batch = done.batch
        io_total = self.feed.io_s
        wire.encode_push(hdr, step=self.step, version=done.version, epoch=batch.epoch,
                         shard=batch.shard, lo=batch.lo, hi=batch.hi, batch=batch.size,
                         loss=done.loss, compute_s=done.compute_s,
                         io_s=io_total - self.io_reported, comm_s=self.comm_s,
                         idle_s=self.idle_s, nonfinite=done.nonfinite,
                         t=time.monotonic() - self.t0, next_range=next_range)
        self.io_reported = io_total
        self.comm_s = self.idle_s = 0.0
        t0 = time.perf_counter()
        if self.push_req is not None:
            C.complete(self.push_req)
        self._header_to_buffer(msg)
        self.push_req = self.comm.Isend(buf, dest=0, tag=wire.TAG_PUSH)
        self.step += 1
        if not self.cfg.pipeline:
            C.complete(self.push_req)   # the server has a receive posted: this is quick
        self.comm_s += time.perf_counter() - t0   # reported with the next push

    def _serve_orders(self, orders) -> None:
        for epoch, shard, start, end, dst, tag in orders:
            self._send_rows(epoch, shard, start, end, dst, tag)

    def _send_rows(self, epoch, shard, start, end, dst, tag) -> None:
        """Send positions [start, end) of a shard to `dst` without waiting for the transfer."""
        x, y = self.feed.rows(epoch, shard, start, end)
        reqs = [self.comm.Isend(x, dest=dst, tag=tag), self.comm.Isend(y, dest=dst, tag=tag + 1)]
        self.outgoing.append((reqs, x, y))   # the arrays live until the sends complete

    def _progress_outgoing(self) -> None:
        if self.outgoing:
            self.outgoing = [o for o in self.outgoing if not C.Request.Testall(o[0])]

    def _check_fault(self) -> None:
        self._progress_outgoing()
        if PREEMPTED.is_set() and not self.preempt_sent:
            self.preempt_req = C.notify_preempt(self.comm)   # rank 0 checkpoints, stops all
            self.preempt_sent = True
        fault = self.injector.fault(time.monotonic())
        if fault == "crash":
            os._exit(17)
        if fault == "hang":
            while True:  # stops responding, process stays alive
                time.sleep(3600)

    def _compute(self, batch, msg) -> Computed:
        """Gradient of `batch` into the payload of `msg` (staged through the host on a GPU)."""
        self._check_fault()
        out = msg[2][:self.n] if self.device_payload else None
        loss, grad, compute_s = self.step_fn(self.params, batch, out=out)
        # Push the mean gradient: the division and the finiteness check happen here, in
        # parallel on every worker, instead of on the server's hot path.
        grad *= np.float32(1.0 / batch.size)
        xp = self.backend.xp
        nonfinite = not np.isfinite(loss) or not bool(xp.isfinite(grad).all())
        if not self.device_payload:
            self.backend.to_host(grad, out=msg[2][:self.n])   # stage through pinned host memory
        if self.model.num_state:
            state = self.model.get_state()   # host floats; the payload is host or device
            msg[2][self.n:] = state if isinstance(msg[2], np.ndarray) else self.backend.asarray(state)
        self.backend.synchronize()   # MPI must not touch device memory still being written
        return Computed(batch, loss, compute_s, nonfinite, self.version)

    # ---------------------------------------------------------------- main loop
    def run(self) -> None:
        self.t0 = time.monotonic()
        self.injector.start(self.t0)
        try:
            self._wait_reply(counts_as_idle=True)
            if self.cfg.pipeline:
                self._loop_pipelined()
            else:
                self._loop()
        except StopWorker:
            pass
        finally:
            if self.push_req is not None:
                C.wait(self.push_req, timeout=5.0)
            for reqs, _, _ in self.outgoing:   # rows other ranks still need
                for req in reqs:
                    C.wait(req, timeout=30.0)
            self.store.close()
            if self.preempt_req is not None and not self.preempt_req.Test():
                self.preempt_req.Cancel()

    def _loop(self) -> None:
        msg = self.push_bufs[0]
        while True:
            if not self.feed.has_work:
                self._wait_reply(counts_as_idle=True)
                continue
            done = self._compute(self.feed.take(self.batch), msg)
            self._push(msg, done, None)
            self._wait_reply(counts_as_idle=False)
            if self.retry:   # rejected (non-finite): once more on the fresh parameters
                self._push(msg, self._compute(done.batch, msg), None)
                self._wait_reply(counts_as_idle=False)

    def _loop_pipelined(self) -> None:
        """Compute batch k+1 on the parameters at hand while push k is in flight."""
        cur = 0
        pending: Optional[Computed] = None   # computed into push_bufs[cur], not pushed
        while True:
            if pending is None:
                if not self.feed.has_work:
                    self._wait_reply(counts_as_idle=True)
                    continue
                pending = self._compute(self.feed.take(self.batch), self.push_bufs[cur])
            pushed, msg = pending, self.push_bufs[cur]
            next_range = self.feed.next_range(self.batch)
            self._push(msg, pushed, next_range)
            pending = None
            cur = 1 - cur
            if next_range is not None:
                pending = self._compute(self.feed.take(self.batch), self.push_bufs[cur])
            self._wait_reply(counts_as_idle=False)
            if self.retry:
                # recompute the rejected batch on the fresh parameters and push it again
                again = self._compute(pushed.batch, msg)
                nb = pending.batch if pending is not None else None
                self._push(msg, again, None if nb is None else (nb.epoch, nb.shard, nb.lo, nb.hi))
                self._wait_reply(counts_as_idle=False)


