"""Messages from rank 0 to a worker: replies (parameters, or STOP) and send orders.

Each worker has preallocated reply buffers (two when pipelined: it computes on the previous
reply while the next is sent) and a header-only buffer for orders; wire.py encodes them.
Sends are nonblocking; the requests not known to be complete are kept so that the main loop
can keep MPI progressing while they travel.
"""

from __future__ import annotations

import numpy as np

from .. import wire
from ..wire import Cmd


class Outbox:
    """Sends to workers on `comm`; what a reply carries comes from the task ledger."""

    def __init__(self, comm, ledger):
        self.comm = comm
        self.ledger = ledger
        self.sending: list = []    # sends not known to be complete

    def reply(self, peer, params: np.ndarray, version: int, cmd: Cmd = Cmd.PARAMS,
              held_s: float = 0.0) -> None:
        """Send `peer` the parameters (or STOP) with the tasks, orders and cut it is owed,
        its batch size and the flags it must see (retry, drop)."""
        link = peer.link
        if link.reply_req is not None:
            link.reply_req.Wait()   # the previous reply was received before it pushed again
        slot = link.next_reply_slot()
        buf, hdr, payload = slot[0], slot[1], slot[2]
        if cmd == Cmd.STOP:
            wire.encode_reply(hdr, cmd, version=version, batch=peer.batch, held_s=held_s,
                              retry=peer.retry, drop=peer.drop)
            peer.retry = peer.drop = False
            link.reply_req = self.comm.Isend(buf[:wire.HEADER_BYTES], dest=peer.rank, tag=wire.TAG_REPLY)
            self.sending.append(link.reply_req)
            return
        assigns, orders, cut = self.ledger.take_reply(peer.rank, peer.batch)
        wire.encode_reply(hdr, cmd, version=version, batch=peer.batch, held_s=held_s,
                          retry=peer.retry, drop=peer.drop, assigns=assigns, orders=orders, cut=cut)
        peer.retry = peer.drop = False
        np.copyto(payload, params)
        slot[3] = version
        link.reply_req = self.comm.Isend(buf, dest=peer.rank, tag=wire.TAG_REPLY)
        self.sending.append(link.reply_req)

    def orders(self, peer) -> None:
        """Orders to send rows, for a worker that waits (idle, or its reply is held)."""
        link = peer.link
        while True:
            if link.orders_req is not None:
                link.orders_req.Wait()
            buf, hdr, _ = link.orders_msg
            wire.encode_orders(hdr, self.ledger.take_orders(peer.rank))
            link.orders_req = self.comm.Isend(buf, dest=peer.rank, tag=wire.TAG_REPLY)
            self.sending.append(link.orders_req)
            if not self.ledger.has_orders(peer.rank):
                return

    def in_flight(self) -> bool:
        """True while some send is still under way (and MPI needs progress)."""
        self.sending = [r for r in self.sending if not r.Test()]
        return bool(self.sending)
