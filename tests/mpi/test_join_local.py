"""Joins of `--store local` runs, and workers that joined leaving (docs/membership.md).

A joiner reads the shards its node holds (those of the job's workers on its host) and gets
the others' rows through rank 0, which relays what their holder sends (server/relay.py); a
joiner let go (`mpilb leave --rank R`, SIGUSR2 to its process) finishes its step, hands
its work back, disconnects from rank 0 and exits 0 while the run goes on. Every run ends
`finished`, exit 0, with every sample of every epoch applied exactly once (recomputed from
`updates/`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import mpirun
from mpilb.data.dataset import open_dataset
from mpilb.runfiles.runlog import read_columns
from test_joining import joiner_pid
from test_membership import data, finish, gone_within, leave, start  # noqa: F401

pytestmark = pytest.mark.mpi


def joiner(log) -> subprocess.Popen:
    return subprocess.Popen(mpirun.mpilb_cmd(1, "join", str(log)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=mpirun.env(),
                            start_new_session=True)


def exact(log, data):
    """The run ended finished with every sample of every epoch applied once; its columns."""
    attrs, cols = read_columns(str(log))
    assert attrs["status"] == "finished"
    cov = mpirun.recomputed_coverage(str(log), open_dataset(data).shard_sizes)
    assert cov["missing"] == 0 and cov["duplicates"] == 0 and cov["applied"] == cov["expected"], cov
    return attrs, cols


def members(cols) -> list[tuple[int, str]]:
    m = cols["members"]
    return [(int(w), e.decode() if isinstance(e, bytes) else str(e))
            for w, e in zip(m["worker"], m["event"])]


def rows_to(cols, rank: int) -> int:
    """Bytes of shard rows sent to worker `rank` (shards/ `move` rows with bytes)."""
    sh = cols["shards"]
    events = [e.decode() if isinstance(e, bytes) else str(e) for e in sh["event"]]
    return int(sum(int(b) for d, e, b in zip(sh["dst"], events, sh["bytes"])
                   if int(d) == rank and e == "move"))


def wait_joined(log, rank: int, timeout: float = 60.0) -> None:
    """Until the run log holds an applied update of worker `rank`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _, cols = read_columns(str(log))
            if (cols["updates"]["worker"] == rank).any():
                return
        except (OSError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"worker {rank} never pushed")


def test_a_joiner_holds_its_nodes_shards_and_is_never_asked_for_rows():
    """Pure (no mpiexec): a joiner's shards are those of the job's workers on its host; in
    the ledger it reads them itself, is never the holder ordered to send rows, and counts as
    no copy for another worker's leave; its rows come from a job's holder."""
    from mpilb.core.balancer import BalancerConfig, build_balancer
    from mpilb.core.holdings import Holding
    from mpilb.core.tasks import TaskLedger
    from mpilb.data.shards import placement
    from mpilb.server.roster import sole_copies
    from mpilb.worker.row_exchange import node_shards

    hosts = ["a", "a", "b"]   # rank 0 and 1 on a, rank 2 on b
    assert node_shards(6, "b", [1, 2], 1, hosts) == {s for s in range(6) if s % 2 == 1}
    assert node_shards(6, "c", [1, 2], 1, hosts) == set()
    holders = placement(6, [1, 2], 1, hosts)
    bal = build_balancer("load", [1, 2], [100] * 6, BalancerConfig(batch=32), holders)
    bal.plan_epoch(0, list(range(6)))
    ledger = TaskLedger(bal, [100] * 6, [1, 2], holders=holders)
    ledger.of[3] = Holding(3)
    ledger.readers.add(3)
    for shard in node_shards(6, "b", [1, 2], 1, hosts):
        holders[shard].append(3)
    bal.add_worker(3)
    ledger.assign(3, 1, 0, 100)   # its node's: read itself
    ledger.assign(3, 0, 0, 100)   # rank 1's: rank 1 sends, rank 0 relays
    assert [(t.shard, t.src) for t in ledger.tasks(3)] == [(1, -1), (0, 1)]
    assert [o.dst for o in ledger.of[1].orders] == [3]
    assert ledger.holder_for(1, 100) == 2   # never the joiner
    assert sole_copies(ledger, 2) == [1, 3, 5] and sole_copies(ledger, 3) == []


def test_store_local_joiners_read_their_nodes_shards_and_leave_by_command_or_signal(data, tmp_path):
    """`--store local --replicas 2` on 3 ranks of this host, joined by one worker and then
    by another (one run for both: the suite's time). Worker 3 is on the job's node, which
    holds every shard, and reads what it is given from the disk (no rows are sent to it);
    `mpilb leave --rank 3` lets it go: its launch exits 0 within 15 s while the run goes on,
    and asked again: "has left the run already". Worker 4 is let go by SIGUSR2 to its own
    process: it tells rank 0 on its connection, leaves after its step, exits 0. members/
    holds each join then its leave, no update of a joiner after its leave; the run ends
    finished, exit 0, coverage exact. (Refused before: "--store local takes no joins yet",
    "a worker that joined cannot leave yet".)"""
    log = tmp_path / "run.h5"
    proc = start(3, data, log, 50, "--store", "local", "--replicas", "2")
    j = None
    try:
        mpirun.wait_training(str(log), proc)
        j = joiner(log)
        wait_joined(log, 3)
        asked = time.monotonic()
        done = leave(log, 3)
        assert done.returncode == 0, done.stderr
        assert "rank 3 leaves after its current step" in done.stdout
        jcode, _, jerr = finish(j, timeout=60)
        assert jcode == 0, jerr
        assert "mpilb: joined as worker 3" in jerr, jerr
        assert time.monotonic() - asked < 15.0
        assert proc.poll() is None, "the run ended with the joiner"
        again = leave(log, 3)
        assert again.returncode == 2 and "has left the run already" in again.stderr, again.stderr
        j = joiner(log)
        wait_joined(log, 4)
        pid = joiner_pid(log)
        os.kill(pid, signal.SIGUSR2)
        assert gone_within(pid, 15.0), "the joiner let go is still running"
        jcode, _, jerr = finish(j, timeout=60)
        assert jcode == 0, jerr
        assert proc.poll() is None, "the run ended with the joiner"
    finally:
        code, _, err = finish(proc)
        if j is not None and j.poll() is None:
            os.killpg(j.pid, signal.SIGKILL)
    assert code == 0, err
    attrs, cols = exact(log, data)
    assert members(cols) == [(3, "join"), (3, "leave"), (4, "join"), (4, "leave")]
    up = cols["updates"]
    for rank, left_at in ((3, float(cols["members"]["t"][1])), (4, float(cols["members"]["t"][3]))):
        assert (up["worker"] == rank).sum() > 0
        assert not (up["t"][up["worker"] == rank] > left_at + 0.5).any()   # nothing after it left
    assert rows_to(cols, 3) == 0 and rows_to(cols, 4) == 0   # the node's disk holds every shard
    summary = attrs["summary"]
    assert summary["lost_workers"] == []
    assert {3, 4} <= {w["rank"] for w in summary["per_worker"]}
    assert "rank 3 left the run at" in err


def test_a_joiner_of_a_two_store_store_local_run_trains_and_leaves(data, tmp_path):
    """`--store local --servers 2 --replicas 2`: rank 0 and a second store (rank 1), workers
    2 and 3, joined by worker 4, which every store admits and whose pushes both apply; it
    reads its node's shards (this host holds every one) and leaves by `mpilb leave`. The run
    ends finished, exit 0, exact coverage; the joiner's updates count."""
    from test_membership import PACED

    log = tmp_path / "run.h5"
    proc = start(4, data, log, 12, "--store", "local", "--replicas", "2", "--servers", "2",
                 *PACED)
    j = None
    try:
        mpirun.wait_training(str(log), proc)
        j = joiner(log)
        wait_joined(log, 4)
        time.sleep(0.5)
        done = leave(log, 4)
        assert done.returncode == 0, done.stderr
        jcode, _, jerr = finish(j, timeout=60)
        assert jcode == 0 and "mpilb: joined as worker 4" in jerr, jerr
        assert proc.poll() is None, "the run ended with the joiner"
    finally:
        code, _, err = finish(proc)
        if j is not None and j.poll() is None:
            os.killpg(j.pid, signal.SIGKILL)
    assert code == 0, err
    attrs, cols = exact(log, data)
    assert members(cols) == [(4, "join"), (4, "leave")]
    assert (cols["updates"]["worker"] == 4).sum() > 0 and rows_to(cols, 4) == 0
    assert attrs["summary"]["lost_workers"] == []


def _box_missing():
    from mpilb.clusterbox import missing

    return missing()


@pytest.mark.cluster
@pytest.mark.skipif(_box_missing() is not None, reason="no cluster box here")
def test_joiners_on_other_nodes_read_their_nodes_shards_and_get_the_rest_through_rank_0(
        data, tmp_path):
    """The cluster in a box: a `--store local` run on n0 (ranks 0, 1) and n1 (rank 2),
    joined by one worker on n1 and one on n2. The one on n1 checks and reads the shards
    placed on rank 2 (no rows are sent to it for them); the one on n2, a node without a
    shard, gets every row it trains on from rank 0, which relays what the holders send
    (shards/ moves to it with bytes). Every launch exits 0, the run ends finished with
    exact coverage, both joiners' updates/ rows count."""
    from mpilb.clusterbox import ClusterBox
    from mpilb.data.shards import placement

    log = tmp_path / "run.h5"
    train = ["train", "--data", data, "--model", "mlp", "--hidden", "64", "--batch", "32",
             "--epochs", "40", "--store", "local", "--no-progress", "--log", str(log)]
    joiners = []
    with ClusterBox(nodes=3) as box:
        run = subprocess.Popen(
            box.command(0, box.mpiexec_cmd(["-hosts", "n0:2,n1:1", sys.executable, "-m", "mpilb",
                                            *train])),
            env=box.env(mpirun.env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            mpirun.wait_training(str(log), run, timeout=120)
            for node in (1, 2):
                joiners.append(box.popen(node, [mpirun.mpiexec(), "-n", "1", sys.executable, "-m",
                                                "mpilb", "join", str(log)], env=mpirun.env(),
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
                wait_joined(log, 2 + node, timeout=120)
            ends = [j.communicate(timeout=300) for j in joiners]
            _, err = run.communicate(timeout=300)
        finally:
            for proc in (run, *joiners):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
    for j, (_, jerr) in zip(joiners, ends):
        assert j.returncode == 0, jerr
    assert run.returncode == 0, err
    attrs, cols = exact(log, data)
    assert members(cols) == [(3, "join"), (4, "join")]
    hosts = json.loads(attrs["hostnames"])
    shards = len(open_dataset(data).shard_sizes)
    on_n1 = {s for s, hs in placement(shards, [1, 2], 1, hosts).items() if 2 in hs}
    sh = cols["shards"]
    events = [e.decode() if isinstance(e, bytes) else str(e) for e in sh["event"]]
    to_3 = [(int(s), int(b)) for s, d, e, b in zip(sh["shard"], sh["dst"], events, sh["bytes"])
            if int(d) == 3 and e == "move"]
    assert not [b for s, b in to_3 if s in on_n1 and b > 0], to_3   # read from n1's disk
    assert rows_to(cols, 4) > 0   # n2 holds nothing: its rows came through rank 0
    up = cols["updates"]
    assert (up["worker"] == 3).sum() > 0 and (up["worker"] == 4).sum() > 0


def test_a_replacement_let_go_leaves_as_a_joiner_does(synth_dir, tmp_path):
    """--respawn: rank 2 of 4 workers SIGKILLed, replaced by worker 5; then `mpilb leave
    --rank 5`: the replacement's process ends within 15 s while the run goes on; members/
    holds lost 2, respawn 5, leave 5; the run ends degraded (rank 2 was lost), exit 3, every
    epoch's coverage exact. (Refused before: "a worker that joined cannot leave yet".)"""
    from test_respawn import members as member_rows
    from test_survival import assert_degraded_exact, finish as finish_job, launch, supervised_ranks
    from test_survival import train

    epochs, log = 60, tmp_path / "run.h5"
    cmd = [mpirun.mpiexec(), "-disable-auto-cleanup", "-n", "5", sys.executable, "-m", "mpilb",
           *train(synth_dir, tmp_path, "--epochs", epochs, "--worker-timeout", 3,
                  "--survive-signals", "--respawn")]
    proc = launch(cmd, tmp_path)
    try:
        pids = supervised_ranks(proc, 5)
        mpirun.wait_training(log, proc)
        os.kill(pids[2], signal.SIGKILL)
        wait_joined(log, 5, timeout=60)
        pid = replacement_pid(tmp_path)
        done = leave(log, 5)
        assert done.returncode == 0, done.stderr
        assert gone_within(pid, 15.0), "the replacement let go is still running"
        assert proc.poll() is None, "the run ended with the replacement"
    finally:
        code, out, err = finish_job(proc, timeout=240)
    assert code == 3, (code, err)
    assert [(w, e) for _, w, _, e in member_rows(log)] == [(2, "lost"), (5, "respawn"), (5, "leave")]
    assert_degraded_exact(tmp_path, synth_dir, epochs)


def replacement_pid(mark) -> int:
    """The process of the replacement rank 0 spawned for the job marked `mark`."""
    from test_survival import marked_processes

    for pid in marked_processes(b"MPILB_TEST_JOB=" + str(mark).encode()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"mpilb.run.replacement" in fh.read():
                    return pid
        except OSError:
            continue
    raise AssertionError("no replacement process")


@pytest.mark.cluster
@pytest.mark.skipif(_box_missing() is not None, reason="no cluster box here")
def test_a_joiner_on_a_spare_node_joins_two_stores_on_two_nodes_and_leaves(data, tmp_path):
    """The cluster in a box: `--store local --servers 2 --replicas 2` with a store on each of
    n0 and n1 (ranks 0 and 1, dealt round-robin) and a worker on each (ranks 2 and 3), joined
    by a worker on n2, a node without a shard. Both stores admit it over the network, both
    apply its pushes, every row it trains on comes through rank 0; then it leaves by `mpilb
    leave`. Its launch exits 0, the run goes on and ends finished, exit 0, exact coverage."""
    from mpilb.clusterbox import ClusterBox
    from test_membership import PACED

    log = tmp_path / "run.h5"
    train = ["train", "--data", data, "--model", "mlp", "--hidden", "64", "--batch", "32",
             "--epochs", "15", "--store", "local", "--servers", "2", "--replicas", "2", *PACED,
             "--no-progress", "--log", str(log)]
    j = None
    with ClusterBox(nodes=3) as box:
        run = subprocess.Popen(
            box.command(0, box.mpiexec_cmd(["-hosts", "n0,n1", "-n", "4", sys.executable, "-m",
                                            "mpilb", *train])),
            env=box.env(mpirun.env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            mpirun.wait_training(str(log), run, timeout=120)
            j = box.popen(2, [mpirun.mpiexec(), "-n", "1", sys.executable, "-m", "mpilb", "join",
                              str(log)], env=mpirun.env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
            wait_joined(log, 4, timeout=120)
            time.sleep(1.0)
            done = leave(log, 4)
            assert done.returncode == 0, done.stderr
            _, jerr = j.communicate(timeout=120)
            assert run.poll() is None, "the run ended with the joiner"
            _, err = run.communicate(timeout=300)
        finally:
            for proc in (run, *([j] if j is not None else [])):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
    assert j.returncode == 0 and "mpilb: joined as worker 4" in jerr, jerr
    assert run.returncode == 0, err
    attrs, cols = exact(log, data)
    hosts = json.loads(attrs["hostnames"])
    assert hosts[:4] == ["n0", "n1", "n0", "n1"], hosts
    assert members(cols) == [(4, "join"), (4, "leave")]
    assert rows_to(cols, 4) > 0   # n2 holds nothing: its rows came through rank 0
    up = cols["updates"]
    assert (up["worker"] == 4).sum() > 0
    stores = attrs["summary"]["servers"]   # each store applied every update, the joiner's too
    assert [s["rank"] for s in stores] == [0, 1], stores
    assert all(s["updates"] == len(up["worker"]) for s in stores), (stores, len(up["worker"]))
    assert attrs["summary"]["lost_workers"] == []
