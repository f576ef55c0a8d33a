"""A node's cores: ranks that outnumber them share them, and compute slower (issue 33).

Where more ranks of a node are busy than it has cores, each busy rank's compute runs
slower by busy / cores. Busy counts the node's workers that have work (not idle), each as
the share of its last step it spent computing, and, on rank 0's node, the server as the
share of a core it used in the run replayed (``server_cpu_s`` over ``train_s``).
Nowhere else does a rank's speed depend on the others: a node with a core per rank
(cores >= its ranks, rank 0 counted) is left alone, so a what-if with a core per rank keeps
its figures to the last bit.

A replayed run's per-sample compute was measured under that run's own sharing: each
``workers/`` row's is divided by the sharing its rank's steps met (:func:`uncontended`,
the same measure read from the log's pushes) before the simulated policy's is applied.
The engine without a network models it; the network engine does not yet.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

import numpy as np

from mpilb.errors import UsageError


@dataclass(frozen=True)
class NodeCores:
    """The cores of each node and who runs there, for the engine.

    Args:
        cores: usable cores of each node (by node index).
        node_of: the node of each simulated worker, by the engine's worker number (1..W).
        server_node: rank 0's node.
        server_share: the share of a core rank 0 uses (0: the server is not counted). Taken
            from the replayed run as it stands, not scaled with the simulated updates per
            second: scaled, the load replay of a static run's log read 8% longer in each
            of the 5 tries of docs/simulate.md (rank 0's CPU share 0.25 there, 0.44 under
            load) while the fast workers computed no slower under load than under static.
    """

    cores: tuple
    node_of: dict
    server_node: int = 0
    server_share: float = 0.0

    def shared(self) -> frozenset:
        """The nodes whose ranks outnumber their cores (rank 0 counted on its node)."""
        count: dict = {self.server_node: 1}
        for node in self.node_of.values():
            count[node] = count.get(node, 0) + 1
        return frozenset(n for n, k in count.items() if k > self.cores[n])

    def factor(self, engine, w) -> float:
        """How much slower the compute of the step ``w`` starts runs: busy ÷ cores of its
        node where that exceeds 1, else 1. Notes ``w``'s duty from the step it just ended."""
        last = w.comp + w.io + w.comm
        w.duty = w.comp / last if last > 0 else 1.0
        node = self.node_of[w.rank]
        busy = w.duty + sum(o.duty for o in engine.workers.values()
                            if o is not w and self.node_of[o.rank] == node and o.present
                            and not o.idle)
        if node == self.server_node:
            busy += self.server_share
        return max(1.0, busy / self.cores[node])


def crowded(cores: NodeCores | None) -> NodeCores | None:
    """``cores`` where a node's ranks outnumber its cores, else None (nothing to model)."""
    return cores if cores is not None and cores.shared() else None


def log_cores(attrs: dict, world: int) -> list[int] | None:
    """Every rank's usable CPUs: the log's ``cpus`` attribute; for a log written before it
    (which lacks it), this machine's when every rank ran on a host of this machine's name
    (a log replayed where it was made); else None (give --cores-per-node)."""
    try:
        cpus = json.loads(attrs.get("cpus", "null"))
    except (TypeError, ValueError):
        cpus = None
    if isinstance(cpus, list) and len(cpus) == world:
        return [max(1, int(c)) for c in cpus]
    try:
        hosts = json.loads(attrs.get("hostnames", "null"))
    except (TypeError, ValueError):
        return None
    if isinstance(hosts, list) and len(hosts) == world and set(hosts) == {socket.gethostname()}:
        here = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return [max(1, here or 1)] * world
    return None


def node_cores(node_of: list[int], cpus: list[int] | None, per_node: int | None) -> tuple | None:
    """Usable cores of each node: ``--cores-per-node`` where given, else the log's (a node's
    first rank's), else None (no model)."""
    nodes = max(node_of) + 1 if node_of else 1
    if per_node is not None:
        if per_node < 1:
            raise UsageError(f"--cores-per-node must be at least 1 (got {per_node})")
        return (per_node,) * nodes
    if cpus is None:
        return None
    first = {}
    for rank, node in enumerate(node_of):
        first.setdefault(node, cpus[rank])
    return tuple(first.get(n, 1) for n in range(nodes))


def uncontended(cols: dict, ranks: list[int], node_of: list[int], cores: tuple,
                shared: frozenset, server_share: float) -> np.ndarray:
    """The sharing each ``workers/`` row was measured under: over its rank's steps in the
    row's interval, the mean of max(1, busy / cores) at each step's push, busy = the share
    of its time the rank computes, plus that of each other worker of its node that had work
    then (its next push less than four of its median steps away: a worker waiting for
    work pushes nothing), plus, on rank 0's node, ``server_share`` (rank 0's CPU seconds
    over the training's). The measure the engine applies (:meth:`NodeCores.factor`),
    read from the log; a row's compute per sample divided by it is its uncontended speed."""
    w, u = cols["workers"], cols["updates"]
    who, t = np.asarray(w["worker"]), np.asarray(w["t"], dtype=float)
    pushes, reach, duty = {}, {}, {}
    for r in ranks:
        p = np.sort(np.asarray(u["t"][u["worker"] == r], dtype=float))
        pushes[r] = p
        reach[r] = 4 * float(np.median(np.diff(p))) if len(p) > 1 else 0.0
        mine = who == r
        spent = sum(float(np.sum(w[k][mine])) for k in ("compute_s", "io_s", "comm_s"))
        duty[r] = float(np.sum(w["compute_s"][mine])) / spent if spent > 0 else 1.0
    out = np.ones(len(t))
    for r in ranks:
        node = node_of[r]
        if node not in shared:
            continue
        mates = [o for o in ranks if o != r and node_of[o] == node]
        base = duty[r] + (server_share if node == node_of[0] else 0.0)
        rows = np.flatnonzero(who == r)
        rows = rows[np.argsort(t[rows], kind="stable")]
        prev = -np.inf
        for i in rows:
            steps = pushes[r][(pushes[r] > prev) & (pushes[r] <= t[i])]
            prev = t[i]
            if len(steps) == 0:
                continue
            busy = np.full(len(steps), base)
            for o in mates:
                nxt = np.searchsorted(pushes[o], steps, "right")
                has = nxt < len(pushes[o])
                soon = np.zeros(len(steps), dtype=bool)
                soon[has] = pushes[o][nxt[has]] - steps[has] <= reach[o]
                busy += duty[o] * soon
            out[i] = float(np.mean(np.maximum(1.0, busy / cores[node])))
    return out
