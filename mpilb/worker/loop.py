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
import signal
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from mpilb.mpi import comm as C
from mpilb.mpi import doorbell
from mpilb.run import signals
from mpilb.backend import select_backend
from mpilb.core.batches import GradientStep, ShardFeed
from mpilb.core.inject import Injector, parse_injects
from mpilb.worker.row_exchange import RowExchange, held_shards
from mpilb.data.shards import ShardStore
from mpilb.core.optimizers import clip_grad_norm
from mpilb.core.topology import stores_of, workers_of
from mpilb.run.signals import PREEMPTED, USR1_NOTICE
from mpilb.run.components import config_model
from mpilb.mpi.waiting import WaitEstimate
from mpilb.mpi.watchdog import Rank0Watch
from mpilb.mpi import wire
from mpilb.mpi.wire import Cmd


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


# While a reply's parameters are still arriving, rank 0 is asked again to progress them
# before the progress a poke buys runs out (0.4 ms).
POKE_EVERY_S = 0.8 * doorbell.POKE_PROGRESS_S


class Worker:
    def __init__(self, cfg, dataset, comm, rank: int, hosts=None):
        self.cfg = cfg
        self.comm = comm
        self.rank = rank
        self.backend = select_backend(cfg.device, C.local_rank(comm))
        self.model = config_model(cfg, dataset)
        self.n = self.model.num_params
        self.injector = Injector(parse_injects(cfg.inject, comm.Get_size()), rank, cfg.seed)
        inj = self.injector
        self.held = None
        if cfg.store == "local":
            self.held = held_shards(len(dataset.shard_sizes), rank,
                                    workers_of(cfg, comm.Get_size()), cfg.replicas, hosts)
        self.store = ShardStore(dataset, seed=cfg.seed,
                                io_delay=lambda nbytes, s: inj.io_extra(time.monotonic(), nbytes, s),
                                cache_mb=cfg.cache_mb, shards=self.held)
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
        # GPU), the parameters are used where they were received: no copy per step. With
        # --pipeline 1 the next reply arrives while the parameters are in use, so replies
        # alternate between two buffers: the one not computed on receives (`spare_buf`
        # holds the parameters in use).
        self.device_payload = self.on_cpu or self.cuda_aware
        self.spare_buf = None
        if not self.device_payload:
            self.params = self.backend.xp.zeros(self.n, dtype=np.float32)
        elif cfg.pipeline:
            self.spare_buf = self._message()
            self.params = self.spare_buf[2]
        else:
            self.params = self.recv_buf[2]
        self.version = 0
        self.batch = cfg.batch
        self.step = 0
        self.bell = doorbell.current()   # rank 0 rings with each message (doorbell.py)
        self.backoff = C.Backoff(bell=self.bell)
        # rows sent to and received from other workers (--store local, part-way moves)
        self.rows = RowExchange(comm, rank, cfg, dataset, self.feed, self.backoff,
                                on_poll=self._orders_while_blocked, hosts=hosts)
        self.push_reqs: list = []
        # --servers K: store s (rank stores[s]) holds parameters [bounds[s], bounds[s+1])
        self.stores = stores_of(cfg)
        self.bounds = wire.cut_slices(self.n, len(self.stores), wire.layer_sizes(self.model))
        self.pulls: Optional[list] = None   # receives of the next reply's slices, posted early
        self.early_reply = None   # a reply's header read while blocked for rows (pipelined)
        self.times = TimeSincePush()
        self.retry = False
        self.signals_sent: set = set()
        self.preempt_reqs: list = []
        self.rank0 = Rank0Watch(cfg.worker_timeout, rank)   # ends this rank if rank 0 is gone
        signals.listen(self._report_signals)   # reported from the handler, even mid-hang

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
    def _post_pulls(self) -> None:
        """Post the receives of every store's slice of the next reply's parameters."""
        if self.pulls is None:
            payload, b = self.recv_buf[2], self.bounds
            self.pulls = [self.comm.Irecv(payload[b[s]:b[s + 1]], source=r, tag=wire.TAG_PARAMS)
                          for s, r in enumerate(self.stores)]

    def _finish_pulls(self) -> None:
        """The slices follow a PARAMS header: wait for all of them (no spinning). Rank 0
        may have to progress the send (doorbell.py): it is poked, and poked again while the
        slices keep this rank waiting, since it progresses its sends only for a moment after
        a poke and then sleeps until a push comes (with one worker: up to its nap)."""
        self.backoff.reset()
        poked = 0.0
        while not C.Request.Testall(self.pulls):
            now = time.monotonic()
            if now - poked >= POKE_EVERY_S:
                self.bell.poke(0)
                poked = now
            self.rows.progress()
            self.rank0.check()
            self.backoff.sleep()
        self.pulls = None

    def _wait_reply(self, counts_as_idle: bool) -> None:
        """Wait for the server's message (no spinning) and act on it."""
        t0 = time.perf_counter()
        self._post_pulls()
        due, grace = self.times.reply_window(counts_as_idle)
        hdr = self.recv_buf[1]
        self.rank0.waiting()
        while True:
            if self.early_reply is not None:   # read while blocked for rows (pipelined)
                hdr[:] = self.early_reply
                self.early_reply = None
            else:
                C.recv_when_ready(self.comm, self.recv_buf[0], 0, wire.TAG_REPLY, self.backoff,
                                  on_poll=self._poll_waiting, due=due, grace=grace)
                self._header_from_buffer(self.recv_buf)
                self.rank0.heard()
            if wire.command(hdr) != Cmd.ORDERS:
                break
            self.rows.serve(wire.decode_orders(hdr))   # rows another rank needs; the reply is still to come
            self.rank0.waiting()   # reading them was this rank's own work
        reply = wire.decode_reply(hdr)
        if reply.cmd == Cmd.PARAMS:
            self._finish_pulls()
            self._settle_pushes()
            self._take_params()
        self.times.waited(time.perf_counter() - t0, reply.held_s, counts_as_idle)
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
                remote = self.rows.expect(shard, end - start, src, tag)
            elif self.held is not None and shard not in self.held:
                raise RuntimeError(f"shard {shard} assigned for a local read, but this rank holds no copy")
            self.feed.assign(epoch, shard, start, end, remote)
        if reply.cut is not None:
            # after the assignments: a cut may concern a task handed out in this very reply
            self.feed.truncate(*reply.cut)
        self.rows.serve(reply.orders)

    def _take_params(self) -> None:
        """The parameters just received become the ones computed on."""
        payload = self.recv_buf[2]
        if self.params is payload:
            return   # received in place
        if self.spare_buf is not None:   # pipelined: the other buffer receives next
            self.recv_buf, self.spare_buf = self.spare_buf, self.recv_buf
            self.params = payload
        else:
            self.params.set(payload)   # host (pinned) -> device

    def _push(self, msg, done: Computed, next_range) -> None:
        buf, hdr, _ = msg
        batch = done.batch
        wire.encode_push(hdr, step=self.step, version=done.version, epoch=batch.epoch,
                         shard=batch.shard, lo=batch.lo, hi=batch.hi, batch=batch.size,
                         loss=done.loss, compute_s=done.compute_s, nonfinite=done.nonfinite,
                         t=time.monotonic() - self.t0, next_range=next_range,
                         **self.times.report(self.feed.io_s))
        t0 = time.perf_counter()
        self._settle_pushes()
        self._header_to_buffer(msg)
        b = self.bounds
        # every store's slice at once; rank 0 gets the header with slice 0
        self.push_reqs = [self.comm.Isend(msg[2][b[s]:b[s + 1]], dest=r, tag=wire.TAG_GRAD)
                          for s, r in enumerate(self.stores) if s]
        # (with one store, followed by the model's state: the server keeps the latest)
        state = self.model.num_state if len(b) == 2 else 0
        self.push_reqs.append(self.comm.Isend(buf[:wire.HEADER_BYTES + 4 * (b[1] + state)],
                                              dest=0, tag=wire.TAG_PUSH))
        self.bell.ring(0)
        self.step += 1
        # Not waited for here: the receivers have receives posted and, with MPICH's
        # shared-memory transport, fetch the message themselves (a rendezvous read), so
        # spinning on it would only take a core from the server that is to read it (where
        # the sender must move it, it moves at this rank's next MPI call: pipelined, after
        # the compute). The push is complete once its reply has come (_settle_pushes), or at
        # the latest before its buffer is written again.
        C.Request.Testall(self.push_reqs)
        self.times.comm_s += time.perf_counter() - t0   # reported with the next push

    def _settle_pushes(self) -> None:
        """The server replied to the last push, so it has it: finish the sends' requests."""
        for req in self.push_reqs:
            C.complete(req)
        self.push_reqs = []

    def _orders_while_blocked(self) -> None:
        """Waiting for rows: serve send orders the server sends meanwhile. Two workers
        waiting for rows from each other (both re-sourced after a lost holder) would
        otherwise wait for ever, or until one was declared lost for its silence. Without
        pipelining no reply can be on its way now (this rank has not pushed), so a message
        from rank 0 here is ORDERS (header only: the parameters are untouched). With
        --pipeline 1 the reply to the push in flight may come first: its header is kept for
        :meth:`_wait_reply` (its parameters wait in MPI for the pulls), and the orders
        behind it are served as they come."""
        self._poll_waiting()
        msg = self.comm.improbe(source=0, tag=wire.TAG_REPLY)
        if msg is None:
            return
        self.rank0.heard()
        self.bell.took(0)
        C.complete(msg.Irecv(self.recv_buf[0]))
        self._header_from_buffer(self.recv_buf)
        hdr = self.recv_buf[1]
        if wire.command(hdr) == Cmd.ORDERS:
            self.rows.serve(wire.decode_orders(hdr))
            self.rank0.waiting()
        elif self.cfg.pipeline and self.early_reply is None:
            self.early_reply = hdr.copy()
        else:
            raise RuntimeError(f"rank {self.rank}: message {wire.command(hdr)} from rank 0 while "
                               f"waiting for shard rows (only ORDERS can come then, and with "
                               f"--pipeline 1 one reply)")

    def _poll_waiting(self) -> None:
        """Between polls of a wait for rank 0 (or for rows): faults, and rank 0's silence."""
        self._check_fault()
        self.rank0.check()

    def _report_signals(self) -> None:
        """Tell rank 0 of each stop signal received (once each): rank 0 decides."""
        for event, signum in ((PREEMPTED, signal.SIGTERM), (USR1_NOTICE, signal.SIGUSR1)):
            if event.is_set() and signum not in self.signals_sent:
                self.signals_sent.add(signum)
                self.preempt_reqs.append(C.notify_preempt(self.comm, signum))

    def _check_fault(self) -> None:
        self.rows.progress()
        self._report_signals()
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
        self.rank0.waiting()   # this rank's own step is no silence of rank 0
        # Push the mean gradient: the division and the finiteness check happen here, in
        # parallel on every worker, instead of on the server's hot path. They are compute
        # (~0.12 ms a step for 270k parameters, ~2 % of a run that fell in no bucket).
        t0 = time.perf_counter()
        grad *= np.float32(1.0 / batch.size)
        xp = self.backend.xp
        nonfinite = not np.isfinite(loss) or not bool(xp.isfinite(grad).all())
        if not nonfinite and self.cfg.mode != "sync":   # (sync: the round's mean, rank 0)
            clip_grad_norm(grad, self.cfg.clip_norm, xp)
        compute_s += time.perf_counter() - t0
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
            signals.unlisten(self._report_signals)   # the run is over: nothing more to report
            for req in self.push_reqs:
                C.wait(req, timeout=5.0)
            for req in self.pulls or ():   # a reply that will not come (STOP)
                req.Cancel()
                C.wait(req, timeout=1.0)
            self.rows.finish()   # rows other ranks still need
            self.store.close()
            for req in self.preempt_reqs:
                if not req.Test():
                    req.Cancel()

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


