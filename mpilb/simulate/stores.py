"""The stores of a simulated network run (netengine.py): rank 0's commands, each group's CPU,
and pushes answered piece by piece (``--chunk-kb``).

Each group of stores (:class:`~mpilb.simulate.network.Topology`) takes rank 0's commands in
its order, one CPU for the group: a push's slice is applied once it is there and its command
too (one latency after rank 0 decided; at once on rank 0's own group), and a slice still on
its way holds up the pushes decided after it, as ``SliceRank`` waits for each gradient in
turn. A slice that came whole is applied whole (``apply_s + 8 bytes per float /
--server-gbps``) and answered when applied.

A slice between a worker and a store on different nodes goes in chunks (as
:mod:`mpilb.mpi.chunks` plans them), which the store streams as ``Op.STREAM`` does: it steps
each chunk as it comes and sends that chunk of the new parameters before it waits for the
next. The model moves such a slice as :func:`pieces` equal pieces, one after the other
(chunks follow each other on one connection), and the store steps each piece on its CPU
once it is in (and the pushes before it are served) and sends that piece of the reply.
Rank 0, streaming its own slice of a push, decides no other push until it is done (``FREED``
says when).
"""

from __future__ import annotations

from collections import deque

# network events of a push and its reply (netengine.NetEngine._net): all of a slice (or its
# last piece) in, a store's whole reply leaves, a transfer of a reply in, a piece of a slice
# in, a piece of a reply leaves, rank 0 done streaming
ARRIVE, STORE_SEND, REPLY, PIECE, PIECE_SEND, FREED = range(6)

PIECES = 4
"""At most this many pieces a chunked slice: a piece is two transfers per push (its bytes
and its reply's), and the pieces' pipeline is within 1/PIECES of a slice of the chunks'."""


def pieces(floats: int, itemsize: int, kb: int) -> int:
    """How many pieces the model moves a slice of ``floats`` in, sent in chunks of about
    ``kb`` KB as the engine plans them: 0 where it goes as one message."""
    from mpilb.mpi.chunks import spans

    cut = spans(floats, itemsize, kb)
    return min(PIECES, len(cut)) if cut else 0


class StoreQueues:
    """The groups' command queues and CPUs. ``service``: seconds one push's slice takes a
    group's CPU; ``g0``: rank 0's group; events go out through ``fabric.later``."""

    def __init__(self, fabric, service: list[float], g0: int):
        self.fabric, self.service, self.g0 = fabric, service, g0
        self.free = [0.0] * len(service)     # when each group's CPU is next free
        self.busy = [0.0] * len(service)     # seconds each group's CPU worked
        # per group: (rank, flight, pieces or 0: whole) of the pushes rank 0 decided, in
        # its order, not yet served
        self.commands = [deque() for _ in service]

    def command(self, g: int, rank: int, flight, pieces: int) -> None:
        """Rank 0 decided ``flight`` (its ``decided`` time): group g serves it in turn."""
        self.commands[g].append((rank, flight, pieces))
        self.serve(g)

    def serve(self, g: int) -> None:
        """Serve group g's commands in order as far as their slices have come: a whole
        slice is applied and answered; a slice in pieces is stepped and answered piece by
        piece (``flight.pieces[g]``: when each piece came in, ``flight.stepped[g]``: how
        many were stepped)."""
        queue, later, svc = self.commands[g], self.fabric.later, self.service[g]
        lat = 0.0 if g == self.g0 else self.fabric.latency
        while queue:
            rank, flight, count = queue[0]
            ready = flight.decided + lat
            if count:
                came = flight.pieces[g]
                step = svc / count
                while flight.stepped[g] < len(came):
                    start = max(self.free[g], came[flight.stepped[g]], ready)
                    done = self.free[g] = start + step
                    flight.stepped[g] += 1
                    later(done, (PIECE_SEND, rank, g))
                if flight.stepped[g] < count:
                    return
                if g == self.g0:
                    later(self.free[g], (FREED, rank, g))
            else:
                arrived = flight.arrived[g]
                if arrived is None:
                    return
                done = self.free[g] = max(self.free[g], arrived, ready) + svc
                later(done, (STORE_SEND, rank, g))
            queue.popleft()
            self.busy[g] += svc
