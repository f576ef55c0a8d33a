"""Shard rows for workers that joined a `--store local` run, relayed by rank 0.

A joiner reaches rank 0 only, on a communicator of its own (admission.py); the job's
workers cannot address it. It reads the shards its node holds itself
(worker/row_exchange.node_shards); a task on any other shard is given it as to any worker
without a copy: its holder is ordered to send the rows. The holder sends them to rank 0
(the same two messages, x then y, with the transfer's tag), and rank 0 sends them on to the
joiner on its communicator with that tag. Rank 0 posts its receives when the order leaves
in a reply or an ORDERS message (:meth:`RowRelay.watch`, from the outbox) and sends each
transfer on once both parts are in, among its chores (:meth:`RowRelay.progress`). The rows
pass through rank 0's memory once; nothing is pickled.

Joiners send no rows (the ledger's `readers`): a joiner's part-way move goes only to a
worker that reads the shard itself, and a lost holder's rows are re-sourced among the job's
own workers, whose copies every receiver posted receives for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from mpilb.mpi import comm as C


@dataclass
class Relayed:
    """One transfer for a joiner: rows from `giver` (a rank of the job) to worker `dst`."""

    giver: int
    dst: int
    tag: int
    receives: list
    x: np.ndarray
    y: np.ndarray
    sends: list | None = None   # once both parts are in: the sends to the joiner


class RowRelay:
    """Rank 0's relays of shard rows to the workers that joined.

    Args:
        comm: the world communicator (the holders send there).
        dataset: the run's dataset (the rows' shapes and label type).
        peers: the workers by id (a joiner's link names its communicator).
        sending: where sends are kept for rank 0's MPI progress (the outbox's `sending`).
    """

    def __init__(self, comm, dataset, peers: dict, sending: list):
        self.comm = comm
        self.size = comm.Get_size()
        self.sample_shape = tuple(dataset.sample_shape)
        self.y_dtype, self.target_shape = dataset.label_dtype, tuple(dataset.target_shape)
        self.peers = peers
        self.sending = sending
        self.transfers: list[Relayed] = []
        self.closed: set[int] = set()   # joiners let go and disconnected (admission.py)
        self.relayed_rows = 0

    def watch(self, giver: int, orders) -> None:
        """`giver` is sent `orders`: post the receives of the rows it sends to a joiner."""
        for order in orders:
            if order.dst < self.size:
                continue
            rows = order.end - order.start
            x = np.empty((rows, *self.sample_shape), dtype=np.float32)
            y = np.empty((rows, *self.target_shape), dtype=self.y_dtype)
            receives = [self.comm.Irecv(x, source=giver, tag=order.tag),
                        self.comm.Irecv(y, source=giver, tag=order.tag + 1)]
            self.sending.extend(receives)
            self.transfers.append(Relayed(giver, order.dst, order.tag, receives, x, y))

    def progress(self) -> None:
        """Rows that arrived go on to their joiner; transfers done (or from a holder lost
        or let go, whose rows the ledger orders again from another copy) are let go."""
        if not self.transfers:
            return
        kept = []
        for t in self.transfers:
            if t.sends is None:
                if C.Request.Testall(t.receives):
                    self._send_on(t)
                elif self.peers[t.giver].lost or self.peers[t.giver].left:
                    for req in t.receives:
                        req.Cancel()
                    continue
            if t.sends is None or not C.Request.Testall(t.sends):
                kept.append(t)
        self.transfers = kept

    def _send_on(self, t: Relayed) -> None:
        peer = self.peers.get(t.dst)
        if (peer is None or peer.lost or t.dst in self.closed or peer.link is None
                or peer.link.comm is None):
            t.sends = []   # nobody to take them: received (the holder's sends end), dropped
            return
        comm, dest = peer.link.comm, peer.link.dest
        t.sends = [comm.Isend(t.x, dest=dest, tag=t.tag), comm.Isend(t.y, dest=dest, tag=t.tag + 1)]
        self.sending.extend(t.sends)
        self.relayed_rows += len(t.x)

    def pending_for(self, rank: int) -> bool:
        """Are rows for worker `rank` still to be received or sent on?"""
        return any(t.dst == rank for t in self.transfers)

    def finish(self, timeout: float = 30.0) -> None:
        """The job's end: the transfers still under way are completed (the holders' sends
        and the joiners' receives of them must end before the job does)."""
        deadline = time.monotonic() + timeout
        backoff = C.Backoff()
        while self.transfers and time.monotonic() < deadline:
            self.progress()
            backoff.sleep()


def hold_node_copies(server, rank: int, host: str) -> RowRelay:
    """--store local: joiner `rank` on `host` reads the shards placed on the job's workers
    there (its node's disk holds them) and is one more holder of them, one that sends no
    rows (the ledger's `readers`); every other shard's rows reach it through rank 0.
    Returns the server's relay (made at the first joiner)."""
    from mpilb.worker.row_exchange import node_shards

    ledger = server.ledger
    ledger.readers.add(rank)
    for shard in node_shards(len(ledger.shard_sizes), host, server.ranks,
                             server.cfg.inputs.replicas, getattr(server, "hostnames", [])):
        ledger.holders[shard].append(rank)   # (the balancer's map too: the same lists)
    if server.outbox.relay is None:
        server.outbox.relay = RowRelay(server.comm, server.dataset, server.peers,
                                       server.outbox.sending)
    return server.outbox.relay
