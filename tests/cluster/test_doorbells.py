"""Doorbells across nodes, on three emulated nodes (mpilb.clusterbox): rank 0 and the
workers on other nodes ring each other over UDP (the run log's `doorbells` counts the rings
rank 0 read from each), a worker on rank 0's node rings through its local socket, and a
worker that cannot open its UDP socket polls beside the others with exact coverage; the
nodes' ranks count as sharing the machine's CPUs (mpilb.mpi.cores)."""

from __future__ import annotations

import ast
import json
import sys
import textwrap

import h5py
import numpy as np
import pytest

from mpilb.clusterbox import ClusterBox, missing
from mpilb.mpi import cores
from mpilb.runfiles.summary import summarize_log

import mpirun

WHY = missing()
pytestmark = [pytest.mark.cluster, pytest.mark.mpi]
needs_box = pytest.mark.skipif(WHY is not None, reason=f"no cluster box here: {WHY}")

OPEN_SCRIPT = textwrap.dedent("""
    from mpilb.mpi import comm as C, cores, doorbell
    comm, rank, size = C.world()
    bell = doorbell.open_job(comm, rank, size)
    rows = comm.gather({p: bell.via(p) for p in sorted(bell.peers)}, root=0)
    spins = cores.spinning(comm)
    if rank == 0:
        print(repr((rows, spins)), flush=True)
""")

# rank 3 cannot bind a UDP socket (as where a firewall or a missing route stops its rings)
NO_UDP_SCRIPT = textwrap.dedent("""
    import socket, sys
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 3:
        bind = socket.socket.bind
        def refuse(self, address):
            if self.family == socket.AF_INET:
                raise OSError("no UDP here")
            return bind(self, address)
        socket.socket.bind = refuse
    from mpilb.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


def doorbells(log) -> dict:
    with h5py.File(log, "r") as f:
        return json.loads(f.attrs["doorbells"])


def pushes(log) -> dict:
    with h5py.File(log, "r") as f:
        ranks, counts = np.unique(f["updates/worker"][:], return_counts=True)
    return {int(r): int(n) for r, n in zip(ranks, counts)}


def exact(s) -> bool:
    cov = s["coverage"]
    return cov["expected"] > 0 and cov["applied"] == cov["expected"] and \
        cov["duplicates"] == 0 and cov["missing"] == 0


@needs_box
def test_rings_cross_nodes_and_a_rank_without_them_polls(digits_dir, tmp_path):
    (tmp_path / "bells.py").write_text(OPEN_SCRIPT)
    (tmp_path / "no_udp.py").write_text(NO_UDP_SCRIPT)
    train = ["train", "--data", digits_dir, "--model", "softmax", "--batch", "32", "--epochs", "2",
             "--inject", "*:delay=0.02", "--no-progress"]
    remote, mixed = tmp_path / "remote.h5", tmp_path / "mixed.h5"
    with ClusterBox(nodes=3, link_rate="1gbit") as box:
        opened = box.mpiexec(["-hosts", "n0:2,n1:2,n2:1", sys.executable, str(tmp_path / "bells.py")],
                             timeout=120, env=mpirun.env())
        runs = [box.mpiexec(["-hosts", "n0:1,n1:2,n2:1", sys.executable, *script, *train,
                             "--log", str(log)], timeout=240, env=mpirun.env())
                for script, log in ((["-m", "mpilb"], remote), ([str(tmp_path / "no_udp.py")], mixed))]
    assert opened.returncode == 0, opened.stderr
    rows, spins = ast.literal_eval(opened.stdout.strip().splitlines()[-1])
    assert rows == [{1: "local", 2: "network", 3: "network", 4: "network"},
                    {0: "local"}, {0: "network"}, {0: "network"}, {0: "network"}]
    # the box's nodes share this machine's CPUs: its 5 ranks poll first only where it has
    # a CPU for each (rank 0: and one more), whatever their host names
    cpus = cores.usable_cpus()
    assert spins == [6 <= cpus] + [5 <= cpus] * 4
    for res in runs:
        assert res.returncode == 0, res.stderr
    # every worker is on another node than rank 0: each rang it over the network, about once
    # a push (UDP may lose a ring; the push is found all the same)
    bells, pushed = doorbells(remote), pushes(remote)
    assert sorted(bells) == ["1", "2", "3"] and all(b["via"] == "network" for b in bells.values())
    for r in (1, 2, 3):
        assert bells[str(r)]["rings"] >= 0.5 * pushed[r] > 0, (r, bells, pushed)
    assert exact(summarize_log(str(remote)))
    # rank 3 has no UDP socket: it and rank 0 poll for each other, the others still ring
    bells = doorbells(mixed)
    assert sorted(bells) == ["1", "2"] and all(b["rings"] > 0 for b in bells.values())
    s = summarize_log(str(mixed))
    assert exact(s) and all(w["samples"] > 0 for w in s["per_worker"])
