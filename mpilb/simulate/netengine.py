"""The engine on a network (:mod:`.network`): pushes and replies as transfers between nodes.

As :class:`~mpilb.simulate.engine.Engine`, with the worker's link and the stores' one queue
replaced by the cluster's layout (async updates):

- a step's end sends each store its slice of the gradient (``--wire`` bytes per float): the
  slices to other nodes leave together through the worker node's ``up`` link and enter the
  store nodes' ``down`` links (a group of stores at once, see
  :class:`~mpilb.simulate.network.Topology`); the slice to a store on the worker's own node
  goes through that node's shared memory;
- rank 0 (the first store) decides when its slice (with the header) has arrived (in pieces:
  its first piece): the balancer observes the push, the ledger advances, coverage counts,
  the worker is topped up; its commands reach the other stores one latency later;
- the stores (:class:`~mpilb.simulate.stores.StoreQueues`) serve rank 0's commands in its
  order on their own CPUs (``apply_s + 8 bytes per float of a slice / --server-gbps``): a
  slice that came whole is applied, then its reply leaves (store node ``up`` -> worker node
  ``down``); a slice between nodes (``--chunk-kb``, as the engine chunks it) moves in
  pieces, one after the other, and the store steps and answers each piece as it comes, as
  ``Op.STREAM`` does; rank 0 decides nothing else while it streams its own slice;
- the worker's next step starts when every slice of the reply has arrived; with
  ``--pipeline 1`` (async's default, as for `train`) it computes the next batch while its
  push travels, from what it holds when it pushes (announced to rank 0 as the push's
  NEXT_SHARD/NEXT_HI), and pushes it when both the batch and the reply are there;
- a worker owed nothing goes idle when rank 0 sends it that reply (as the server's peers
  do), so an epoch's start or a move wakes it while that reply is still on its way; the
  wake is a reply of its own (the parameters again), sent once the first has arrived.
"""

from __future__ import annotations

import heapq
from collections import deque

from mpilb.errors import UsageError
from mpilb.core.decisions import CHORES_S
from mpilb.simulate.engine import Engine, summarize
from mpilb.simulate.workers import PUSH, REBALANCE, SimWorker
from mpilb.simulate.fabric import Fabric, PerLinkFabric
from mpilb.simulate.network import WIRE_BYTES, Layout, Topology
from mpilb.simulate.stores import (ARRIVE, FREED, PIECE, PIECE_SEND, REPLY, STORE_SEND,
                                   StoreQueues, pieces)


class _Batch:
    """A batch a worker computes: positions [lo, hi) of ``task``, its compute and I/O
    seconds, and when it is computed."""

    __slots__ = ("task", "lo", "hi", "comp", "io", "done")

    def __init__(self, task, lo: int, hi: int, comp: float, io: float, done: float):
        self.task, self.lo, self.hi = task, lo, hi
        self.comp, self.io, self.done = comp, io, done


class _InFlight:
    """One worker's push on its way (``batch``; None for a wake's reply alone): when its
    slices reached each group of stores (in pieces: when each piece did, how many the
    group stepped and how many of their replies left; the flows still to finish through
    shared memory), when rank 0 decided, how many transfers of the reply are still to come,
    the batch computed meanwhile (pipelined), and whether a wake must follow its reply."""

    __slots__ = ("sent", "arrived", "pieces", "stepped", "answered", "near", "decided",
                 "replies", "batch", "ahead", "wake")

    def __init__(self, sent: float, k: int, batch=None, replies: int = 0):
        self.sent = sent
        self.arrived: list = [None] * k
        self.pieces: list = [[] for _ in range(k)]
        self.stepped = [0] * k
        self.answered = [0] * k
        self.near: list = [[] for _ in range(k)]
        self.decided = None
        self.replies = replies or k
        self.batch = batch
        self.ahead = None
        self.wake = False


def next_range(tasks, batch: int, after):
    """(task, lo, hi) of a worker's next batch of ``batch`` from the ``tasks`` it holds:
    after ``after`` ((task, hi) of the batch just pushed) in the same task, else from the
    first position of the next task with work; None with nothing to do."""
    first = 0
    if after is not None:
        for k, task in enumerate(tasks):
            if task is after[0]:
                if after[1] < task.end:
                    return task, after[1], min(after[1] + batch, task.end)
                first = k + 1
                break
    for k in range(first, len(tasks)):
        task = tasks[k]
        if task.remaining > 0:
            return task, task.pos, min(task.pos + batch, task.end)
    return None


def far_flows(fab, t: float, src: int, dst: int, nbytes: float, m: int, up: bool) -> list:
    """The flows of ``nbytes`` to or from ``m`` stores of a group on other nodes: ``src``
    to ``dst``, coupled along the two links or one flow on each (weight m on the group's
    side: ``dst`` for a push, ``up``, else ``src``)."""
    if fab.coupled:
        return fab.path(t, (src, dst), nbytes, m)
    return [fab.flow(t, src, nbytes, 1 if up else m), fab.flow(t, dst, nbytes, m if up else 1)]


class NetEngine(Engine):
    """Simulate ``cfg`` on the workers of ``layout`` (``profiles``: one per MPI rank; the
    stores' entries are not used). Keywords as :class:`Engine`'s."""

    PIPELINES = True

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
        fabric = Fabric if layout.spec.coupled else PerLinkFabric
        self.fabric = fabric(topo.rates, topo.caps, layout.spec.latency_s, topo.bursts, topo.peaks)
        floats = layout.slice_floats(cfg.params)
        per_byte = 1.0 / (cfg.server_gbps * 1e9)
        wire = WIRE_BYTES[cfg.wire]
        self.g0 = topo.group_of_store[0]
        groups = topo.groups
        service = [cfg.apply_s + 8.0 * max(floats[s] for s in g) * per_byte for g in groups]
        self.stores = StoreQueues(self.fabric, service, self.g0)
        self.node = layout.node_of
        kb = getattr(cfg, "chunk_kb", 0)
        # per node, per group: (stores elsewhere, their bytes, bytes of the store on the
        # node, the pieces the bytes elsewhere go in: 0 where they go whole)
        self.plan = {}
        for node in {self.node[r] for r in ranks}:
            rows = []
            for g in groups:
                far = [s for s in g if layout.store_nodes[s] != node]
                near = [s for s in g if layout.store_nodes[s] == node]
                count = max((pieces(floats[s], wire, kb) for s in far), default=0)
                rows.append((len(far), wire * sum(floats[s] for s in far),
                             wire * sum(floats[s] for s in near), count))
            self.plan[node] = rows
        self.rank0_busy = False     # rank 0 streams its slice of a push: it decides no other
        self.headers: deque = deque()   # (worker, flight) whose headers wait for rank 0
        self.flight: dict[int, _InFlight] = {}     # rank -> its push or reply on the way
        self.computing: dict[int, _Batch] = {}     # rank -> the batch it computes (or holds)
        self.stray = 0     # samples pushed outside the pusher's task (never, by the cut rule)
        self.comm_total = self.step_total = 0.0

    # -- hooks of the engine ------------------------------------------------------------
    def _link(self, w: SimWorker, t: float) -> float:
        return self.fabric.latency      # a message from rank 0

    def _nobody_busy(self) -> bool:
        return not self.flight and not self.computing

    def wake(self, w: SimWorker, t: float, floor) -> None:
        """Rank 0 sends idle ``w`` a reply with its work (the parameters cross the links
        again); after the reply on its way, if one is."""
        w.compute()
        flight = self.flight.get(w.rank)
        if flight is not None:
            flight.wake = True
        else:
            self._send_reply(w, t)

    def _send_reply(self, w: SimWorker, t: float) -> None:
        """A reply to no push (a wake): every store sends its slice."""
        flight = self.flight[w.rank] = _InFlight(t, len(self.plan[self.node[w.rank]]))
        flight.decided = t
        for g in range(len(flight.arrived)):
            self.fabric.later(t if g == self.g0 else t + self.fabric.latency,
                              (STORE_SEND, w.rank, g))

    def _drop(self, w: SimWorker, t: float) -> None:
        self.computing.pop(w.rank, None)   # it hung, crashed or left: that batch never comes
        super()._drop(w, t)

    # -- a worker's steps -------------------------------------------------------------
    def _start(self, w: SimWorker, t: float) -> None:
        """A reply reached w at ``t`` (or it was woken): push the batch it computed ahead
        once that is done, else start a batch from what it holds, or go idle."""
        if w.dead or self.changes.departs(self, w, t):
            return
        w.reply_t = t
        self.ledger.reply(w.rank, w.batch)
        ahead = self.computing.get(w.rank)
        if ahead is not None:
            if ahead.done <= t:
                self._push(w, ahead, t)
            # else: the batch's own PUSH event pushes it
            return
        if self._compute(w, t, None) is None:
            w.go_idle()

    def _compute(self, w: SimWorker, t: float, after):
        """w starts, at ``t``, its next batch after ``after`` ((task, hi) of the batch just
        pushed; None: from where its tasks stand); returns it, or None with nothing to do
        (or when w hangs or crashes)."""
        pick = None if w.batch <= 0 or w.benched else next_range(self.ledger.tasks(w.rank),
                                                                    w.batch, after)
        if pick is None:
            return None
        if t >= w.fault_t:
            self._die(w, t)
            return None
        task, lo, hi = pick
        p = w.profile
        i = p.piece(t)
        n = hi - lo
        io = n * p.io[i] if self.replay else self._read_wait(w, task, t)
        comp = w.jittered(n * p.compute[i])
        if w.rules:
            comp, io = w.injected(t, comp, io, self.replay)
        done = t + io + comp
        if done >= w.fault_t:
            self._die(w, t)
            return None
        batch = self.computing[w.rank] = _Batch(task, lo, hi, comp, io, done)
        w.compute()
        self._at(done, PUSH, w.rank)
        return batch

    def run(self) -> dict:
        self._begin_epoch(0, 0.0)
        self._at(max(self.cfg.rebalance_interval, CHORES_S), REBALANCE)
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
        res["server_busy"] = min(1.0, max(self.stores.busy) / total)
        res["servers"] = self.k
        spec = self.layout.spec
        carried = [fab.moved[r] / (fab.rate[r] * total) for r in self.topo.links]
        res["network"] = {"nodes": spec.nodes, "stores": self.k, "wire": self.cfg.wire,
                          "per_node": self.k == spec.nodes,
                          "link_sharing": "coupled" if spec.coupled else "per-link",
                          "busiest_link": min(1.0, max(carried)) if carried else 0.0,
                          "comm_share": self.comm_total / self.step_total
                          if self.step_total else 0.0}
        return res

    def _on_push(self, w: SimWorker, t: float) -> None:
        """w's batch is computed at ``t``: pushed now, unless the reply to its last push
        is still on the way (then at the reply)."""
        batch = self.computing.get(w.rank)
        if batch is None or batch.done > t or w.rank in self.flight or w.dead:
            return
        self._push(w, batch, t)

    def _push(self, w: SimWorker, batch: _Batch, t: float) -> None:
        """w pushes ``batch`` at ``t``: its slices leave for the stores; pipelined, it
        starts its next batch."""
        plan = self.plan[self.node[w.rank]]
        del self.computing[w.rank]
        replies = sum(row[3] or 1 for row in plan)   # (a reply in pieces: one transfer each)
        flight = self.flight[w.rank] = _InFlight(t, len(plan), batch, replies)
        if self.cfg.pipeline:
            flight.ahead = self._compute(w, t, (batch.task, batch.hi))
        self._send(w, flight, t)

    def _send(self, w: SimWorker, flight: _InFlight, t: float) -> None:
        """w's push moves from ``t``: the slices to other nodes through its node's ``up``
        link and the store nodes' ``down`` (in pieces: the first now, each next one when
        the one before is through), the one to its own node's store through shared
        memory."""
        fab, topo, a = self.fabric, self.topo, self.node[w.rank]
        plan = self.plan[a]
        if not fab.coupled:   # per link: one flow on the up link for the slices sent whole
            whole = sum(row[1] for row in plan if not row[3])
            up = fab.flow(t, topo.up[a], whole) if whole else None
        for g, (m, far, near, count) in enumerate(plan):
            near_flows = [fab.flow(t, topo.shm[a], near)] if near else []
            if count:
                flight.near[g] = near_flows
                self._piece(t, w.rank, g, flight)
                continue
            if not m:
                flows = []
            elif fab.coupled:
                flows = fab.path(t, (topo.up[a], topo.group_down[g]), far, m)
            else:
                flows = [up, fab.flow(t, topo.group_down[g], far, m)]
            fab.transfer(t, flows + near_flows, (ARRIVE, w.rank, g))

    def _piece(self, t: float, rank: int, g: int, flight: _InFlight) -> None:
        """The next piece of ``rank``'s slices to group g leaves (the last one: ARRIVE once
        it and the bytes through shared memory are in)."""
        a, topo = self.node[rank], self.topo
        m, far, near, count = self.plan[a][g]
        flows = far_flows(self.fabric, t, topo.up[a], topo.group_down[g], far / count, m, True)
        if len(flight.pieces[g]) == count - 1:
            self.fabric.transfer(t, flows + flight.near[g], (ARRIVE, rank, g))
        else:
            self.fabric.transfer(t, flows, (PIECE, rank, g))

    def _reply(self, t: float, rank: int, g: int, far: float, near: float, m: int) -> None:
        """Group g sends ``rank`` ``far`` bytes from stores on other nodes, ``near`` from
        the store on its node."""
        fab, topo, a = self.fabric, self.topo, self.node[rank]
        flows = far_flows(self.fabric, t, topo.group_up[g], topo.down[a], far, m, False) if far else []
        if near:
            flows.append(fab.flow(t, topo.shm[a], near))
        fab.transfer(t, flows, (REPLY, rank, g))

    # -- network events -----------------------------------------------------------------
    def _net(self, t: float, token) -> None:
        what, rank, g = token
        w = self.workers[rank]
        if what == FREED:       # rank 0 streamed its slice: the next header in
            self.rank0_busy = False
            while self.headers and not self.rank0_busy:
                self._decide(*self.headers.popleft(), t)
            return
        flight = self.flight[rank]
        m, far, near, count = self.plan[self.node[rank]][g]
        if what == PIECE or what == ARRIVE:
            if what == ARRIVE:
                flight.arrived[g] = t
            if count:
                flight.pieces[g].append(t)
                if what == PIECE:
                    self._piece(t, rank, g, flight)
            if g == self.g0 and len(flight.pieces[g]) <= 1:   # (a slice whole: none)
                self._header(w, flight, t)
            else:
                self.stores.serve(g)
        elif what == STORE_SEND:
            self._reply(t, rank, g, far, near, m)
        elif what == PIECE_SEND:
            flight.answered[g] += 1
            last = flight.answered[g] == count
            self._reply(t, rank, g, far / count, near if last else 0.0, m)
        else:
            flight.replies -= 1
            if flight.replies == 0:
                self._replied(w, flight, t)

    def _replied(self, w: SimWorker, flight: _InFlight, t: float) -> None:
        """Every slice of a reply reached w at ``t``."""
        del self.flight[w.rank]
        batch = flight.batch
        if batch is not None:
            # waiting for the reply: after the push, or after the batch computed meanwhile
            ahead = flight.ahead
            w.comm = t - (flight.sent if ahead is None else max(flight.sent, ahead.done))
            w.comm = max(0.0, w.comm)
            self.comm_total += w.comm
            self.step_total += batch.comp + batch.io + w.comm
            w.epoch_busy += batch.comp + batch.io + w.comm
        if flight.wake:
            self._send_reply(w, t)    # the wake follows the reply it waited for
        elif not w.idle:
            self._start(w, t)

    def _header(self, w: SimWorker, flight: _InFlight, t: float) -> None:
        """Rank 0 has w's header and its slice (chunked: its first chunk): decided now, or
        once rank 0 has streamed the push it serves."""
        if self.rank0_busy:
            self.headers.append((w, flight))
        else:
            self._decide(w, flight, t)

    def _decide(self, w: SimWorker, flight: _InFlight, t: float) -> None:
        """The server's side of the push; a worker then owed nothing is idle from this
        reply on (the server's view)."""
        batch, ahead = flight.batch, flight.ahead
        w.n, w.comp, w.io = batch.hi - batch.lo, batch.comp, batch.io
        self.ledger.note_next(w.rank, ahead.task.shard if ahead is not None else -1,
                              ahead.hi if ahead is not None else 0)
        tasks = self.ledger.tasks(w.rank)
        flight.decided = t
        if tasks and tasks[0] is batch.task and batch.lo == batch.task.pos:
            task, lo, hi = self._received(w, t)
            self.running += 1            # (the engine's count: _received took it back)
            self.updates += 1
            self.ledger.record(task.epoch, task.shard, lo, hi)
        else:
            self.stray += w.n            # outside its task: dropped, as the server does
        stores, plan = self.stores, self.plan[self.node[w.rank]]
        done = max(stores.free[self.g0], t) + stores.service[self.g0]
        for g in range(len(plan)):
            count = plan[g][3]
            if count and g == self.g0:
                self.rank0_busy = True
            stores.command(g, w.rank, flight, count)
        if self._applied(w, done):
            return
        if not self.ledger.tasks_ledger.of[w.rank].owed and w.rank not in self.computing:
            w.go_idle()
