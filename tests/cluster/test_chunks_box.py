"""--chunk-kb across the box's network (mpi/chunks.py): pushes and replies between nodes in
chunks, each answered as it is applied, over TCP. One worker on another node without
pipelining steps the same floats chunked as in one message; three stores and three workers
(the block layout, `--servers per-node`, bf16) keep exact coverage; `bench ps` streams its
null workers' chunks. The chunks are made small (--chunk-kb 1) so that a small model has
several."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from mpilb.clusterbox import ClusterBox, missing

import mpirun

WHY = missing()
pytestmark = [pytest.mark.cluster, pytest.mark.mpi]
needs_box = pytest.mark.skipif(WHY is not None, reason=f"no cluster box here: {WHY}")

MPILB = [sys.executable, "-m", "mpilb"]


@needs_box
def test_chunks_cross_the_network_and_step_the_same_floats(digits_dir, tmp_path):
    train = [*MPILB, "train", "--data", digits_dir, "--model", "mlp", "--hidden", "64",
             "--seed", "3", "--no-progress"]
    with ClusterBox(nodes=3, link_rate="1gbit") as box:
        one = {}
        for kb in (0, 1):   # rank 0 on n0, its one worker on n1: 19 KB a push, 19 chunks
            log = tmp_path / f"one-{kb}.h5"
            res = box.mpiexec(["-hosts", "n0:1,n1:1", *train, "--epochs", "2", "--pipeline", "0",
                               "--optimizer", "momentum", "--chunk-kb", str(kb), "--log", str(log),
                               "--checkpoint", str(tmp_path / f"one-{kb}.ckpt.h5")],
                              timeout=180, env=mpirun.env())
            assert res.returncode == 0, (kb, res.stderr)
            mpirun.finished_exact(log)
            one[kb] = mpirun.checkpoint_floats(tmp_path / f"one-{kb}.ckpt.h5")
        log = tmp_path / "per-node.h5"
        res = box.mpiexec(["-hosts", "n0:2,n1:2,n2:2", *train, "--epochs", "8", "--servers",
                           "per-node", "--wire", "bf16", "--chunk-kb", "1", "--log", str(log)],
                          timeout=180, env=mpirun.env())
        bench = box.mpiexec(["-hosts", "n0:2,n1:2,n2:2", *MPILB, "bench", "ps", "--params",
                             "100000", "--seconds", "0.5", "--repeats", "1", "--servers",
                             "per-node", "--chunk-kb", "16", "--json"], timeout=120,
                            env=mpirun.env())
    assert one[0].keys() == one[1].keys() and one[0]
    for key, value in one[0].items():
        assert np.array_equal(value, one[1][key]), key
    assert res.returncode == 0, res.stderr
    s = mpirun.finished_exact(log)
    assert s["final_test_accuracy"] >= 0.85, s["final_test_accuracy"]
    assert bench.returncode == 0, bench.stderr
