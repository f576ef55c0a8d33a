"""Which rank is on which node, where the parameter stores go, and what talks over the network.

Pure: the node of every rank comes from the MPI layer (comm.nodes: a shared-memory split of
the world), everything here is arithmetic on that list, the same on every rank.

    nodes = [0, 0, 1, 1, 2, 2]              # node index of each rank
    store_ranks(nodes, 2)         -> [0, 2]        # two stores, on two nodes
    store_ranks(nodes, "per-node") -> [0, 2, 4]     # one store beside each node's workers
    layout_lines(nodes, [0, 2])   -> the text `mpilb report` and `mpilb doctor` show

Nodes are numbered by their lowest rank (node 0 holds rank 0). Store s of --servers K holds
slice s of the parameters (wire.cut_slices); store 0 is always rank 0, which coordinates.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

PER_NODE = "per-node"

Servers = Union[int, str]   # --servers: K or "per-node"


def number_nodes(leaders: Sequence[int]) -> list[int]:
    """Node index of every rank from an id of its node (e.g. the node's lowest world rank),
    in rank order: nodes are numbered by the order in which they first appear."""
    index: dict = {}
    return [index.setdefault(leader, len(index)) for leader in leaders]


def node_ranks(nodes: Sequence[int]) -> list[list[int]]:
    """The ranks of each node, in rank order, nodes in index order."""
    out: list[list[int]] = [[] for _ in range(max(nodes, default=-1) + 1)]
    for rank, node in enumerate(nodes):
        out[node].append(rank)
    return out


def store_ranks(nodes: Sequence[int], servers: Servers) -> list[int]:
    """The store ranks of `--servers` on the node layout `nodes`, in store order (rank 0 first).

    `per-node`: the lowest rank of every node. K: taken round-robin over the nodes, each
    node's lowest rank first: with K nodes or more, the lowest ranks of the first K nodes
    (K different nodes); on one node ranks 0..K-1; never two stores on a node while another
    node has none. K larger than the job is cut to the job's size (check_servers refuses it).
    """
    per = node_ranks(nodes) or [[0]]
    if servers == PER_NODE:
        return [ranks[0] for ranks in per]
    k = int(servers)
    chosen: list[int] = []
    depth = 0
    while len(chosen) < k and depth < max(len(r) for r in per):
        chosen += [ranks[depth] for ranks in per if depth < len(ranks)][:k - len(chosen)]
        depth += 1
    return sorted(chosen)


def default_stores(servers: Servers) -> list[int]:
    """The store ranks when the layout is not known (one node): ranks 0..K-1, or rank 0."""
    return [0] if servers == PER_NODE else list(range(int(servers)))


def stores_of(cfg) -> list[int]:
    """The run's store ranks: as placed at start-up from the node layout (cfg.store_ranks),
    else those of one node."""
    placed = getattr(cfg, "store_ranks", None)
    return list(placed) if placed else default_stores(cfg.updates.servers)


def workers_of(cfg, size: int) -> list[int]:
    """The worker ranks of a job of `size` ranks: every rank that is not a store."""
    stores = set(stores_of(cfg))
    return [r for r in range(size) if r not in stores]


def span(ranks: Sequence[int]) -> str:
    """Ranks as short text: [0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[str] = []
    ranks = sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if j == i else
                     f"{ranks[i]}, {ranks[j]}" if j == i + 1 else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts) or "none"


def crowded(nodes: Sequence[int], stores: Sequence[int]) -> list[str]:
    """Warnings: stores that share a node while another node has none (each node's link
    carries its stores' share of every update, so one link carries two shares)."""
    per = node_ranks(nodes)
    held = [[s for s in stores if nodes[s] == n] for n in range(len(per))] if stores else []
    empty = [n for n, h in enumerate(held) if not h]
    if not empty:
        return []
    out = []
    for n, h in enumerate(held):
        if len(h) > 1:
            out.append(f"stores on ranks {span(h)} share node {n} while node"
                       f"{'s' if len(empty) > 1 else ''} {span(empty)} "
                       f"{'have' if len(empty) > 1 else 'has'} none: node {n}'s link carries "
                       f"{len(h)} shares of every update; --servers K places the stores on K "
                       f"different nodes, --servers per-node one on each")
    return out


def layout_lines(nodes: Sequence[int], stores: Sequence[int],
                 hosts: Optional[Sequence[str]] = None) -> list[str]:
    """The job's layout: each node's ranks (stores marked), and for each store the workers
    it reaches through shared memory (its node) and over the network (the others)."""
    per = node_ranks(nodes)
    stores = list(stores)
    workers = [r for r in range(len(nodes)) if r not in stores]
    lines = [f"{len(nodes)} rank(s) on {len(per)} node(s); parameter store(s) on rank(s) "
             f"{span(stores)}"]
    for n, ranks in enumerate(per):
        host = f" ({hosts[ranks[0]]})" if hosts and len(hosts) > ranks[0] else ""
        shown = ", ".join(f"{r} store" if r in stores else str(r) for r in ranks)
        lines.append(f"node {n}{host}: rank(s) {shown}")
    for s in stores:
        local = [w for w in workers if nodes[w] == nodes[s]]
        remote = [w for w in workers if nodes[w] != nodes[s]]
        lines.append(f"store {s} <-> workers: shared memory {span(local)}; network {span(remote)}")
    if len(stores) > 1:
        apart = [s for s in stores[1:] if nodes[s] != nodes[0]]
        if apart:
            lines.append(f"rank 0 <-> stores {span(apart)} (its commands): network")
    return lines


def placement_note(nodes: Sequence[int], servers: Servers) -> Optional[str]:
    """The line a run starts with where --servers did not simply get what it asked for:
    `per-node` (how many stores that made), K stores on fewer nodes than K (some share)."""
    n = len(node_ranks(nodes))
    stores = store_ranks(nodes, servers)
    if servers == PER_NODE:
        if n == 1:
            return "--servers per-node: the job is on one node, so one parameter store (rank 0)"
        return f"--servers per-node: {n} parameter stores, one on each node (ranks {span(stores)})"
    if 1 < n < len(stores):
        return (f"--servers {servers} on {n} nodes: stores on ranks {span(stores)}, up to "
                f"{-(-len(stores) // n)} on a node")
    return None
