"""Rank 0's parameter stores (--servers K): its own slice, which the update rule drives, and
its handle on the others (store.py), with the whole vector and the `servers/` log rows."""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from mpilb.mpi import comm as C
from mpilb.mpi import chunks, wire, wire_format
from mpilb.core.topology import stores_of
from mpilb.server.peers import Link
from mpilb.server.remote import RemoteSlices
from mpilb.server.store import slice_ring, store_bounds, stream_calls


class SliceGroup:
    """Rank 0's parameter stores: its own slice (`local`, a ParamRing the update rule
    drives) and, with --servers K > 1, the others (`remote`). `session.params` and
    `session.optimizer` hold the whole vector and its state: with K > 1 they are filled
    from every store when needed (evaluation, checkpoints).

    With --wire other than fp32, a push's slice arrives in the wire format and is expanded
    into `grad` (float32, kept: it may become the parameters, and the ring's spare buffer
    takes its place), and replies go from `encoded` (the parameters converted once per
    version). With fp32 the push's own receive buffer is the gradient, as ever.
    """

    def __init__(self, cfg, session, comm):
        from mpilb.run.components import config_optimizer

        self.session = session
        self.cfg = cfg
        self.waits = ChunkWaits(cfg.faults.worker_timeout)   # chunks of pushes to rank 0
        self.ranks = stores_of(cfg)   # the store ranks, in slice order (rank 0 first)
        self.bounds = store_bounds(cfg, session.model)
        from mpilb.run.signals import PREEMPTED

        # no-ops with K = 1; a stalled store is lost after --worker-timeout, at once on a stop
        self.remote = RemoteSlices(comm, self.bounds, cfg.faults.worker_timeout, PREEMPTED.is_set,
                                   self.ranks)
        self.sliced = len(self.ranks) > 1
        self.stores_comm = None   # rank 0 and the other stores: made at the first join
        n0 = self.bounds[1]
        # a push to rank 0 carries its slice of the gradient, then the model's state
        self.push_floats = n0 + session.model.num_state

        self.fmt = wire_format.wire_format(cfg.updates.wire)
        self.num_state = session.model.num_state

        def new_buffer() -> np.ndarray:   # the ring's buffers can receive pushes (ParamRing)
            if not self.fmt.is_fp32:   # (pushes arrive in another type: plain vectors)
                return np.empty(n0, np.float32)
            return wire.new_message(self.push_floats).payload[:n0]

        if not self.sliced:
            self.local = slice_ring(cfg, session.params, session.optimizer, new_buffer)
        else:
            self.local = slice_ring(cfg, np.zeros(n0, np.float32), config_optimizer(cfg.optim, n0),
                                     new_buffer)
        session.keep_correction(self.local.correction)   # checkpointed, restored on --resume
        self.grad = None if self.fmt.is_fp32 else new_buffer()
        self.work = None         # fp32: where a chunked push's gradient is gathered (_work)
        self.gave_work = False   # the gradient handed out last was `work` (took)
        self.encoded = (None if self.fmt.is_fp32
                        else wire_format.EncodedParams(self.fmt, n0, C.finished))
        self.cpu0 = time.process_time()
        self.last = np.zeros(5)
        self.totals = {r: np.zeros(5) for r in self.ranks}

    @property
    def n0(self) -> int:
        """Floats of rank 0's slice (a push to rank 0 carries these)."""
        return self.bounds[1]

    # ----------------------------------------------------------------- pushes, replies
    def new_link(self, pipelined: bool, rank: Optional[int] = None) -> Link:
        """A worker's link, its receive buffer sized for a push to rank 0; `rank`: a worker
        of the job's layout, whose pairs with stores on other nodes go in chunks
        (mpi/chunks.py; a joiner's do not)."""
        link = Link.allocate(self.n0, pipelined, push_floats=self.push_floats, fmt=self.fmt)
        if rank is not None:
            link.plans = chunks.store_plans(self.cfg, rank, self.ranks, self.bounds,
                                            self.fmt.itemsize, self.num_state)
        return link

    def spans(self, link: Link) -> chunks.Spans:
        """The chunks of rank 0's slice between it and `link`'s worker."""
        return (link.plans[0] if link.plans else None) or chunks.whole(self.n0)

    def _work(self) -> np.ndarray:
        """The float32 vector a chunked push's gradient is gathered into (fp32: a ring-able
        message payload, made once; other wires: `grad`), never one MPI still writes."""
        if not self.fmt.is_fp32:
            return self.grad
        if self.work is None:
            self.work = wire.new_message(self.push_floats).payload[:self.n0]
        return self.work

    def gradient(self, link: Link) -> np.ndarray:
        """Rank 0's slice of the gradient in `link`'s push, as float32 (expanded from the
        wire format into `grad`, in place: no allocation per push). Chunks that did not come
        (the worker is gone: `link.broken`) read as zeros."""
        self.gave_work = False
        payload = link.recv.payload[:self.n0]
        spans = self.spans(link)
        missing = [(lo, hi) for i, (lo, hi) in enumerate(spans) if not self.waits.arrived(link, i)]
        if self.fmt.is_fp32 and not link.late:
            for lo, hi in missing:   # (the worker is gone: MPI writes no more there)
                payload[lo:hi] = 0
            return payload
        grad = self._work()   # late chunks still land in the payload: the gradient is a copy
        self.fmt.decode(payload, grad)
        for lo, hi in missing:
            grad[lo:hi] = 0
        self.gave_work = self.fmt.is_fp32
        return grad

    def streams(self, peer, rule, stopping: bool) -> bool:
        """Whether `peer`'s push, about to be applied, is answered as it is applied
        (Op.STREAM): where some store exchanges chunks with it (mpi/chunks.py) and the rule
        replies at once (async), unless the run is `stopping` or the worker leaving (its
        reply is then no PARAMS)."""
        return (peer.link.chunked and not rule.rounds and not rule.holds_replies
                and not stopping and not peer.leaving and not self.num_state)

    def push(self, peer, update, then, rule, outbox=None):
        """Hand `peer`'s push to the update rule with rank 0's slice of its gradient
        (expanded from --wire into float32); with `outbox` (it streams: :meth:`streams`),
        applied here chunk by chunk instead, each chunk of the reply sent once stepped.
        Returns what the rule's push returns."""
        if outbox is None:
            return rule.push(peer, update, self.gradient(peer.link), then, consume=True)
        lr_scale = self.stream(peer.link, update.batch, update.staleness, then,
                               outbox.stream_send(peer), worker=update.rank)
        peer.link.streamed = True
        return [update], lr_scale

    def stream(self, link: Link, batch: int, staleness: int, then, send,
               worker: int = -1) -> float:
        """Apply rank 0's slice of `link`'s push chunk by chunk as the chunks arrive,
        sending each chunk of the new slice with ``send(array)`` (which returns its
        request) once stepped (Op.STREAM; ParamRing.apply_chunks). Returns the lr scale."""
        self.gave_work = False
        ring, spans = self.local, self.spans(link)
        wire_grad = link.recv.payload[:self.n0]
        # gathered chunk by chunk into a vector of rank 0's own (a chunk that comes late
        # still lands in the receive buffer, never in the parameters)
        grad = self._work()

        arrive, answer = stream_calls(spans, grad, wire_grad, self.fmt, self.encoded, ring,
                                      lambda i: self.waits.arrived(link, i), send,
                                      lambda: bool(link.broken))

        lr_scale = ring.apply_chunks(grad, batch, staleness, spans, arrive, answer, then,
                                     consume=True, worker=worker)
        self.gave_work = self.fmt.is_fp32
        ring.bytes_out += wire_grad.nbytes
        return lr_scale

    def state(self, link: Link) -> np.ndarray:
        """The model's state floats after the gradient in `link`'s push (float32)."""
        if self.fmt.is_fp32:
            return link.recv.payload[self.n0:]
        return wire_format.views(link.recv.buf, self.fmt, self.n0, self.num_state)[1]

    def took(self, link: Link, given: np.ndarray) -> None:
        """The gradient's buffer became the parameters; `given` (ParamRing.exchange) takes
        its place."""
        if self.gave_work:   # the gradient was gathered into the work vector (fp32)
            self.work = given
        elif self.fmt.is_fp32:
            link.recv = wire.message_of(given)   # receive the next push in it
        else:
            self.grad = given

    def reply_params(self) -> np.ndarray:
        """What a reply sends: the current parameters, or their copy in the wire format."""
        ring = self.local
        if self.encoded is None:
            return ring.params
        return self.encoded.of(ring.params, ring.version)

    def sending(self, req) -> None:
        """`req` sends (part of) the array reply_params gave: it reads it until done."""
        if self.encoded is None:
            self.local.sending(req)
        else:
            self.encoded.sending(req)

    def pending(self) -> list:
        """Sends still reading the parameters (or their wire copies)."""
        return self.local.pending() + ([] if self.encoded is None else self.encoded.pending())

    def accept_joiner(self, rank: int, port: str, timeout: float):
        """With K > 1: the joiner waiting in MPI_Comm_connect at `port` is accepted by every
        store together (store_joins.py), as worker `rank`; its communicator (rank 0 first,
        store s its rank s, the joiner last), or None (no one connected within `timeout`)."""
        from mpilb.mpi import joining

        seconds = max(1, int(round(timeout)))   # (the stores are told whole seconds)
        self.remote.answering()   # (a store that cannot take part holds the accept for ever)
        self.remote.accepting(rank, seconds)
        if self.stores_comm is None:
            self.stores_comm = joining.stores_group(self.remote.comm, self.ranks)
        return joining.accept_together(self.stores_comm, port, seconds)

    def start(self, version: int) -> None:
        """Every store takes its slice of the session's parameters and optimizer state."""
        self.local.version = version
        if self.encoded is not None:
            self.encoded.forget()
        if not self.sliced:
            return
        s, hi = self.session, self.bounds[1]
        self.local.params[:] = s.params[:hi]
        opt = self.local.optimizer
        for name in opt._buffers:   # (the two may step with different kernels: by size)
            opt.load_state_slice(name, 0, hi, s.optimizer.state_slice(name, 0, hi))
        opt.steps = s.optimizer.steps
        self.remote.load(s.params, s.optimizer, version)

    def full_params(self) -> np.ndarray:
        """The whole parameter vector (and, with K > 1, the optimizer state gathered into
        the session's optimizer)."""
        if not self.sliced:
            return self.local.params
        s, hi = self.session, self.bounds[1]
        s.params[:hi] = self.local.params
        opt = self.local.optimizer
        for name in opt._buffers:
            s.optimizer.load_state_slice(name, 0, hi, opt.state_slice(name, 0, hi))
        s.optimizer.steps = opt.steps
        self.remote.gather(s.params, s.optimizer)
        return s.params

    # ----------------------------------------------------------------- servers/ rows
    def _own(self) -> np.ndarray:
        st = self.local
        now = np.array([st.updates, st.bytes_in, st.bytes_out, st.apply_s,
                        time.process_time() - self.cpu0])
        inc, self.last = now - self.last, now
        return inc

    def _row(self, log, t: float, server: int, inc) -> None:   # server: the store's rank
        self.totals[server] += inc[:5]
        log.append("servers", t=t, server=server, updates=int(inc[0]), bytes_in=int(inc[1]),
                   bytes_out=int(inc[2]), apply_s=float(inc[3]), cpu_s=float(inc[4]))

    def log_rows(self, log, t: float) -> None:
        """One `servers/` row per store with its counters since its previous row (the other
        stores' reports arrive asynchronously: asked for now, logged when they are in)."""
        self._row(log, t, 0, self._own())
        if self.sliced:
            for s, inc in self.remote.poll_stats().items():
                self._row(log, t, s, inc)
            self.remote.request_stats()

    def end(self, log, t: float, wait: bool = True) -> list[dict]:
        """Last rows (the stores finish; `wait` False: the job is failing, and ends them by
        abort); returns the summary's `servers` list."""
        self._row(log, t, 0, self._own())
        if self.sliced and wait:
            for s, inc in self.remote.end().items():
                self._row(log, t, s, inc)
        return [{"rank": r, "params": self.bounds[s + 1] - self.bounds[s]}
                for s, r in enumerate(self.ranks)]


class ChunkWaits:
    """Rank 0's receives of the chunks of its slice of each push (mpi/chunks.py), and its
    waits for them: bounded by --worker-timeout (then the worker is gone) and by
    chunks.STALL_S (then the push goes on without its late chunks)."""

    def __init__(self, timeout: float):
        self.timeout = timeout

    def post(self, link: Link, comm, source: int) -> None:
        """With the receive of a push's header: where rank 0's slice comes in chunks (the
        header then comes alone, first, so that the push is decided on before its bytes are
        in), the receives of the chunks, into the same buffer."""
        payload = link.recv.payload
        link.rest = ([comm.Irecv(payload[lo:hi], source=source, tag=wire.TAG_GRAD)
                      for lo, hi in link.plans[0]] if link.plans and link.plans[0] else [])

    def arrived(self, link: Link, i: int) -> bool:
        """Chunk i of rank 0's slice of `link`'s push is in (a slice in one message came
        with the header); False when MPI failed it (`link.broken` says why: the worker is
        gone) or it did not come within chunks.STALL_S (`link.late`: its chunks go on
        arriving, and rank 0 goes on without them; a --worker-timeout as short breaks it)."""
        if not link.rest or link.broken or link.late:
            return not (link.broken or link.late)
        req = link.rest[i]
        if i == 0:
            link.waited = 0.0
        backoff = C.Backoff()
        wait = min(self.timeout, chunks.STALL_S)
        t0 = time.monotonic()
        deadline = t0 + wait
        try:
            while not req.Test():
                if time.monotonic() > deadline:
                    if wait < self.timeout:
                        link.late = True
                    else:
                        link.broken = f"sent part of a push and not the rest for {wait:g} s"
                    return False
                backoff.sleep()
        except C.MPIError as exc:
            link.broken = f"ended mid-push (MPI: {exc.Get_error_string().strip()})"
            return False
        finally:
            link.waited += time.monotonic() - t0   # (receive.py: a link worth deferring)
        return True

    def finish(self, link: Link, lost: bool) -> bool:
        """After a push was handled: its chunks still to come are taken (or, for a worker
        lost, their receives cancelled) before the next push's are posted. False when some
        are late (`link.late`): they stay posted, and the worker's next push waits for them
        (taken_late)."""
        for i in range(len(link.rest)):
            if lost or (not self.arrived(link, i) and not link.late):
                req = link.rest[i]
                if not C.finished(req):
                    req.Cancel()
                    C.wait(req, timeout=1.0)
        if link.late and not lost:
            return False
        link.rest, link.late = [], False
        return True

    @staticmethod
    def all_in(link: Link) -> bool:
        """Every chunk of rank 0's slice of `link`'s push is in (True where MPI failed one:
        the push is then handled, and its stream finds the link broken)."""
        try:
            return C.Request.Testall(link.rest)
        except C.MPIError:
            return True

    @staticmethod
    def taken_late(link: Link) -> bool:
        """A late push's chunks have all come now (its receive buffer is free again)."""
        if not C.Request.Testall(link.rest):
            return False
        link.rest, link.late = [], False
        return True
