"""Node-local stores on three emulated nodes: a node whose copy of a shard differs from rank
0's is refused at start-up, and `--replicas 2` survives losing a whole node."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "benchmarks"))
import mpirun  # noqa: E402
from _runs import alive, marked_processes  # noqa: E402
from mpilb.clusterbox import ClusterBox, missing  # noqa: E402
from mpilb.data.dataset import open_dataset, prepare_synthetic  # noqa: E402
from mpilb.runfiles.summary import summarize_log  # noqa: E402
from mpilb.data.shards import placement  # noqa: E402
from mpirun import recomputed_coverage  # noqa: E402

WHY = missing()
pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(WHY is not None, reason=f"no cluster box here: {WHY}")]

HOSTS = "n0:1,n1:2,n2:2"                   # rank 0 on n0; workers 1, 2 on n1 and 3, 4 on n2
RANK_HOSTS = ["n0", "n1", "n1", "n2", "n2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes") / "synth"
    prepare_synthetic(root, samples=6000, features=16, classes=4, shards=8, seed=0)
    return root


def stage(box, reference) -> None:
    """The dataset copied to every node's own local directory (as stage_local.sbatch does)."""
    for k in range(3):
        dest = box.dir / f"node{k}" / "local" / "synth"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(reference, dest)


def train_args(box, tmp_path, *extra):
    return ["-disable-auto-cleanup", "-hosts", HOSTS, sys.executable, "-m", "mpilb", "train",
            "--data", os.path.join(box.local_dir, "synth"), "--store", "local", "--hidden", "16",
            "--no-progress", "--log", str(tmp_path / "run.h5"), *map(str, extra)]


def test_a_node_whose_copy_of_a_shard_differs_is_refused(reference, tmp_path):
    """Node n2's copy of one of its shards comes from another seed: before, only rank 0's
    node was checked and it trained silently; now n2's first rank (3) refuses it, exit 2."""
    other = prepare_synthetic(tmp_path / "other", samples=6000, features=16, classes=4, shards=8,
                              seed=1)
    p = placement(8, [1, 2, 3, 4], 2, RANK_HOSTS)
    shard = next(s for s, c in p.items() if 3 in c or 4 in c)
    name = other.shards[shard].file
    with ClusterBox(nodes=3) as box:
        stage(box, reference)
        shutil.copy(tmp_path / "other" / name, box.dir / "node2" / "local" / "synth" / name)
        # (a refusal at start-up needs no -disable-auto-cleanup; under it, Hydra's mpiexec
        # in the box exited 10 or by SIGPIPE where every rank returned 2: see docs/faults.md)
        args = [a for a in train_args(box, tmp_path, "--replicas", 2, "--epochs", 1)
                if a != "-disable-auto-cleanup"]
        res = box.mpiexec(args, timeout=180, env=mpirun.env())
    assert res.returncode == 2, (res.returncode, res.stderr)
    errors = [line for line in res.stderr.splitlines() if line.startswith("mpilb: error:")]
    assert len(errors) == 1, res.stderr
    assert errors[0].startswith(f"mpilb: error: rank 3 on node n2: {box.local_dir}/synth/{name}: "
                                f"checksum mismatch"), errors
    assert not (tmp_path / "run.h5").exists()


def test_replicas_2_survive_losing_a_whole_node(reference, tmp_path):
    """Both ranks of n2 stop (a node that hangs): with each shard's two copies on ranks of
    different nodes the others finish every epoch, degraded, with exact coverage (before:
    copies on adjacent ranks 3 and 4, exit 1 'every rank holding a copy was lost').

    The workers are paced (4 ms a step, 1500 steps each before the stop) so that the run
    outlives the stop on a fast machine too: unpaced, 40 epochs took 1.7 s in CI, ended
    before the stop, and Hydra then waited for n2's stopped ranks."""
    epochs = 40
    env = mpirun.env(MPILB_TEST_JOB=str(tmp_path))
    mark = b"MPILB_TEST_JOB=" + str(tmp_path).encode()
    with ClusterBox(nodes=3) as box:
        stage(box, reference)
        proc = box.popen(0, box.mpiexec_cmd(train_args(box, tmp_path, "--replicas", 2,
                                                        "--epochs", epochs, "--worker-timeout", 3,
                                                        "--inject", "*:delay=0.004")),
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        node2 = []
        try:
            node2 = _wait_ranks(mark, proc, {3, 4})
            _wait_training(tmp_path / "run.h5", proc)
            for pid in node2:
                os.kill(pid, signal.SIGSTOP)
            assert summarize_log(str(tmp_path / "run.h5"))["status"] == "running", \
                "the run ended before n2 was stopped"
            out, err = proc.communicate(timeout=240)
        finally:
            for pid in node2:                # never leave a stopped rank behind
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 3, (proc.returncode, err)
    s = summarize_log(str(tmp_path / "run.h5"))
    assert s["status"] == "degraded" and sorted(s["lost_workers"]) == [3, 4], err
    assert s["epochs_completed"] == epochs
    mine = recomputed_coverage(str(tmp_path / "run.h5"), reference_sizes(reference))
    assert mine["applied"] == mine["expected"] and mine["duplicates"] == mine["missing"] == 0, mine


def reference_sizes(reference) -> list[int]:
    return open_dataset(reference).shard_sizes


def _wait_ranks(mark: bytes, proc, ranks: set, timeout=60) -> list[int]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()
        found = [pid for pid, e in marked_processes(mark).items()
                 if e.get(b"PMI_RANK", b"-1").isdigit() and int(e[b"PMI_RANK"]) in ranks]
        if len(found) == len(ranks):
            return found
        time.sleep(0.2)
    raise AssertionError("ranks did not start")


def _wait_training(log, proc, timeout=120):
    mpirun.wait_training(log, proc, timeout)


def test_a_partitioned_nodes_workers_end_themselves(reference, tmp_path):
    """n2's link goes down for good (a partition): rank 0 declares its ranks lost and goes
    on; they hear nothing from rank 0 and end themselves within the watchdog's limit, while
    the run still goes on (before: workers and proxy still alive minutes after the job
    ended). The run then ends degraded with exact coverage and leaves no process behind.
    (Their own lines cannot reach mpiexec: Hydra's proxy forwards output over the network.
    The time they took, against the limit, says it was their watchdog.)"""
    from mpilb.mpi.watchdog import limit

    timeout = 3
    env = mpirun.env(MPILB_TEST_JOB=str(tmp_path))
    mark = b"MPILB_TEST_JOB=" + str(tmp_path).encode()
    with ClusterBox(nodes=3) as box:
        stage(box, reference)
        proc = box.popen(0, box.mpiexec_cmd(train_args(box, tmp_path, "--replicas", 2,
                                                        "--epochs", 90, "--worker-timeout", timeout,
                                                        "--inject", "*:delay=0.004")),
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        node2 = []
        try:
            node2 = _wait_ranks(mark, proc, {3, 4})
            _wait_training(tmp_path / "run.h5", proc)
            assert box.run(2, ["ip", "link", "set", "eth0", "down"], timeout=10).returncode == 0
            t0 = time.monotonic()
            while any(alive(p) for p in node2) and time.monotonic() - t0 < limit(timeout) + 10:
                time.sleep(0.2)
            took = time.monotonic() - t0
            still_running = proc.poll() is None
            left = [p for p in node2 if alive(p)]
            out, err = proc.communicate(timeout=240)
        finally:
            box.run(2, ["ip", "link", "set", "eth0", "up"], timeout=10)
            for pid in node2:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
        time.sleep(1.0)
        behind = list(marked_processes(mark))
    assert not left and still_running, (left, still_running, err)
    assert limit(timeout) - 1 < took < limit(timeout) + 5, (took, err)
    assert proc.returncode == 3, (proc.returncode, err)
    assert not behind, behind
    s = summarize_log(str(tmp_path / "run.h5"))
    assert s["status"] == "degraded" and sorted(s["lost_workers"]) == [3, 4], err
    mine = recomputed_coverage(str(tmp_path / "run.h5"), reference_sizes(reference))
    assert mine["applied"] == mine["expected"] and mine["duplicates"] == mine["missing"] == 0, mine



def test_a_joiner_whose_nodes_copy_differs_withdraws_at_once(reference, tmp_path):
    """A `--store local` run on n0 (rank 0) and n1 (workers 1, 2, which hold every shard);
    then n1's copy of one shard is replaced by another seed's, and `mpilb join` on n1 checks
    its node's copies against rank 0's checksums: one line naming the file, exit 2. It tells
    rank 0 it withdraws, and rank 0 drops the port it offered within a few of its rounds
    (before: only after 60 s, its offer's timeout, as it cannot see a process on another
    host; the workers are paced, 6 ms a step, so that the run outlasts that window by far).
    The run goes on and ends finished, exit 0, exact, with one line on the drop."""
    from mpilb.runfiles.requests import requests_dir

    other = prepare_synthetic(tmp_path / "other", samples=6000, features=16, classes=4, shards=8,
                              seed=1)
    name = other.shards[0].file
    log = tmp_path / "run.h5"
    with ClusterBox(nodes=2) as box:
        stage(box, reference)
        args = ["-hosts", "n0:1,n1:2", sys.executable, "-m", "mpilb", "train", "--data",
                os.path.join(box.local_dir, "synth"), "--store", "local", "--hidden", "16",
                "--epochs", 40, "--inject", "*:delay=0.006", "--no-progress", "--log", log]
        proc = box.popen(0, box.mpiexec_cmd([str(a) for a in args]), env=mpirun.env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_training(log, proc)
            copy = box.dir / "node1" / "local" / "synth" / name
            shutil.copy(tmp_path / "other" / name, str(copy) + ".new")
            os.replace(str(copy) + ".new", copy)   # (a new file: the job's ranks keep theirs)
            joiner = box.run(1, [mpirun.mpiexec(), "-n", "1", sys.executable, "-m", "mpilb",
                                 "join", str(log)], timeout=120, env=mpirun.env())
            ended = time.monotonic()
            offered = lambda: [n for n in os.listdir(requests_dir(str(log)))   # noqa: E731
                               if n.endswith((".port", ".withdrawn"))]
            while offered() and time.monotonic() < ended + 10:
                time.sleep(0.05)
            left = offered()
            # (the run's end drops every offer: it must still be going on)
            assert summarize_log(str(log))["status"] == "running", "the run ended first"
            out, err = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    assert joiner.returncode == 2, (joiner.returncode, joiner.stderr)
    errors = [line for line in joiner.stderr.splitlines() if line.startswith("mpilb: error:")]
    assert len(errors) == 1 and name in errors[0] and "checksum mismatch" in errors[0], joiner.stderr
    assert not left, left   # dropped within 10 s of the joiner's end (its offer's timeout: 60 s)
    assert proc.returncode == 0, err
    assert [line for line in err.splitlines() if "was dropped: the joiner withdrew (" in line
            and name in line], err
    s = summarize_log(str(log))
    cov = s["coverage"]
    assert s["status"] == "finished" and cov["missing"] == 0 and cov["duplicates"] == 0
    assert cov["applied"] == cov["expected"] > 0
