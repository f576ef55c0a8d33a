"""The engine on a network (:mod:`.network`): pushes and replies as transfers between nodes.

As :class:`~mpilb.simulate.engine.Engine`, with the worker's link and the stores' one queue
replaced by the cluster's layout (async updates):

- a step's end sends each store its slice of the gradient (``--wire`` bytes per float): the
  slices to other nodes leave together through the worker node's ``up`` link and enter the
  store nodes' ``down`` links (a group of stores at once, see
  :class:`~mpilb.simulate.network.Topology`); the slice to a store on the worker's own node
  goes through that node's shared memory;
- rank 0 (the first store) decides when its slice (with the header) has arrived: the
  balancer observes the push, the ledger advances, coverage counts, the worker is topped up;
  its commands reach the other stores one latency later;
- the stores apply their slices when they have both the slice and the command, on their own
  CPUs (a FIFO queue: ``apply_s + 8 bytes per float of a slice / --server-gbps``), then send
  the worker its slices of the parameters (store node ``up`` -> worker node ``down``);
- the worker's next step starts when every slice of the reply has arrived.
"""

from __future__ import annotations

import heapq

from mpilb.errors import UsageError
from mpilb.simulate.engine import Engine, summarize
from mpilb.simulate.workers import REBALANCE, SimWorker
from mpilb.simulate.network import WIRE_BYTES, Fabric, Layout, Topology

ARRIVE, STORE_SEND, REPLY = 0, 1, 2


class _InFlight:
    """One worker's push on its way: when its slices reached each group of stores, when
    rank 0 decided, how many groups' replies are still to come."""

    __slots__ = ("sent", "arrived", "decided", "replies")

    def __init__(self, sent: float, k: int):
        self.sent = sent
        self.arrived: list = [None] * k
        self.decided = None
        self.replies = k


class NetEngine(Engine):
    """Simulate ``cfg`` on the workers of ``layout`` (``profiles``: one per MPI rank; the
    stores' entries are not used). Keywords as :class:`Engine`'s."""

    def __init__(self, cfg, profiles, shard_sizes, replay: bool = False, *, layout: Layout):
        if cfg.mode != "async":
            raise UsageError("--mode sync on a network (--nodes/--link-rate) is not simulated "
                             "yet: drop the network options for sync rounds")
        if cfg.wire not in WIRE_BYTES:
            raise UsageError(f"--wire {cfg.wire!r}: valid: {', '.join(WIRE_BYTES)}")
        ranks = layout.worker_ranks
        super().__init__(cfg, [profiles[r] for r in ranks], shard_sizes, replay, ranks=ranks)
        self.layout = layout
        self.k = layout.k
        topo = self.topo = Topology(layout)
        self.fabric = Fabric(topo.rates, topo.caps, layout.spec.latency_s)
        floats = layout.slice_floats(cfg.params)
        per_byte = 1.0 / (cfg.server_gbps * 1e9)
        wire = WIRE_BYTES[cfg.wire]
        self.g0 = topo.group_of_store[0]
        groups = topo.groups
        self.service = [cfg.apply_s + 8.0 * max(floats[s] for s in g) * per_byte for g in groups]
        self.free = [0.0] * len(groups)
        self.store_busy = [0.0] * len(groups)
        self.node = layout.node_of
        # per node, per group: (stores elsewhere, their bytes, bytes of the store on the node)
        self.plan = {}
        for node in {self.node[r] for r in ranks}:
            rows = []
            for g in groups:
                far = [s for s in g if layout.store_nodes[s] != node]
                near = [s for s in g if layout.store_nodes[s] == node]
                rows.append((len(far), wire * sum(floats[s] for s in far),
                             wire * sum(floats[s] for s in near)))
            self.plan[node] = rows
        self.flight: dict[int, _InFlight] = {}
        self.comm_total = self.step_total = 0.0

    # -- hooks of the engine ------------------------------------------------------------
    def _link(self, w: SimWorker, t: float) -> float:
        return self.fabric.latency      # a message from rank 0 (an idle worker woken)

    def _push_delay(self, w: SimWorker, t: float) -> float:
        return 0.0                      # the push's transfers are simulated

    def run(self) -> dict:
        self._begin_epoch(0, 0.0)
        self._at(self.cfg.rebalance_interval, REBALANCE)
        heap, fab = self.heap, self.fabric
        while heap and not self.done:
            if heap[0][0] <= fab.next_time():
                self._event(*heapq.heappop(heap))
                continue
            t, kind, token = fab.pop()
            self.now = t
            if kind:
                self._net(t, token)
        res = summarize(self)
        total = max(self.now, 1e-12)
        res["server_busy"] = min(1.0, max(self.store_busy) / total)
        res["servers"] = self.k
        spec = self.layout.spec
        carried = [fab.moved[r] / (fab.rate[r] * total) for r in self.topo.links]
        res["network"] = {"nodes": spec.nodes, "stores": self.k, "wire": self.cfg.wire,
                          "per_node": self.k == spec.nodes,
                          "busiest_link": min(1.0, max(carried)) if carried else 0.0,
                          "comm_share": self.comm_total / self.step_total
                          if self.step_total else 0.0}
        return res

    def _on_push(self, w: SimWorker, t: float) -> None:
        """w's step is done at ``t``: its slices leave for the stores."""
        fab, topo, a = self.fabric, self.topo, self.node[w.rank]
        plan = self.plan[a]
        self.flight[w.rank] = _InFlight(t, len(plan))
        far_bytes = sum(row[1] for row in plan)
        up = fab.flow(t, topo.up[a], far_bytes) if far_bytes else None
        for g, (m, far, near) in enumerate(plan):
            flows = [up, fab.flow(t, topo.group_down[g], far, m)] if m else []
            if near:
                flows.append(fab.flow(t, topo.shm[a], near))
            fab.transfer(t, flows, (ARRIVE, w.rank, g))

    # -- network events -----------------------------------------------------------------
    def _net(self, t: float, token) -> None:
        what, rank, g = token
        w = self.workers[rank]
        flight = self.flight[rank]
        if what == ARRIVE:
            flight.arrived[g] = t
            if g == self.g0:
                self._decide(w, flight, t)
            elif flight.decided is not None:
                self._apply(w, g, max(t, flight.decided + self.fabric.latency))
        elif what == STORE_SEND:
            fab, topo, a = self.fabric, self.topo, self.node[rank]
            m, far, near = self.plan[a][g]
            flows = [fab.flow(t, topo.group_up[g], far, m), fab.flow(t, topo.down[a], far)] if m else []
            if near:
                flows.append(fab.flow(t, topo.shm[a], near))
            fab.transfer(t, flows, (REPLY, rank, g))
        else:
            flight.replies -= 1
            if flight.replies == 0:
                del self.flight[rank]
                w.comm = t - flight.sent
                self.comm_total += w.comm
                self.step_total += w.comp + w.io + w.comm
                w.epoch_busy += w.comp + w.io + w.comm
                self.running -= 1
                self._start(w, t)

    def _decide(self, w: SimWorker, flight: _InFlight, t: float) -> None:
        """Rank 0 has the header and its slice: the server's side of the push."""
        task, lo, hi = self._received(w, t)
        self.running += 1               # still busy: waiting for its reply
        flight.decided = t
        self.updates += 1
        self.ledger.record(task.epoch, task.shard, lo, hi)
        lat = self.fabric.latency
        done = self._apply(w, self.g0, t)
        for g, arrived in enumerate(flight.arrived):
            if g != self.g0 and arrived is not None:
                self._apply(w, g, max(arrived, t + lat))
        self._applied(w, done)

    def _apply(self, w: SimWorker, g: int, ready: float) -> float:
        """Group g's stores apply w's slices once ``ready``; their replies leave when applied."""
        start = self.free[g] if self.free[g] > ready else ready
        done = self.free[g] = start + self.service[g]
        self.store_busy[g] += self.service[g]
        self.fabric.later(done, (STORE_SEND, w.rank, g))
        return done

