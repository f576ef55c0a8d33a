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
- the worker's next step starts when every slice of the reply has arrived; with
  ``--pipeline 1`` (async's default, as for `train`) it computes the next batch while its
  push travels, from what it holds when it pushes (announced to rank 0 as the push's
  NEXT_SHARD/NEXT_HI), and pushes it when both the batch and the reply are there;
- a worker owed nothing goes idle when rank 0 sends it that reply (as the server's peers
  do), so an epoch's start or a move wakes it while that reply is still on its way; the
  wake is a reply of its own (the parameters again), sent once the first has arrived;
- with ``--chunk-kb`` (128 by default, as train's) the slices between nodes are streamed
  (streams.py): rank 0 takes the pushes one at a time as their headers come, and the stores
  answer each push as its chunks arrive; the list above is the whole-slice path (``0``).
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
from mpilb.simulate.streams import ARRIVE, HEADER, REPLY, STORE_SEND, TAKE, StreamedPushes


class _Batch:
    """A batch a worker computes: positions [lo, hi) of ``task``, its compute and I/O
    seconds, and when it is computed."""

    __slots__ = ("task", "lo", "hi", "comp", "io", "done")

    def __init__(self, task, lo: int, hi: int, comp: float, io: float, done: float):
        self.task, self.lo, self.hi = task, lo, hi
        self.comp, self.io, self.done = comp, io, done


class _InFlight:
    """One worker's push on its way (``batch``; None for a wake's reply alone): when its
    slices reached each group of stores, when rank 0 decided, how many groups' replies are
    still to come, the batch computed meanwhile (pipelined), and whether a wake must follow
    its reply."""

    __slots__ = ("sent", "arrived", "decided", "replies", "batch", "ahead", "wake", "tails")

    def __init__(self, sent: float, k: int, batch=None):
        self.sent = sent
        self.arrived: list = [None] * k
        self.decided = None
        self.replies = k
        self.batch = batch
        self.ahead = None
        self.wake = False
        self.tails = None   # streamed (streams.py): per group, whether its reply's last chunk waits


def next_range(ledger, w: SimWorker, after):
    """(task, lo, hi) of w's next batch, from the tasks it holds: after ``after`` in the same
    task, else from the first position of the next task with work."""
    if w.batch <= 0 or w.benched:
        return None
    tasks = ledger.tasks(w.rank)
    first = 0
    if after is not None:
        for k, task in enumerate(tasks):
            if task is after[0]:
                if after[1] < task.end:
                    return task, after[1], min(after[1] + w.batch, task.end)
                first = k + 1
                break
    for k in range(first, len(tasks)):
        task = tasks[k]
        if task.remaining > 0:
            return task, task.pos, min(task.pos + w.batch, task.end)
    return None


class NetEngine(StreamedPushes, Engine):
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
        self.service = [cfg.apply_s + 8.0 * max(floats[s] for s in g) * per_byte for g in groups]
        self.free = [0.0] * len(groups)
        # per group of stores but rank 0's: the pushes rank 0 decided, in its order, not
        # applied yet (a store takes rank 0's commands in order, and waits for each slice)
        self.commands = [deque() for _ in groups]
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
        self.flight: dict[int, _InFlight] = {}     # rank -> its push or reply on the way
        self.computing: dict[int, _Batch] = {}     # rank -> the batch it computes (or holds)
        self.stray = 0     # samples pushed outside the pusher's task (never, by the cut rule)
        self.comm_total = self.step_total = 0.0
        self._streams_init(cfg.chunk_kb)

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
        pick = next_range(self.ledger, w, after)
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
        res["server_busy"] = min(1.0, max(self.store_busy) / total)
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
        a = self.node[w.rank]
        plan = self.plan[a]
        del self.computing[w.rank]
        flight = self.flight[w.rank] = _InFlight(t, len(plan), batch)
        if self.cfg.pipeline:
            flight.ahead = self._compute(w, t, (batch.task, batch.hi))
        self._send(w, t)

    def _send(self, w: SimWorker, t: float) -> None:
        """w's push moves from ``t``: the slices to other nodes through its node's ``up``
        link and the store nodes' ``down``, the one to its own node's store through shared
        memory."""
        fab, topo, a = self.fabric, self.topo, self.node[w.rank]
        plan = self.plan[a]
        if not fab.coupled:   # per link: one flow on the up link for every store's slice
            far_bytes = sum(row[1] for row in plan)
            up = fab.flow(t, topo.up[a], far_bytes) if far_bytes else None
        for g, (m, far, near) in enumerate(plan):
            if not m:
                flows = []
            elif fab.coupled:
                flows = fab.path(t, (topo.up[a], topo.group_down[g]), far, m)
            else:
                flows = [up, fab.flow(t, topo.group_down[g], far, m)]
            if near:
                flows.append(fab.flow(t, topo.shm[a], near))
            fab.transfer(t, flows, (ARRIVE, w.rank, g))
        if self.streamed:   # the header reaches rank 0 first (streams.py)
            self.flight[w.rank].tails = [None] * len(plan)
            fab.later(t + fab.latency, (HEADER, w.rank, -1))

    # -- network events -----------------------------------------------------------------
    def _net(self, t: float, token) -> None:
        what, rank, g = token
        if what == TAKE:
            return self._take(t)
        if what == HEADER:
            return self._header(rank, t)
        w = self.workers[rank]
        flight = self.flight[rank]
        if what == ARRIVE:
            flight.arrived[g] = t
            if flight.tails is not None:
                self._streamed_arrival(w, flight, g, t)
            elif g == self.g0:
                self._decide(w, flight, t)
            else:
                self._serve(g)
        elif what == STORE_SEND:
            fab, topo, a = self.fabric, self.topo, self.node[rank]
            m, far, near = self.plan[a][g]
            if not m:
                flows = []
            elif fab.coupled:
                flows = fab.path(t, (topo.group_up[g], topo.down[a]), far, m)
            else:
                flows = [fab.flow(t, topo.group_up[g], far, m), fab.flow(t, topo.down[a], far)]
            if near:
                flows.append(fab.flow(t, topo.shm[a], near))
            fab.transfer(t, flows, (REPLY, rank, g))
        elif not self._reply_held(flight, rank, g, t):
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

    def _decide(self, w: SimWorker, flight: _InFlight, t: float) -> None:
        """Rank 0 has the header and its slice: the server's side of the push; a worker
        then owed nothing is idle from this reply on (the server's view)."""
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
        if flight.tails is not None:   # rank 0 streams its slice (streams.py)
            done = t
            self._stream_send(w, flight, self.g0, t)
        else:
            done = self._apply(w, self.g0, t)
        for g, queue in enumerate(self.commands):
            if g != self.g0:
                queue.append((w, flight))
                self._serve(g)
        if self._applied(w, done):
            return
        if not self.ledger.tasks_ledger.of[w.rank].owed and w.rank not in self.computing:
            w.go_idle()

    def _serve(self, g: int) -> None:
        """Group g's stores take rank 0's commands in its order: each push's slice is
        applied once it is there and its command too (one latency after rank 0 decided),
        and a slice still on its way holds up the pushes decided after it, as
        ``SliceRank`` waits for each gradient in turn."""
        queue, lat = self.commands[g], self.fabric.latency
        while queue:
            w, flight = queue[0]
            arrived = flight.arrived[g]
            if flight.tails is not None:   # answered as its chunks come (streams.py)
                queue.popleft()
                self._stream_send(w, flight, g, flight.decided + lat)
                continue
            if arrived is None:
                return
            queue.popleft()
            self._apply(w, g, max(arrived, flight.decided + lat))

    def _apply(self, w: SimWorker, g: int, ready: float, send: bool = True) -> float:
        """Group g's stores apply w's slices once ``ready``; their replies leave when applied
        (``send``; a streamed reply left as the chunks came)."""
        start = self.free[g] if self.free[g] > ready else ready
        done = self.free[g] = start + self.service[g]
        self.store_busy[g] += self.service[g]
        if send:
            self.fabric.later(done, (STORE_SEND, w.rank, g))
        return done

