"""Shard stores and moves: placement, the feed's task ranges, and exact coverage end to end
with shared and node-local stores, replicas, part-way moves and random slowdowns."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mpirun
from mpilb.backend import select_backend
from mpilb.core.batches import ShardFeed
from mpilb.data.dataset import open_dataset
from mpilb.runfiles.summary import summarize_log
from mpilb.data.shards import ShardReader, holders_of, placement


def test_placement_spreads_copies():
    p = placement(10, [1, 2, 3], replicas=2)
    assert all(len(set(h)) == 2 for h in p.values())
    counts = np.bincount([r for h in p.values() for r in h], minlength=4)[1:]
    assert counts.max() - counts.min() <= 1
    assert placement(4, [1, 2], replicas=5)[0] == [1, 2]   # at most one copy per rank


def test_placement_puts_a_shards_copies_on_different_nodes():
    """--replicas 2 on several nodes: no shard has both copies on one node (it used to put
    them on adjacent ranks, usually one node, so losing that node lost shards)."""
    hosts = ["n0", "n1", "n1", "n2", "n2", "n3", "n3"]   # rank 0 on n0; workers 1-6
    workers = [1, 2, 3, 4, 5, 6]
    p = placement(24, workers, replicas=2, hosts=hosts)
    for copies in p.values():
        assert len(copies) == 2 and len({hosts[r] for r in copies}) == 2, copies
    counts = np.bincount([r for h in p.values() for r in h], minlength=7)[1:]
    assert counts.max() - counts.min() <= 1                      # still balanced
    # losing any one node's ranks leaves a copy of every shard
    for node in ("n1", "n2", "n3"):
        gone = {r for r in workers if hosts[r] == node}
        assert all(set(c) - gone for c in p.values()), node
    # three copies on three nodes
    p3 = placement(12, workers, replicas=3, hosts=hosts)
    assert all(len({hosts[r] for r in c}) == 3 for c in p3.values())
    # unequal nodes: the copies still differ in node, the lone rank of n2 holds more
    uneven = placement(6, [1, 2, 3], replicas=2, hosts=["n0", "n1", "n1", "n2"])
    assert all({hosts_ for hosts_ in ("n1", "n2")} == {["n0", "n1", "n1", "n2"][r] for r in c}
               for c in uneven.values())
    # one node (or no hostnames): the old map, adjacent ranks
    assert placement(10, [1, 2, 3], 2, ["a"] * 4) == placement(10, [1, 2, 3], 2) == {
        s: [[1, 2, 3][s % 3], [1, 2, 3][(s + 1) % 3]] for s in range(10)}


def test_workers_and_rank_0_agree_on_a_placement_by_node():
    """Each worker computes what it holds from the same hostnames rank 0 places with."""
    from mpilb.worker.row_exchange import held_shards

    hosts = ["n0", "n0", "n1", "n1", "n2"]
    p = placement(9, [1, 2, 3, 4], 2, hosts)
    for r in (1, 2, 3, 4):
        assert held_shards(9, r, [1, 2, 3, 4], replicas=2, hosts=hosts) == {
            s for s, c in p.items() if r in c}
    assert all(holders_of(s, 9, [1, 2, 3, 4], 2, hosts) == p[s] for s in range(9))


class Rows:
    """A remote task's rows, as RemoteRows delivers them."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def wait(self):
        return self.x, self.y, 0.0


def test_feed_ranges_truncation_and_remote_rows(small_dataset):
    reader = ShardReader(small_dataset, seed=3)
    feed = ShardFeed(reader, select_backend("cpu"))
    full, _ = reader.get(0, 1)
    feed.assign(0, 1, 100, 300)
    feed.assign(0, 2, 0, 50)
    b = feed.take(64)
    assert (b.lo, b.hi) == (100, 164)
    np.testing.assert_array_equal(b.x, full.x[100:164])
    feed.truncate(0, 1, 200)             # the rest of shard 1 went to another worker
    feed.truncate(0, 2, 0)               # and all of the queued shard 2
    b = feed.take(64)
    assert (b.lo, b.hi) == (164, 200)
    assert feed.take(64) is None
    with pytest.raises(RuntimeError):
        feed.assign(0, 3, 0, 100)
        feed.take(80)
        feed.truncate(0, 3, 40)          # past the cut already: a protocol violation
    # rows sent to another rank are the permuted rows of those positions
    x, y = feed.rows(0, 1, 10, 20)
    np.testing.assert_array_equal(x, full.x[10:20])
    feed2 = ShardFeed(reader, select_backend("cpu"))
    feed2.assign(0, 1, 10, 20, remote=Rows(x, y))
    b = feed2.take(100)
    assert (b.lo, b.hi) == (10, 20)
    np.testing.assert_array_equal(b.y, full.y[10:20])
    reader.close()


def test_rows_read_for_another_rank_count_as_this_ranks_io(small_dataset):
    """A holder's reads for others are its I/O: a slow reader whose own reads the prefetch
    hid looked fast to rank 0, which then picked it to send every shard's rows, and its
    receivers waited 2-3 s an epoch (`--reader local --replicas 2 --inject 2:readbw=10`)."""
    reader = ShardReader(small_dataset, seed=3, io_delay=lambda nbytes, elapsed: 0.05)
    feed = ShardFeed(reader, select_backend("cpu"))
    feed.rows(0, 2, 0, 10)                 # not this rank's current shard: read now
    assert feed.io_s >= 0.05
    reader.close()


def test_a_cut_stops_the_task_that_holds_its_position(small_dataset):
    """Two tasks of one shard (two gaps of a requeued shard): a cut meant for the queued
    lower range neither stops the current upper one (which is past it) nor wipes another
    queued range of the shard."""
    reader = ShardReader(small_dataset, seed=3)
    feed = ShardFeed(reader, select_backend("cpu"))
    feed.assign(0, 1, 600, 700)
    feed.assign(0, 1, 0, 100)
    feed.assign(0, 1, 300, 400)
    b = feed.take(30)
    assert (b.lo, b.hi) == (600, 630)
    feed.truncate(0, 1, 46)          # the tail of [0, 100) went to another worker
    got = []
    while (b := feed.take(30)) is not None:
        got.append((b.lo, b.hi))
    assert got == [(630, 660), (660, 690), (690, 700), (0, 30), (30, 46),
                   (300, 330), (330, 360), (360, 390), (390, 400)]
    reader.close()


def run_summary(tmp_path, data, *args, n=4):
    log = tmp_path / "run.h5"
    res = mpirun.run(n, "train", "--data", data, "--model", "mlp", "--hidden", "32",
                     "--batch", "32", "--no-progress", "--log", log, *args, timeout=120)
    assert res.returncode == 0, res.stderr
    return summarize_log(str(log))


def assert_exact(s):
    cov = s["coverage"]
    assert cov["applied"] == cov["expected"] > 0 and cov["duplicates"] == 0 and cov["missing"] == 0, cov


@pytest.mark.mpi
def test_local_store_moves_bytes_for_a_slow_rank(synth_dir, tmp_path):
    s = run_summary(tmp_path, synth_dir, "--store", "local", "--epochs", "3",
                    "--inject", "3:compute=4")
    assert_exact(s)
    ds = open_dataset(synth_dir)
    dataset_bytes = sum(ds.shard_nbytes(i) for i in range(len(ds.shards)))
    assert 0 < s["bytes_moved"] <= dataset_bytes * 3
    samples = {w["rank"]: w["samples"] for w in s["per_worker"]}
    assert samples[3] < min(samples[1], samples[2])


@pytest.mark.mpi
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_exactly_once_whatever_moves(synth_dir, tmp_path_factory, data):
    """Random stores, replicas, policies, modes and slowdowns: every sample exactly once."""
    store = data.draw(st.sampled_from(["shared", "local"]), label="store")
    args = ["--store", store, "--epochs", "2",
            "--balancer", data.draw(st.sampled_from(["demand", "load", "predictive"]), label="balancer"),
            "--mode", data.draw(st.sampled_from(["async", "ssp", "sync"]), label="mode")]
    if store == "local":
        args += ["--replicas", str(data.draw(st.integers(1, 3), label="replicas"))]
    if "sync" not in args and data.draw(st.booleans(), label="pipeline"):
        args += ["--pipeline", "1"]
    for rank in data.draw(st.sets(st.integers(1, 3), max_size=2), label="slow ranks"):
        factor = data.draw(st.sampled_from([2, 4, 8]), label="factor")
        start = data.draw(st.sampled_from(["", "@0.3", "@0.1-0.6"]), label="window")
        prob = data.draw(st.sampled_from(["", ",p=0.3"]), label="p")
        args += ["--inject", f"{rank}:compute={factor}{start}{prob}"]
    if data.draw(st.booleans(), label="batch policy"):
        args += ["--batch-policy", "proportional"]
    s = run_summary(tmp_path_factory.mktemp("run"), synth_dir, *args)
    assert s["epochs_completed"] == 2
    assert_exact(s)
