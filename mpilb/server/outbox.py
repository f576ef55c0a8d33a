"""Messages from rank 0 to a worker: replies (parameters, or STOP) and send orders.

Each worker has preallocated reply headers (two when pipelined: it computes on the previous
reply while the next is sent) and a header-only buffer for orders; wire.py encodes them.
The parameters follow a PARAMS header as a message of their own, sent from the ParamRing's
current buffer without a copy.
Sends are nonblocking, and nothing here waits for one: a header buffer still in flight is
not written again, another is taken (peers.Headers), so a worker that died with a send to it
under way costs a buffer, not rank 0's loop. The requests not known to be complete are kept
so that the main loop can keep MPI progressing while they travel.
"""

from __future__ import annotations

import time

from mpilb.mpi import comm as C
from mpilb.mpi import wire
from mpilb.mpi.wire import Cmd


class Outbox:
    """Sends to workers on `comm`; what a reply carries comes from the task ledger.

    `remote`: the other stores (RemoteSlices; none with --servers 1), told to send their
    slices too.
    """

    QUIET_S = 0.3e-3   # replies sooner than this after the push are not rung (see reply)

    def __init__(self, comm, ledger, remote, bell, slices=None):
        self.comm = comm
        self.slices = slices       # rank 0's stores (SliceGroup): what a reply sends (--wire)
        self.bell = bell           # rung after each message (doorbell.py)
        self.ledger = ledger
        self.remote = remote
        self.sending: list = []    # sends not known to be complete
        self.relay = None          # rows for joiners of a --store local run (relay.py)

    def reply(self, peer, ring, cmd: Cmd = Cmd.PARAMS, held_s: float = 0.0) -> None:
        """Send `peer` a reply header (PARAMS, STOP or LEAVE) with the tasks, orders and cut it is
        owed, its batch size and the flags it must see (retry, drop); with PARAMS, the
        parameters follow from `ring` (a ParamRing) and every other store."""
        link = peer.link
        slot = link.replies.take(C.finished)
        buf, hdr, _ = link.replies.bufs[slot]
        version = ring.version
        streamed, link.streamed = link.streamed, False   # the parameters went with the step
        if cmd != Cmd.PARAMS:
            wire.encode_reply(hdr, cmd, version=version, batch=peer.batch, held_s=held_s,
                              retry=peer.retry, drop=peer.drop, streamed=streamed)
        else:
            assigns, orders, cut = self.ledger.take_reply(peer.rank, peer.batch)
            if self.relay is not None and orders:
                self.relay.watch(peer.rank, orders)
            wire.encode_reply(hdr, cmd, version=version, batch=peer.batch, held_s=held_s,
                              retry=peer.retry, drop=peer.drop, assigns=assigns, orders=orders,
                              cut=cut, streamed=streamed)
        peer.retry = peer.drop = False
        peer.told_at = time.monotonic()
        comm, dest = link.address(self.comm, peer.rank)
        link.reply_req = link.replies.reqs[slot] = comm.Isend(buf, dest=dest, tag=wire.TAG_REPLY)
        self._track(link, link.reply_req)
        ring.bytes_out += buf.nbytes
        if cmd != Cmd.PARAMS:
            self.bell.ring(peer.rank)
            return
        if not streamed:
            self._params(peer, ring, comm, dest)
        # A worker that pushed a moment ago is still polling finely for this reply (see
        # TimeSincePush.reply_window): a ring would cost rank 0 a wake-up call (~60 µs on a
        # VM) and win nothing. One that has waited longer (a held reply, a sync round, idle)
        # sleeps longer between polls and is rung.
        self.bell.ring(peer.rank, wake=time.monotonic() - peer.pushed_at > self.QUIET_S)
        if not streamed:
            self.remote.reply(peer.rank)   # the other stores send their slices (none with K = 1)

    def _params(self, peer, ring, comm, dest) -> None:
        """Rank 0's slice of the parameters to `peer`, after its PARAMS header: straight
        from the parameters, the ring stepping into another buffer while this reads
        (--wire bf16/fp16: from their copy in that format, made once per version); in the
        chunks of its plan (mpi/chunks.py) where it is on another node."""
        link = peer.link
        params = ring.params if self.slices is None else self.slices.reply_params()
        spans = [(0, params.size)] if self.slices is None else self.slices.spans(link)
        for lo, hi in spans:
            sent = comm.Isend(params[lo:hi], dest=dest, tag=wire.TAG_PARAMS)
            if self.slices is None:
                ring.sending(sent)
            else:
                self.slices.sending(sent)
            self._track(link, sent)
        ring.sent_version(peer.rank)
        ring.bytes_out += params.nbytes

    def stream_send(self, peer):
        """A function sending `peer` an array of parameters (one chunk of its reply, as the
        step makes it: Op.STREAM), returning the request; the send is tracked as a reply's."""
        link = peer.link
        comm, dest = link.address(self.comm, peer.rank)

        def send(values):
            req = comm.Isend(values, dest=dest, tag=wire.TAG_PARAMS)
            self._track(link, req)
            return req
        return send

    def orders(self, peer) -> None:
        """Orders to send rows, for a worker that waits (idle, or its reply is held)."""
        link = peer.link
        while True:
            slot = link.orders_msg.take(C.finished)
            buf, hdr, _ = link.orders_msg.bufs[slot]
            orders = self.ledger.take_orders(peer.rank)
            if self.relay is not None and orders:
                self.relay.watch(peer.rank, orders)
            wire.encode_orders(hdr, orders)
            link.orders_req = link.orders_msg.reqs[slot] = self.comm.Isend(
                buf, dest=peer.rank, tag=wire.TAG_REPLY)   # (no joiner holds rows)
            self._track(link, link.orders_req)
            self.bell.ring(peer.rank)
            peer.told_at = time.monotonic()
            if not self.ledger.has_orders(peer.rank):
                return

    def keep_alive(self, peer) -> None:
        """An empty ORDERS header, "rank 0 is here, keep waiting", for a worker rank 0 has
        sent nothing for a while (its watchdog ends it after a long silence: watchdog.py).
        Skipped while the previous orders are still on their way. Not rung: the worker
        finds it at its next poll."""
        link = peer.link
        if link.orders_req is not None and not C.finished(link.orders_req):
            return
        slot = link.orders_msg.take(C.finished)
        buf, hdr, _ = link.orders_msg.bufs[slot]
        wire.encode_orders(hdr, [])
        comm, dest = link.address(self.comm, peer.rank)
        link.orders_req = link.orders_msg.reqs[slot] = comm.Isend(buf, dest=dest, tag=wire.TAG_REPLY)
        self._track(link, link.orders_req)
        self.bell.ring(peer.rank, wake=False)   # counted, so that later rings stay numbered
        peer.told_at = time.monotonic()

    def _track(self, link, req) -> None:
        self.sending.append(req)
        if len(link.sends) >= 8:
            link.pending(C.finished)
        link.sent(req)

    def in_flight(self) -> bool:
        """True while some send is still under way (and MPI needs progress)."""
        self.sending = [r for r in self.sending if not C.finished(r)]
        return bool(self.sending)
