"""Parameter stores placed by node, on three emulated nodes (mpilb.clusterbox): the run log
records every rank's node, `--servers 2` under the block layout has its stores on two nodes,
`--servers per-node` one on each, with exact coverage; `bench ps --servers per-node` places
its stores the same way; `mpilb report` shows the layout without a warning, `mpilb doctor`
the job's layout."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import pytest

from mpilb.clusterbox import ClusterBox, missing
from mpilb.runfiles.summary import summarize_log

import mpirun

WHY = missing()
pytestmark = [pytest.mark.cluster, pytest.mark.mpi]
needs_box = pytest.mark.skipif(WHY is not None, reason=f"no cluster box here: {WHY}")

BLOCK = "n0:2,n1:2,n2:2"
MPILB = [sys.executable, "-m", "mpilb"]


def root_attrs(log) -> dict:
    with h5py.File(log, "r") as f:
        return {k: f.attrs[k] for k in ("nodes", "stores", "hostnames")}


def exact(s) -> bool:
    cov = s["coverage"]
    return cov["expected"] > 0 and cov["applied"] == cov["expected"] and \
        cov["duplicates"] == 0 and cov["missing"] == 0


@needs_box
def test_stores_are_placed_by_node_on_three_nodes(digits_dir, tmp_path):
    train = [*MPILB, "train", "--data", digits_dir, "--model", "mlp", "--hidden", "32",
             "--epochs", "2", "--no-progress", "--balancer", "static"]
    logs = {k: tmp_path / f"servers-{k}.h5" for k in ("2", "per-node")}
    with ClusterBox(nodes=3, link_rate="1gbit") as box:
        runs = {k: box.mpiexec(["-hosts", BLOCK, *train, "--servers", k, "--log", str(log)],
                               timeout=180, env=mpirun.env())
                for k, log in logs.items()}
        bench = box.mpiexec(["-hosts", BLOCK, *MPILB, "bench", "ps", "--params", "10000",
                             "--seconds", "0.3", "--repeats", "1", "--servers", "per-node",
                             "--json"], timeout=120, env=mpirun.env())
        doctor = box.mpiexec(["-hosts", BLOCK, *MPILB, "doctor"], timeout=120, env=mpirun.env())
    for k, res in runs.items():
        assert res.returncode == 0, (k, res.stderr)
    for k, stores in (("2", [0, 2]), ("per-node", [0, 2, 4])):
        attrs = root_attrs(logs[k])
        assert json.loads(attrs["nodes"]) == [0, 0, 1, 1, 2, 2]           # by rank
        assert json.loads(attrs["hostnames"]) == ["n0", "n0", "n1", "n1", "n2", "n2"]
        assert json.loads(attrs["stores"]) == stores
        s = summarize_log(str(logs[k]))
        assert s["status"] == "finished" and exact(s), s["coverage"]
        assert [v["rank"] for v in s["servers"]] == stores
        assert all(v["updates"] > 0 for v in s["servers"])
        assert s["workers"] == 6 - len(stores)
        assert sorted(w["rank"] for w in s["per_worker"]) == [r for r in range(6) if r not in stores]
    # each store on a node of its own: one store per node, on three nodes
    assert "--servers per-node: 3 parameter stores, one on each node" in runs["per-node"].stderr
    assert bench.returncode == 0, bench.stderr
    result = json.loads(bench.stdout.strip().splitlines()[-1])
    assert result["stores"] == [0, 2, 4] and result["workers"] == 3
    assert [v["rank"] for v in result["runs"][0]["servers"]] == [0, 2, 4]
    report = subprocess.run([*MPILB, "report", str(logs["2"])], capture_output=True, text=True,
                            timeout=60, env=mpirun.env())
    assert report.returncode == 0, report.stderr
    assert "node 1 (n1): rank(s) 2 store, 3" in report.stdout
    assert "store 2 <-> workers: shared memory 3; network 1, 4, 5" in report.stdout
    assert "warning" not in report.stdout
    # every worker reaches one of the stores across a link: what that cost them
    assert "  network: rank(s) 1, 3-5 reach a store over the network and spent" in report.stdout
    assert "a push and its reply carry" in report.stdout
    # doctor shows the job's layout, and where --servers would put the stores
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "  6 rank(s) on 3 node(s); parameter store(s) on rank(s) 0\n" in doctor.stdout
    assert "  node 2 (n2): rank(s) 4, 5\n" in doctor.stdout
    assert "  store 0 <-> workers: shared memory 1; network 2-5\n" in doctor.stdout
    assert "  stores with --servers per-node: ranks 0, 2, 4\n" in doctor.stdout
