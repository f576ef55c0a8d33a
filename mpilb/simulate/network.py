"""The simulated network: nodes, their links, where the stores are (fabric.py: how transfers
share them).

A cluster is ``nodes`` nodes of ``ranks_per_node`` MPI ranks, behind one switch that never
congests (full bisection). Every node has a link to the switch, one resource per direction
(``up``: what the node sends, ``down``: what it receives) at its ``--link-rate``, less the
share headers take (``--mtu``), and one shared-memory resource (``--shm-rate``) that carries
the transfers between two ranks of the node, both ways. A transfer to another node (a
worker's slice to a store there) crosses the worker node's ``up`` and the store node's
``down``, and pays the one-way ``--latency`` once; how transfers share the resources is
``--link-sharing`` (fabric.py). A link may be a token bucket (``--link-burst MS``, as tc's
``tbf`` shapes the cluster in a box's links): while it is idle or below its rate it banks
up to MS milliseconds of its rate, and spends the bank at the node's shared-memory rate (the
unshaped veth's); a NIC's line rate banks nothing (0, the default).

Stores (:class:`Layout`): ``--servers K`` puts K stores on K different nodes (nodes 0..K-1),
``per-node`` one on every node; a store is the lowest rank of its node (rank 0 is the first
store and decides), every other rank is a worker. Each store holds 1/K of the parameters.

Bytes (:data:`WIRE_BYTES`): a push carries each store its slice of the gradient, a reply
brings back each store's slice of the parameters, at 4 bytes per float (``fp32``) or 2
(``bf16``, ``fp16``); headers and rank 0's commands to the other stores are latency only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mpilb.errors import UsageError

WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
SHM_RATE = "40gbit"     # 5 GB/s: a copy through shared memory between two ranks of a node
LATENCY_S = 5e-5        # one way, per transfer
MTU_MIN, MTU_MAX = 576, 65536
SHARING = ("auto", "coupled", "per-link")
# --link-sharing auto: flows coupled along their paths (exact max-min) up to this many nodes;
# above, each link shares on its own (PerLinkFabric), which costs a fraction as much
COUPLED_NODES = 16

# tc's rate units (tc(8) "RATES", as the cluster in a box takes them): bytes/s per unit;
# "bit" units are bits per second, "bps" units bytes per second (so 1gbit = 125 MB/s)
_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
          "kibit": 1024 / 8, "mibit": 1024**2 / 8, "gibit": 1024**3 / 8,
          "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}
_RATE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(" + "|".join(sorted(_UNITS, key=len, reverse=True))
                   + r")$")


def parse_rate(text: str, what: str = "--link-rate") -> float:
    """Bytes per second of a tc-style rate: ``100mbit``, ``1gbit``, ``1.5gbit``, ``10gbps``.

    Raises UsageError (one line, naming ``what``) for anything else or a rate of zero.
    """
    m = _RATE.match(str(text).strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"{what} {text!r}: not a rate; give e.g. 100mbit, 1gbit, 1.5gbit or "
                         f"10gbps (bit units are bits/s, bps units bytes/s)")
    rate = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(rate):
        raise UsageError(f"{what} {text!r}: too large a rate (past a float's range)")
    return rate


def parse_rates(text: str, nodes: int, what: str = "--link-rate") -> list[float]:
    """One rate for every node, or a comma list of one per node."""
    rates = [parse_rate(r, what) for r in str(text).split(",")]
    if len(rates) == 1:
        return rates * nodes
    if len(rates) != nodes:
        raise UsageError(f"{what} {text}: give one rate, or one per node ({nodes}); got {len(rates)}")
    return rates


@dataclass
class NetSpec:
    """The cluster's network (what does not change between configurations)."""

    nodes: int
    ranks_per_node: list[int]      # per node
    link_bps: list[float]          # bytes/s per node, each direction
    shm_bps: float = 5e9
    latency_s: float = LATENCY_S
    burst_s: float = 0.0           # a link's bank, in seconds of its rate (tc tbf's burst)
    sharing: str = "auto"          # --link-sharing: coupled, per-link, auto (COUPLED_NODES)
    mtu: int = 1500                # --mtu: a link's packet size (payload_share)

    def __post_init__(self):
        if self.nodes < 1:
            raise UsageError(f"--nodes must be at least 1 (got {self.nodes})")
        if len(self.ranks_per_node) != self.nodes or min(self.ranks_per_node) < 1:
            raise UsageError(f"--ranks-per-node must be at least 1 on each of the {self.nodes} nodes")
        if self.latency_s < 0 or not math.isfinite(self.latency_s):
            raise UsageError(f"--latency must be >= 0 s (got {self.latency_s})")
        if not 0 <= self.burst_s < math.inf:
            raise UsageError(f"--link-burst must be >= 0 ms (got {self.burst_s * 1e3:g})")
        if not MTU_MIN <= self.mtu <= MTU_MAX:
            raise UsageError(f"--mtu must be {MTU_MIN}-{MTU_MAX} bytes (got {self.mtu})")
        if self.sharing not in SHARING:
            raise UsageError(f"--link-sharing {self.sharing!r}: valid: {', '.join(SHARING)}")

    @property
    def payload_share(self) -> float:
        """The share of a link's bytes that carries data: a packet of ``mtu`` bytes holds
        ``mtu`` - 52 of it (IPv4 20, TCP 20, its timestamps 12) and takes ``mtu`` + 14 on
        the link (Ethernet's header: what tc's shaper counts; 1500: 0.956)."""
        return (self.mtu - 52) / (self.mtu + 14)

    def payload_bps(self, node: int) -> float:
        """Bytes of data a second over ``node``'s link, each direction."""
        return self.link_bps[node] * self.payload_share

    @property
    def coupled(self) -> bool:
        """Whether flows are coupled along their paths (:class:`Fabric`) or each link shares
        its flows on its own (:class:`PerLinkFabric`)."""
        return self.sharing == "coupled" or (self.sharing == "auto" and self.nodes <= COUPLED_NODES)

    def node_of(self) -> list[int]:
        """The node of every rank, ranks numbered node by node."""
        return [n for n, r in enumerate(self.ranks_per_node) for _ in range(r)]


def servers_count(text: str, nodes: int | None) -> int:
    """``--servers`` value: a count, or ``per-node`` (one store on every node)."""
    if text == "per-node":
        if nodes is None:
            raise UsageError("--servers per-node needs a network: give --nodes (or --from a run)")
        return nodes
    try:
        k = int(text)
    except ValueError:
        raise UsageError(f"--servers: {text!r} is not a count or per-node") from None
    if k < 1:
        raise UsageError(f"--servers must be at least 1 (got {k})")
    return k


@dataclass
class Layout:
    """Where the K stores and the workers are (a store: the lowest rank of its node).

    Args:
        spec: the network.
        k: stores, on nodes 0..K-1 (K = nodes: one per node).
        node_of: each rank's node (default: ranks numbered node by node).
        absent: ranks that are no workers (a replayed joiner's id that never worked).
    """

    spec: NetSpec
    k: int
    node_of: list[int] | None = None
    absent: frozenset = frozenset()

    def __post_init__(self):
        if self.k > self.spec.nodes:
            raise UsageError(f"--servers {self.k}: more stores than nodes ({self.spec.nodes}); "
                             f"a store is the lowest rank of its own node")
        node_of = self.node_of if self.node_of is not None else self.spec.node_of()
        first = {}
        for rank, node in enumerate(node_of):
            first.setdefault(node, rank)
        stores = sorted(first[n] for n in range(self.k) if n in first)
        if len(stores) != self.k:
            raise UsageError(f"--servers {self.k}: nodes 0..{self.k - 1} do not all hold a rank")
        self.node_of = list(node_of)
        self.store_ranks = stores
        self.store_nodes = [node_of[r] for r in stores]
        taken = set(stores)
        self.worker_ranks = [r for r in range(len(node_of))
                             if r not in taken and r not in self.absent]
        if not self.worker_ranks:
            raise UsageError(f"--servers {self.k}: no rank is left to be a worker")

    def slice_floats(self, params: int) -> list[int]:
        """Floats of each store's slice (equal, the first ones one more)."""
        q, r = divmod(params, self.k)
        return [q + (1 if s < r else 0) for s in range(self.k)]


class Topology:
    """The resources a layout's transfers cross, and which ones each node's ranks use.

    Every node has its shared memory. A node without a store has its own ``up`` and ``down``
    link. The stores are simulated in *groups* of stores whose links have the same rate:
    every push sends each store its slice at the same moment, so the stores of a group see
    the same traffic, and the group is one resource per direction of K_g x the link rate
    (each flow at most one link's rate per unit of its weight: a flow spread over m of the
    group's links has weight m), one CPU queue, one reply per push. The links of a store's
    node are its group's: the node's workers push and receive through them as well.
    Up to ``APART`` stores (or with ``group=False``) every store is a group of its own:
    grouping is exact for one store per group only, and with a few stores each store's own
    links are cheap to simulate.
    """

    APART = 8

    def __init__(self, layout: Layout, group: bool | None = None):
        spec = layout.spec
        if group is None:
            group = layout.k > self.APART
        n = spec.nodes
        rates, caps, bursts, peaks = [], [], [], []

        def resource(rate: float, cap: float = math.inf, links: int = 0) -> int:
            """A resource of ``rate``; ``links``: how many links it stands for (0: a node's
            shared memory), each banking ``burst_s`` of its rate to spend at the shm rate."""
            rates.append(rate)
            caps.append(cap)
            bursts.append(rate * spec.burst_s if links else 0.0)
            peaks.append(max(rate, spec.shm_bps * links))
            return len(rates) - 1

        self.shm = [resource(spec.shm_bps) for _ in range(n)]
        by_rate: dict[float, list[int]] = {}
        for s, node in enumerate(layout.store_nodes):
            by_rate.setdefault(spec.payload_bps(node) if group else s, []).append(s)
        self.groups = sorted(by_rate.values())          # store indices per group
        self.group_of_store = [0] * layout.k
        self.up, self.down = [0] * n, [0] * n
        self.group_up, self.group_down = [], []
        for g, stores in enumerate(self.groups):
            bps = spec.payload_bps(layout.store_nodes[stores[0]])
            self.group_up.append(resource(bps * len(stores), bps, len(stores)))
            self.group_down.append(resource(bps * len(stores), bps, len(stores)))
            for s in stores:
                self.group_of_store[s] = g
                node = layout.store_nodes[s]
                self.up[node], self.down[node] = self.group_up[g], self.group_down[g]
        store_nodes = set(layout.store_nodes)
        for node in range(n):
            if node not in store_nodes:
                self.up[node] = resource(spec.payload_bps(node), links=1)
                self.down[node] = resource(spec.payload_bps(node), links=1)
        self.links = sorted(set(self.up) | set(self.down))
        self.rates, self.caps, self.bursts, self.peaks = rates, caps, bursts, peaks
        self.store_nodes = list(layout.store_nodes)
