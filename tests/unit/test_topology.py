"""The node layout (topology.py): node numbering, where --servers puts the stores, the
layout text of `mpilb report` / `mpilb doctor` and its warning. Pure: no MPI."""

from __future__ import annotations

import json

import pytest

from mpirun import config_stub

from mpilb.config.build import build_config
from mpilb.errors import UsageError
from mpilb.runfiles.logattrs import format_layout
from mpilb.config.validate import check_servers
from mpilb.core.topology import (crowded, layout_lines, number_nodes, placement_note, span,
                            store_ranks, stores_of, workers_of)

BLOCK = [0, 0, 1, 1, 2, 2]               # -hosts n0:2,n1:2,n2:2
CYCLIC = [0, 1, 2, 0, 1, 2]              # -hosts n0,n1,n2 -n 6 (round-robin placement)


def test_nodes_are_numbered_by_first_appearance():
    assert number_nodes([0, 0, 2, 2, 4]) == [0, 0, 1, 1, 2]
    assert number_nodes([0, 1, 2, 0, 1, 2]) == [0, 1, 2, 0, 1, 2]
    assert number_nodes(["n0", "n0"]) == [0, 0]


@pytest.mark.parametrize("nodes,servers,want", [
    ([0] * 5, 2, [0, 1]),                    # one node: ranks 0..K-1, as before
    ([0] * 5, 1, [0]),
    ([0] * 5, "per-node", [0]),
    (BLOCK, 2, [0, 2]),                       # two different nodes, rank 0 one of them
    (BLOCK, 3, [0, 2, 4]),
    (BLOCK, "per-node", [0, 2, 4]),
    (CYCLIC, 2, [0, 1]),                      # whatever the rank layout
    (CYCLIC, "per-node", [0, 1, 2]),
    ([0, 1, 1, 2, 2], 3, [0, 1, 3]),          # -hosts n0:1,n1:2,n2:2
    (BLOCK, 4, [0, 1, 2, 4]),                 # more stores than nodes: round-robin
    ([0, 0, 0, 1], 3, [0, 1, 3]),
])
def test_store_ranks(nodes, servers, want):
    got = store_ranks(nodes, servers)
    assert got == want
    assert got[0] == 0 and len(set(got)) == len(got)
    # never two stores on a node while another has none
    assert not crowded(nodes, got)


def test_k_stores_land_on_k_nodes_for_every_layout():
    import itertools

    for layout in itertools.product(range(3), repeat=6):
        nodes = number_nodes(layout)
        n = max(nodes) + 1
        for k in range(1, n + 1):
            stores = store_ranks(nodes, k)
            assert len({nodes[s] for s in stores}) == k and stores[0] == 0, (nodes, k)
        per = store_ranks(nodes, "per-node")
        assert sorted(nodes[s] for s in per) == list(range(n))
        assert all(s == min(r for r in range(6) if nodes[r] == nodes[s]) for s in per)


def test_the_config_carries_the_placement_and_workers_are_the_rest():
    cfg = build_config({}, {"servers": "per-node"})
    assert cfg.updates.servers == "per-node" and stores_of(cfg) == [0]     # not placed: one node
    cfg.store_ranks = tuple(store_ranks(BLOCK, cfg.updates.servers))
    assert stores_of(cfg) == [0, 2, 4] and workers_of(cfg, 6) == [1, 3, 5]
    assert stores_of(config_stub(servers=3)) == [0, 1, 2]
    assert build_config({"servers": "per-node"}, {}, source="run.toml").updates.servers == "per-node"
    with pytest.raises(UsageError, match="expected an integer or per-node"):
        build_config({}, {"servers": "pernode"})
    with pytest.raises(UsageError, match="integer >= 1 or per-node"):
        build_config({}, {"servers": "0"})


def test_check_servers_on_a_node_layout():
    per = config_stub(servers="per-node", inject=[])
    check_servers(per, 6, 1000, nodes=BLOCK)
    with pytest.raises(UsageError, match="--servers per-node leaves no worker: each of the "
                                         "job's 3 nodes has one rank"):
        check_servers(per, 3, 1000, nodes=[0, 1, 2])
    check_servers(per, 1, 1000)                     # serial: one store, no error
    with pytest.raises(UsageError, match="exceeds the model's 2 parameters"):
        check_servers(per, 6, 2, nodes=BLOCK)
    # --inject on a store placed by node is refused, on a worker accepted
    with pytest.raises(UsageError, match=r"rank 2 is a parameter store \(--servers 2: ranks 0, 2\)"
                                         r", not a worker; target workers 1, 3-5"):
        check_servers(config_stub(servers=2, inject=["2:compute=2"]), 6, 1000, nodes=BLOCK)
    check_servers(config_stub(servers=2, inject=["1:compute=2"]), 6, 1000, nodes=BLOCK)


def test_placement_note():
    assert placement_note([0] * 4, "per-node") == ("--servers per-node: the job is on one node, "
                                                   "so one parameter store (rank 0)")
    assert "3 parameter stores, one on each node (ranks 0, 2, 4)" in placement_note(BLOCK, "per-node")
    assert placement_note(BLOCK, 2) is None and placement_note([0] * 4, 3) is None
    assert placement_note(BLOCK, 4) == "--servers 4 on 3 nodes: stores on ranks 0-2, 4, up to 2 on a node"


def test_span():
    assert span([0, 1, 2, 5]) == "0-2, 5"
    assert span([3, 4]) == "3, 4"
    assert span([]) == "none"


def test_layout_lines_show_nodes_stores_and_the_paths():
    lines = layout_lines(BLOCK, [0, 2], ["n0", "n0", "n1", "n1", "n2", "n2"])
    assert lines == [
        "6 rank(s) on 3 node(s); parameter store(s) on rank(s) 0, 2",
        "node 0 (n0): rank(s) 0 store, 1",
        "node 1 (n1): rank(s) 2 store, 3",
        "node 2 (n2): rank(s) 4, 5",
        "store 0 <-> workers: shared memory 1; network 3-5",
        "store 2 <-> workers: shared memory 3; network 1, 4, 5",
        "rank 0 <-> stores 2 (its commands): network",
    ]


def test_two_stores_on_a_node_while_another_has_none_warn():
    (w,) = crowded(BLOCK, [0, 1])
    assert w.startswith("stores on ranks 0, 1 share node 0 while nodes 1, 2 have none")
    assert crowded([0, 0, 1, 1], [0, 1, 2]) == []        # every node has one: no warning
    assert crowded([0] * 4, [0, 1]) == []                 # one node: nowhere else to go


def test_the_report_shows_the_layout_from_the_log_attributes():
    attrs = {"world_size": 6, "nodes": json.dumps(BLOCK), "stores": json.dumps([0, 2]),
             "hostnames": json.dumps(["a", "a", "b", "b", "c", "c"]),
             "config": json.dumps({"servers": 2})}
    text = "\n".join(format_layout(attrs))
    assert "layout: 6 rank(s) on 3 node(s)" in text and "node 1 (b): rank(s) 2 store, 3" in text
    assert "warning" not in text
    # a log from before placement by node: nodes from the host names, stores 0..K-1: warned
    old = {"world_size": 6, "hostnames": json.dumps(["a", "a", "b", "b", "c", "c"]),
           "config": json.dumps({"servers": 2})}
    assert "warning: stores on ranks 0, 1 share node 0" in "\n".join(format_layout(old))
    assert format_layout({"world_size": 1, "config": "{}"}) == []


def _worker(rank, comm_s, compute_s=1.0, samples=3200, mean_batch=32.0):
    return {"rank": rank, "compute_s": compute_s, "io_s": 0.0, "comm_s": comm_s, "idle_s": 0.0,
            "samples": samples, "mean_batch": mean_batch}


def test_the_report_says_what_the_workers_on_the_network_spent_communicating():
    from mpilb.runfiles.report import format_network

    # rank 0 (the store) on node 0, workers 1-4 on nodes 1 and 2: every exchange crosses
    attrs = {"world_size": 5, "nodes": json.dumps([0, 1, 1, 2, 2]), "stores": json.dumps([0]),
             "servers": json.dumps([{"rank": 0, "params": 335114}]),
             "config": json.dumps({"servers": 1, "wire": "fp32"})}
    s = {"per_worker": [_worker(r, c) for r, c in ((1, 1.5), (2, 1.2), (3, 1.0), (4, 0.8))]}
    (line,) = format_network(s, attrs)
    assert line.startswith("  network: rank(s) 1-4 reach a store over the network and spent "
                           "44%-60% of their time communicating (median 52%)"), line
    # 100 exchanges each: 11.0 ms at the median of 15, 12, 10, 8 ms
    assert "a push and its reply carry 1.34 MB each (fp32), and an exchange took 11.0 ms" in line
    bf16 = dict(attrs, config=json.dumps({"servers": 1, "wire": "bf16"}))
    assert "670 KB each (bf16)" in format_network(s, bf16)[0]
    # workers beside every store (shared memory) are not counted
    near = dict(attrs, nodes=json.dumps([0, 0, 0, 1, 1]))
    assert format_network(s, near)[0].startswith("  network: rank(s) 3, 4 reach")
    # one node, or no worker across: no line
    assert format_network(s, dict(attrs, nodes=json.dumps([0] * 5))) == []
    per_node = dict(attrs, nodes=json.dumps([0, 0, 1, 1]), stores=json.dumps([0, 2]))
    assert format_network({"per_worker": [_worker(1, 1.0), _worker(3, 1.0)]}, per_node)[0].startswith(
        "  network: rank(s) 1, 3 reach")
