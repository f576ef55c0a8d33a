"""A worker that joins a running job from another node (mpilb.clusterbox): a run on n0 and
n1, joined by `mpiexec -n 1 mpilb join` started on n1. The joiner is admitted, rings rank 0
over the network (it cannot reach rank 0's local socket from another node), the run ends
finished with exact coverage, and its `join` row in members/ names n1's node."""

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


@needs_box
def test_a_worker_on_another_node_joins(digits_dir, tmp_path):
    log = tmp_path / "run.h5"
    train = ["train", "--data", digits_dir, "--model", "softmax", "--batch", "32", "--epochs", "60",
             "--inject", "*:delay=0.002", "--no-progress", "--log", str(log)]
    with ClusterBox(nodes=2) as box:
        run = subprocess.Popen(
            box.command(0, box.mpiexec_cmd(["-hosts", "n0:2,n1:1", sys.executable, "-m", "mpilb",
                                            *train])),
            env=box.env(mpirun.env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            mpirun.wait_training(str(log), run, timeout=120)
            joiner = box.popen(1, [mpirun.mpiexec(), "-n", "1", sys.executable, "-m", "mpilb",
                                   "join", str(log)], env=mpirun.env(MPILB_DEBUG=1),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            _, jerr = joiner.communicate(timeout=300)
            _, err = run.communicate(timeout=300)
        finally:
            for proc in (run, *([joiner] if "joiner" in locals() else [])):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
    assert joiner.returncode == 0, jerr
    assert "mpilb: joined as worker 3" in jerr, jerr
    assert run.returncode == 0, err
    with h5py.File(log, "r") as f:
        nodes = json.loads(f.attrs["nodes"])
        hosts = json.loads(f.attrs["hostnames"])
        bells = json.loads(f.attrs["doorbells"])
        events = [e.decode() if isinstance(e, bytes) else str(e) for e in f["members/event"][:]]
        workers, where = list(f["members/worker"][:]), list(f["members/node"][:])
    assert events == ["join"] and workers == [3]
    assert where == [nodes[hosts.index("n1")]] and where != [nodes[0]], (where, nodes, hosts)
    assert bells["3"]["via"] == "network" and bells["3"]["rings"] > 0, bells
    s = summarize_log(str(log))
    cov = s["coverage"]
    assert s["status"] == "finished"
    assert cov["applied"] == cov["expected"] > 0 and cov["missing"] == 0 and cov["duplicates"] == 0
    assert 3 in {w["rank"] for w in s["per_worker"]}
