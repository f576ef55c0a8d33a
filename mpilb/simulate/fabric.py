"""Transfers sharing the simulated network's resources, in event time (network.py builds
the resources: links, shared memory, groups of stores).

Two models of sharing (``--link-sharing``): :class:`Fabric`, transfers coupled along their
paths at max-min fair rates (exact; the default up to ``network.COUPLED_NODES`` nodes), and
:class:`PerLinkFabric`, each resource sharing its flows on its own (processor sharing:
cheap, for large clusters). Both keep one heap of events: the network's next change, a
delayed send, a finished transfer.
"""

from __future__ import annotations

import heapq
import math


class Transfers:
    """What both fabrics share: the resources (rates, caps, token banks), transfers waiting
    on flows, delayed sends, and the heap of events they come out of (:meth:`pop`, in each
    fabric)."""

    def __init__(self, rates: list[float], caps: list[float], latency: float,
                 bursts: list[float] | None = None, peaks: list[float] | None = None):
        if not all(0.0 < r < math.inf for r in rates):
            raise ValueError(f"every resource's rate must be finite and > 0 (got {rates})")
        self.rate = list(rates)
        self.cap = list(caps)
        r = len(self.rate)
        self.burst = list(bursts) if bursts else [0.0] * r
        self.tokens = list(self.burst)      # banks start full
        self.peak = [max(a, b) for a, b in zip(peaks, rates)] if peaks else list(rates)
        self.moved = [0.0] * r      # bytes each resource carried
        self.latency = latency
        self.waiting: dict[int, list] = {}   # flow id -> transfers waiting on it
        self.left: dict[int, list] = {}      # transfer id -> [flows left, token]
        self.events: list = []
        self.seq = 0

    def transfer(self, t: float, flows: list[int], token) -> None:
        """``token`` comes out of :meth:`pop` when every flow in ``flows`` is done, plus the
        latency (at once plus the latency when ``flows`` is empty)."""
        self.seq += 1
        tid = self.seq
        live = [f for f in flows if f in self.waiting]
        if not live:
            heapq.heappush(self.events, (t + self.latency, tid, 2, token))
            return
        self.left[tid] = [len(live), token]
        for f in live:
            self.waiting[f].append(tid)

    def later(self, t: float, token) -> None:
        """``token`` comes out of :meth:`pop` at ``t`` (a send that starts then)."""
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, 1, token))

    def _bank(self, r: int, tokens: float, t: float) -> float:
        """Resource ``r``'s bank holding ``tokens`` at ``t``, up to its size; empty within
        the float error of the bank, or when what it holds would be spent in less than the
        clock can tell from ``t`` (4 ulps of t, draining at the most it can: peak less
        rate): left on, its running dry would fall at t again, for ever (a 3-node run
        with ``--link-burst 0.2`` hung 64 s into it)."""
        spend = (self.peak[r] - self.rate[r]) * 4.0 * math.ulp(t)
        if tokens <= 1e-9 * self.burst[r] or tokens <= spend:
            return 0.0
        return min(self.burst[r], tokens)

    def _flow_done(self, fid: int, t: float) -> None:
        """Flow ``fid`` is through at ``t``: a transfer it was the last of is done a latency
        later."""
        for tid in self.waiting.pop(fid):
            entry = self.left[tid]
            entry[0] -= 1
            if entry[0] == 0:
                del self.left[tid]
                self.seq += 1
                heapq.heappush(self.events, (t + self.latency, self.seq, 2, entry[1]))


class Fabric(Transfers):
    """Transfers over shared resources, in event time: max-min fair rates along paths.

    A *flow* is bytes along a *path* of resources (a push from a worker to a store on
    another node: the worker node's ``up`` and the store node's ``down``), all at one rate:
    the same bytes cross every resource of the path, so a flow held back on one moves no
    faster on the others. Rates are max-min fair by weight (progressive filling): every
    flow's rate per unit of its weight rises together until a resource on its path is full,
    or the flow reaches its ``cap`` per unit of weight on one of them; then it stays, and the
    others rise on. A resource that no flow fills is left partly idle: bytes are not banked
    at the switch to be sent on later (as :class:`PerLinkFabric` does). With a path of one
    resource this is processor sharing (n flows get 1/n of its rate each, a flow of weight
    w gets w/Σw).

    Flows of the same path and weight always move at the same rate: they are kept as one
    *class* (a heap of finish tags in bytes per unit of weight, as a processor-sharing
    queue keeps them), and rates are set per class. Rates are set again once per event
    time, however many flows start or end at it.

    A resource with a ``burst`` (bytes) is a token bucket: its bank fills at its rate less
    what it serves, up to ``burst``, and while the bank holds tokens the resource serves at
    its ``peak`` rate (caps scaled alike); the bank running dry is an event of its own.
    A *transfer* is done when every flow it waits on is done, plus the latency. Events are
    kept in one heap: the network's next change (a flow done, a bank dry; rescheduled as
    flows come and go), a delayed send, a finished transfer.
    """

    coupled = True

    def __init__(self, rates: list[float], caps: list[float], latency: float,
                 bursts: list[float] | None = None, peaks: list[float] | None = None):
        super().__init__(rates, caps, latency, bursts, peaks)
        r = len(self.rate)
        self.banked = [i for i in range(r) if self.burst[i] > 0.0]
        self.served = [0.0] * r     # bytes/s each resource carries now
        # classes: (path, weight) -> [finish tags heap, served per unit weight, total weight,
        # rate per unit weight]
        self.classes: dict[tuple, list] = {}
        self.on: list[set] = [set() for _ in range(r)]   # resource -> keys of its classes
        self.wsum = [0.0] * r       # resource -> total weight of its flows
        self.busy: set = set()      # resources with flows
        self.capped: set = set()    # keys of classes with a finite cap on their path
        self.now = 0.0              # the classes' clock: their service is as of this time
        self.due = 0                # seq of the valid network event
        self.dirty = False          # flows came since rates were set

    # -- flows and transfers ----------------------------------------------------------
    def path(self, t: float, resources, nbytes: float, weight: float = 1.0) -> list[int]:
        """Start ``nbytes`` along ``resources`` at ``t`` (the current event time); its id,
        in a list (the transfers' list of flows, where :class:`PerLinkFabric` takes a
        :meth:`~PerLinkFabric.flow` per resource)."""
        self._advance(t)
        self.seq += 1
        fid = self.seq
        key = (tuple(resources), weight)
        cls = self.classes.get(key)
        if cls is None:
            cls = self.classes[key] = [[], 0.0, 0.0, 0.0]
            for r in key[0]:
                self.on[r].add(key)
                self.busy.add(r)
                if self.cap[r] < self.rate[r]:    # (a cap of its whole rate never binds)
                    self.capped.add(key)
        heapq.heappush(cls[0], (cls[1] + nbytes / weight, fid))
        cls[2] += weight
        for r in key[0]:
            self.wsum[r] += weight
            self.moved[r] += nbytes
        self.waiting[fid] = []
        self.dirty = True
        return [fid]

    def flow(self, t: float, res: int, nbytes: float, weight: float = 1.0) -> int:
        """A flow on one resource (:meth:`path` of one); its id."""
        return self.path(t, (res,), nbytes, weight)[0]

    # -- rates --------------------------------------------------------------------------
    def _advance(self, t: float) -> None:
        """Move the classes and the banks on to ``t`` at the rates set at the last change."""
        dt = t - self.now
        if dt <= 0.0:
            return
        for cls in self.classes.values():
            cls[1] += cls[3] * dt
        for r in self.banked:
            self.tokens[r] = self._bank(r, self.tokens[r] + (self.rate[r] - self.served[r]) * dt, t)
        self.now = t

    def _allocate(self) -> None:
        """Max-min fair rates by progressive filling, then the next network event.

        The resources wait in a heap by the level at which they fill (room / weight of
        the classes not yet set), entries of a resource whose room changed since are
        skipped; the classes with a cap wait in a list by it."""
        self.dirty = False
        classes, on, wsum = self.classes, self.on, self.wsum
        room, weights, boosts, heap = {}, {}, {}, []
        served = self.served
        for r in self.busy:
            boost = self.peak[r] / self.rate[r] if self.tokens[r] > 0.0 else 1.0
            boosts[r] = boost
            room[r] = served[r] = self.rate[r] * boost   # (served: less the room left)
            weights[r] = w = wsum[r]
            heap.append((room[r] / w, r, w))
        heapq.heapify(heap)
        by_cap = sorted((min(self.cap[r] * boosts[r] for r in k[0]), k)
                        for k in self.capped if k in classes)
        pending = len(classes)
        done: set = set()
        c = 0
        while pending:
            # the lowest level at which a resource fills, or a class meets its cap
            while heap and heap[0][2] != weights[heap[0][1]]:
                heapq.heappop(heap)          # its weight (so its level) changed since
            fill, r_min = (heap[0][0], heap[0][1]) if heap else (math.inf, -1)
            while c < len(by_cap) and by_cap[c][1] in done:
                c += 1
            capped = by_cap[c][0] if c < len(by_cap) else math.inf
            level = fill if fill <= capped else capped
            if level == math.inf:    # (every resource's rate is finite: never)
                break
            if fill <= capped:
                heapq.heappop(heap)
                frozen = [k for k in on[r_min] if k not in done]
            else:
                frozen = []
                while c < len(by_cap) and by_cap[c][0] <= capped:
                    if by_cap[c][1] not in done:
                        frozen.append(by_cap[c][1])
                    c += 1
            touched = set()
            for k in frozen:
                done.add(k)
                pending -= 1
                cls = classes[k]
                cls[3] = level
                used = cls[2] * level
                for r in k[0]:
                    room[r] -= used
                    weights[r] -= cls[2]
                    touched.add(r)
            if fill <= capped:
                weights[r_min] = 0.0
            for r in touched:
                w = weights[r]
                if w > 1e-12 * (wsum[r] if wsum[r] > 1.0 else 1.0):
                    heapq.heappush(heap, (max(0.0, room[r]) / w, r, w))
                else:
                    weights[r] = 0.0
        for r in room:
            served[r] -= max(0.0, room[r])
        self._schedule()

    def _schedule(self) -> None:
        self.seq += 1
        self.due = self.seq
        dt = math.inf
        for cls in self.classes.values():
            if cls[3] > 0.0:     # (a rate of 0 only from float error on a full resource)
                x = (cls[0][0][0] - cls[1]) / cls[3]
                if x < dt:
                    dt = x
        for r in self.banked:
            drain = self.served[r] - self.rate[r]
            if self.tokens[r] > 0.0 and drain > 0.0:   # the bank runs dry first?
                dry = self.tokens[r] / drain
                if dry < dt:
                    dt = dry
        if dt < math.inf:
            heapq.heappush(self.events, (self.now + (dt if dt > 0.0 else 0.0), self.seq, 0, None))

    # -- events -----------------------------------------------------------------------
    def next_time(self) -> float:
        if self.dirty:
            self._allocate()
        ev = self.events
        while ev and ev[0][2] == 0 and ev[0][1] != self.due:
            heapq.heappop(ev)    # a network event rescheduled since
        return ev[0][0] if ev else math.inf

    def pop(self) -> tuple[float, int, object]:
        """The next event: (time, kind, token); kind 1: a delayed send is due, 2: a
        transfer is done, 0: the network moved on (token None)."""
        self.next_time()
        t, seq, kind, arg = heapq.heappop(self.events)
        if kind:
            return t, kind, arg
        self._advance(t)
        tick = 4.0 * math.ulp(t)
        for key in list(self.classes):
            cls = self.classes[key]
            heap, v = cls[0], cls[1]
            # done: a flow whose finish is within the float error of v, or whose bytes left
            # would take less than the clock can tell from t (4 ulps of t at its speed):
            # left on, its finish would fall at t again and move nothing, for ever
            done = v + max(1e-9 * (v if v > 1.0 else 1.0), tick * cls[3])
            while heap and heap[0][0] <= done:
                _, fid = heapq.heappop(heap)
                cls[2] -= key[1]
                for r in key[0]:
                    self.wsum[r] -= key[1]
                self._flow_done(fid, t)
            if not heap:
                del self.classes[key]
                self.capped.discard(key)
                for r in key[0]:
                    self.on[r].discard(key)
                    if not self.on[r]:
                        self.busy.discard(r)
                        self.wsum[r] = self.served[r] = 0.0
        self._allocate()
        return t, 0, None


class PerLinkFabric(Transfers):
    """Transfers over shared resources, each resource sharing its flows on its own
    (processor sharing), in event time: the cheap model for large clusters.

    A transfer across two links (a push to a store on another node) is a flow on each,
    moving at each one's own share: the bytes may cross one link early and wait at the
    switch, so while the links on both ends are loaded this reads faster than the coupled
    :class:`Fabric` (the box's two stores: 53.0 updates/s against 50.0; measured
    40-45).

    A *flow* is bytes on one resource, with a weight (its share): the resource's rate is
    divided among its flows by weight, each flow getting at most ``cap`` per unit of weight.
    A resource with a ``burst`` (bytes) is a token bucket: its bank fills at its rate less
    what it serves, up to ``burst``, and while the bank holds tokens the resource serves at
    its ``peak`` rate (caps scaled alike); the bank running dry is an event of its own.
    A *transfer* is done when every flow it waits on is done, plus the latency. Events are
    kept in one heap: a resource's next departure (rescheduled as flows come and go), a
    delayed send, a finished transfer.
    """

    def __init__(self, rates: list[float], caps: list[float], latency: float,
                 bursts: list[float] | None = None, peaks: list[float] | None = None):
        super().__init__(rates, caps, latency, bursts, peaks)
        r = len(self.rate)
        self.v = [0.0] * r          # service per unit weight so far
        self.load = [0.0] * r       # sum of the weights of the flows on it
        self.t = [0.0] * r
        self.flows: list[list] = [[] for _ in range(r)]   # heaps of [finish tag, id]
        self.due = [0] * r          # seq of the resource's valid departure event
        self.weight: dict[int, float] = {}

    # -- flows and transfers ----------------------------------------------------------
    def _speed(self, res: int) -> float:
        """Bytes/s per unit of weight on ``res`` now."""
        rate = self.rate[res]
        cap = self.cap[res]
        if self.tokens[res] > 0.0:       # spending its bank
            cap *= self.peak[res] / rate
            rate = self.peak[res]
        share = rate / self.load[res]
        return cap if cap < share else share

    def _advance(self, res: int, t: float) -> None:
        dt = t - self.t[res]
        served = 0.0
        if self.load[res] > 0.0:
            speed = self._speed(res)
            self.v[res] += dt * speed
            served = speed * self.load[res]
        if self.burst[res] and dt > 0.0:
            self.tokens[res] = self._bank(res, self.tokens[res] + (self.rate[res] - served) * dt, t)
        self.t[res] = t

    def _schedule(self, res: int) -> None:
        self.seq += 1
        self.due[res] = self.seq
        heap = self.flows[res]
        if heap:
            speed = self._speed(res)
            dt = (heap[0][0] - self.v[res]) / speed
            drain = speed * self.load[res] - self.rate[res]
            if self.tokens[res] > 0.0 and drain > 0.0:   # the bank runs dry first?
                dry = self.tokens[res] / drain
                dt = dry if dry < dt else dt
            heapq.heappush(self.events, (self.t[res] + (dt if dt > 0.0 else 0.0), self.seq, 0, res))

    coupled = False

    def flow(self, t: float, res: int, nbytes: float, weight: float = 1.0) -> int:
        """Start ``nbytes`` on resource ``res`` at ``t`` (the current event time); its id."""
        self._advance(res, t)
        self.seq += 1
        fid = self.seq
        heapq.heappush(self.flows[res], (self.v[res] + nbytes / weight, fid))
        self.load[res] += weight
        self.weight[fid] = weight
        self.waiting[fid] = []
        self.moved[res] += nbytes
        self._schedule(res)
        return fid

    # -- events -----------------------------------------------------------------------
    def next_time(self) -> float:
        ev = self.events
        while ev and ev[0][2] == 0 and ev[0][1] != self.due[ev[0][3]]:
            heapq.heappop(ev)    # a departure rescheduled since
        return ev[0][0] if ev else math.inf

    def pop(self) -> tuple[float, int, object]:
        """The next event: (time, kind, token); kind 1: a delayed send is due, 2: a
        transfer is done, 0: a resource moved on (token None)."""
        t, seq, kind, arg = heapq.heappop(self.events)
        if kind:
            return t, kind, arg
        res = arg
        self._advance(res, t)
        heap = self.flows[res]
        v = self.v[res]                     # (never negative)
        # done: a flow whose finish is within the float error of v, or whose bytes left
        # would take less than the clock can tell from t (4 ulps of t at the speed): left
        # on, its next departure would fall at t again and advance v by nothing, for ever
        slack = 4.0 * math.ulp(t) * self._speed(res) if heap else 0.0
        done = v + max(1e-9 * (v if v > 1.0 else 1.0), slack)
        while heap and heap[0][0] <= done:
            _, fid = heapq.heappop(heap)
            self.load[res] -= self.weight.pop(fid)
            self._flow_done(fid, t)
        if not heap:
            self.load[res], self.v[res] = 0.0, 0.0
        self._schedule(res)
        return t, 0, None
