"""The server's messages to a worker: its reply (or ORDERS, or STOP) header, the parameters
that follow a PARAMS reply, one slice from each store, and the parameters computed on."""

from __future__ import annotations

import time

import numpy as np

from mpilb.mpi import comm as C
from mpilb.mpi import chunks, doorbell, wire, wire_format
from mpilb.mpi.wire import Cmd, ReplyMsg
from mpilb.worker.messages import DeviceMessages

# While a reply's parameters are still arriving, rank 0 is asked again to progress them
# before the progress a poke buys runs out (0.4 ms).
POKE_EVERY_S = 0.8 * doorbell.POKE_PROGRESS_S


class Replies:
    """The receiving side of a worker.

    Where the payload is on the compute device (CPU, or CUDA-aware GPU), the parameters are
    used where they were received. With --pipeline 1 the next reply then arrives while the
    parameters are in use, so replies alternate between two buffers: the one not computed
    on receives (`spare` holds the parameters in use). A GPU worker without CUDA-aware MPI
    copies each reply's parameters into `params` on the device.

    Args:
        comm: the world communicator; rank: this worker's.
        messages: where the buffers live.
        floats: the parameters' length.
        stores, bounds: the store ranks and their slices of the parameters.
        bell: rank 0's doorbell (poked while its sends are still arriving).
        backoff: the worker's waits; rank0: the watch on rank 0's silence.
        rows: the row exchange (serves the send orders that come meanwhile).
        pipelined: --pipeline 1.
        fmt: the wire format (--wire). Other than fp32, a reply's values are expanded into
            `params` (float32, on the compute device) once its slices are in: the
            parameters in use are never the ones receiving, so one buffer of each suffices.
    """

    def __init__(self, comm, rank: int, messages: DeviceMessages, floats: int, stores, bounds,
                 bell, backoff, rank0, rows, pipelined: bool,
                 fmt: wire_format.WireFormat = wire_format.Float32(), plans=None):
        self.comm = comm
        # per store: the chunks its slice comes in (mpi/chunks.py), or None: one message
        self.plans = list(plans) if plans is not None else [None] * len(stores)
        self.rank = rank
        self.messages = messages
        self.stores = stores
        self.bounds = bounds
        self.bell = bell
        self.backoff = backoff
        self.rank0 = rank0
        self.rows = rows
        self.pipelined = pipelined
        self.fmt = fmt
        self.staging = None   # the wire values on the device, before they are expanded
        self.spare = None
        if not fmt.is_fp32:
            self.recv, _, self.staging = messages.new_wire(fmt, floats)
            self.params = messages.backend.xp.zeros(floats, dtype=np.float32)
        elif not messages.device_payload:
            self.recv = messages.new(floats)
            self.params = messages.backend.xp.zeros(floats, dtype=np.float32)
        elif pipelined:
            self.recv = messages.new(floats)
            self.spare = messages.new(floats)
            self.params = self.spare.payload
        else:
            self.recv = messages.new(floats)
            self.params = self.recv.payload
        self.pulls = None         # receives of the next reply's slices, posted early
        self.early_reply = None   # a reply's header read while blocked for rows (pipelined)

    def post_pulls(self) -> None:
        """Post the receives of every store's slice of the next reply's parameters."""
        if self.pulls is None:
            payload, b = self.recv.payload, self.bounds
            self.pulls = [self.comm.Irecv(payload[b[s] + lo:b[s] + hi], source=r, tag=wire.TAG_PARAMS)
                          for s, r in enumerate(self.stores)
                          for lo, hi in self.plans[s] or chunks.whole(b[s + 1] - b[s])]

    def receive(self, due, grace: float, on_poll) -> ReplyMsg:
        """Wait (no spinning) for the server's next reply or STOP, serving the send orders
        that come before it. `due`, `grace`: when it is expected (Backoff.reset);
        `on_poll`: called between polls."""
        hdr = self.recv.header
        self.rank0.waiting()
        while True:
            if self.early_reply is not None:   # read while blocked for rows (pipelined)
                hdr[:] = self.early_reply
                self.early_reply = None
            else:
                C.recv_when_ready(self.comm, self.recv.buf, 0, wire.TAG_REPLY, self.backoff,
                                  on_poll=on_poll, due=due, grace=grace)
                self.messages.header_from_buffer(self.recv)
                self.rank0.heard()
            if wire.command(hdr) != Cmd.ORDERS:
                return wire.decode_reply(hdr)
            self.rows.serve(wire.decode_orders(hdr))   # rows another rank needs; the reply is still to come
            self.rank0.waiting()   # reading them was this rank's own work

    def finish_pulls(self) -> None:
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

    def take_params(self) -> None:
        """The parameters just received become the ones computed on."""
        payload = self.recv.payload
        if self.params is payload:
            return   # received in place
        if not self.fmt.is_fp32:   # expanded where the parameters are used
            backend = self.messages.backend
            if self.staging is not None:   # pinned host -> device, then expanded there
                self.staging.set(payload)
                payload = self.staging
            self.fmt.decode(payload, self.params, backend.xp)
            return
        if self.spare is not None:   # pipelined: the other buffer receives next
            self.recv, self.spare = self.spare, self.recv
            self.params = payload
        else:
            self.params.set(payload)   # host (pinned) -> device

    def read_while_blocked(self) -> None:
        """Waiting for rows: read what rank 0 sends meanwhile. Without pipelining no reply
        can be on its way now (this rank has not pushed), so a message from rank 0 here is
        ORDERS (header only: the parameters are untouched), served at once. With
        --pipeline 1 the reply to the push in flight may come first: its header is kept for
        :meth:`receive` (its parameters wait in MPI for the pulls), and the orders behind it
        are served as they come."""
        msg = self.comm.improbe(source=0, tag=wire.TAG_REPLY)
        if msg is None:
            return
        self.rank0.heard()
        self.bell.took(0)
        C.complete(msg.Irecv(self.recv.buf), on_poll=self.rank0.check)
        self.messages.header_from_buffer(self.recv)
        hdr = self.recv.header
        if wire.command(hdr) == Cmd.ORDERS:
            self.rows.serve(wire.decode_orders(hdr))
            self.rank0.waiting()
        elif self.pipelined and self.early_reply is None:
            self.early_reply = hdr.copy()
        else:
            raise RuntimeError(f"rank {self.rank}: message {wire.command(hdr)} from rank 0 while "
                               f"waiting for shard rows (only ORDERS can come then, and with "
                               f"--pipeline 1 one reply)")

    def cancel_pulls(self) -> None:
        """At the end of the run: the receives of a reply that will not come (STOP)."""
        for req in self.pulls or ():
            req.Cancel()
            C.wait(req, timeout=1.0)
