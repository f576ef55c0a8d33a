"""Pushes answered chunk by chunk (train's --chunk-kb): the network engine's part for them.

Where a worker and a store are on different nodes the engine sends the slice in chunks of
about --chunk-kb KB, and the store steps each chunk as it comes and sends that chunk of the
parameters back (server/store_streams.py; rank 0 too, ServerGroup.stream): a reply travels
while its push still arrives. Rank 0 takes the pushes whose header is in one at a time, as
its receive loop hands them over (all those that came, in rank order: ``Testsome``), decides
each (the balancer's side, the commands to the other stores) and then streams its own slice
of it, busy until that slice's last chunk is in; the other stores stream every push they are
commanded at once. Modelled as flows:

- a store's reply to a push leaves once the store has the command (rank 0: once it takes
  the push) and one chunk of the push is in, and its last chunk reaches the worker no
  earlier than one chunk's time up and down after the push's slice is all in;
- a slice through shared memory (the worker's own node's store) is answered whole, once in;
- a worker whose last push kept rank 0 waiting over ``DEFER_S`` for its slice (a slow link)
  has its next push taken once its slice is in, as the server's receive loop defers it
  (server/receive.py), and streamed again once one came within that.

One difference from the engine, on purpose: the engine defers every worker's first push too
(a slow link's would hold rank 0 before it is known slow); here the first is streamed. With
the first deferred, one store's four clients on the validation's box (4 MB slices, 1 Gbit/s)
start together, their first pushes share rank 0's link exactly fairly and end together, and
the clients stay in that lock-step: 23.8 updates/s predicted against 28.9 measured (bf16
50.1 against 58.7), where streaming the first push staggers them as real TCP flows are
staggered (29.3 and 56.3). It costs one push per worker per run.

With ``--chunk-kb 0`` pushes and replies are whole slices (netengine.py's path).
"""

from __future__ import annotations

from collections import deque

from mpilb.core.decisions import DEFER_S
from mpilb.mpi.chunks import chunk_count

ARRIVE, STORE_SEND, REPLY, HEADER, TAKE = 0, 1, 2, 3, 4


def chunk_seconds(plan: dict, topo, kb: int) -> dict:
    """node -> per group of stores: (one chunk's seconds up the node's link, down it) for
    the slices its workers send that group across the network, or None (none: all through
    shared memory)."""
    out = {}
    for node, rows in plan.items():
        per = []
        for m, far, near in rows:
            if not m:
                per.append(None)
                continue
            slice_bytes = far / m
            c = slice_bytes / chunk_count(slice_bytes, kb)
            per.append((c / topo.rates[topo.up[node]], c / topo.rates[topo.down[node]]))
        out[node] = per
    return out


class StreamedPushes:
    """The network engine's streamed pushes (mixed into NetEngine; see the module)."""

    def _streams_init(self, kb: int) -> None:
        self.streamed = kb > 0
        self.chunk = chunk_seconds(self.plan, self.topo, kb) if self.streamed else {}
        self.r0_queue: list = []          # pushes whose header reached rank 0, not handed over
        self.r0_batch: deque = deque()    # those handed over, in rank order
        self.r0_current = None            # the push whose slice rank 0 streams now (its rank)
        self.r0_taken = 0.0               # ... since when
        self.deferring: set = set()       # workers whose pushes are taken once in (DEFER_S)
        self.held: set = set()            # their pushes whose header came, slice not yet

    def _tail(self, rank: int, g: int) -> float:
        c = self.chunk[self.node[rank]][g]
        return 0.0 if c is None else c[0] + c[1]

    def _header(self, rank: int, t: float) -> None:
        self.r0_queue.append(rank)
        if self.r0_current is None:
            self._take(t)

    def _take(self, t: float) -> None:
        """Rank 0 takes the next push handed over: decides it and streams its own slice
        (busy until that slice is in); when none is left, it takes every header that came."""
        while self.r0_current is None and (self.r0_queue or self.r0_batch):
            if not self.r0_batch:
                self.r0_batch = deque(sorted(self.r0_queue))
                self.r0_queue.clear()
            rank = self.r0_batch.popleft()
            flight = self.flight.get(rank)
            if flight is None or flight.tails is None:
                continue   # (its worker was dropped)
            arrived = flight.arrived[self.g0]
            if rank in self.deferring and arrived is None:
                self.held.add(rank)   # taken once its slice is in (_streamed_arrival)
                continue
            if rank in self.deferring:   # (its wait since the header decides the next)
                if arrived - (flight.sent + self.fabric.latency) <= DEFER_S:
                    self.deferring.discard(rank)
            w = self.workers[rank]
            self.r0_current, self.r0_taken = rank, t
            self._decide(w, flight, t)   # (all in already: stepped whole, _stream_send)
            if arrived is not None:
                self.r0_current = None
                done = self.free[self.g0]
                if done > t:
                    self.fabric.later(done, (TAKE, -1, -1))
                    return

    def _streamed_arrival(self, w, flight, g: int, t: float) -> None:
        """Group g has all of w's streamed slice at ``t``: rank 0's stream of it ends; a
        reply waiting for its last chunk sends it."""
        if g == self.g0 and self.r0_current == w.rank:
            self.r0_current = None
            if t - self.r0_taken > DEFER_S:   # it kept rank 0 waiting: its next is deferred
                self.deferring.add(w.rank)
            done = self._apply(w, g, t, send=False)
            self.fabric.later(done, (TAKE, -1, -1))
        elif g == self.g0 and w.rank in self.held:   # a deferred push is in: handed over
            self.held.discard(w.rank)
            self._header(w.rank, t)
        if flight.tails[g]:
            self.fabric.later(t + self._tail(w.rank, g), (REPLY, w.rank, g))
            flight.tails[g] = False
        if g != self.g0:
            self._serve(g)

    def _reply_held(self, flight, rank: int, g: int, t: float) -> bool:
        """A streamed reply's flows are through at ``t``: True where its last chunk must
        still wait for the push's (it is sent then)."""
        if flight.tails is None or flight.tails[g] is not None:
            return False
        a = flight.arrived[g]
        if a is not None and t >= a + self._tail(rank, g):
            return False
        if a is None:
            flight.tails[g] = True    # sent when the slice is in (_streamed_arrival)
        else:
            flight.tails[g] = False
            self.fabric.later(a + self._tail(rank, g), (REPLY, rank, g))
        return True

    def _stream_send(self, w, flight, g: int, ready: float) -> None:
        """Group g answers w's streamed push from ``ready`` (it has the command): from its
        first chunk across the network; a slice through shared memory, or one all in
        already, whole once applied."""
        c = self.chunk[self.node[w.rank]][g]
        if flight.arrived[g] is not None:   # all in already: stepped whole, then answered
            self._apply(w, g, max(flight.arrived[g], ready))
            return
        if c is None:   # sent now, its end held until the slice is in
            self.fabric.later(ready, (STORE_SEND, w.rank, g))
            return
        if g != self.g0:
            self.store_busy[g] += self.service[g]
        self.fabric.later(max(ready, flight.sent + c[0]), (STORE_SEND, w.rank, g))
