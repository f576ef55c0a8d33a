"""Balancing quality: re-sourcing rows a lost holder owed, fast first rates, probes of silent
readers, the shard cache (pure units first, then a few short runs under mpiexec)."""

from __future__ import annotations

import pytest

import mpirun
from mpilb.core.balancer import BalancerConfig, build_balancer
from mpilb.runfiles.summary import summarize_log
from mpilb.core.tasks import TaskLedger
from mpilb.data.shards import holders_of, placement
from mpilb.mpi.wire import RESOURCE_TAG_BASE, OrderMsg, resource_tag


def ledger_for(sizes, ranks=(1, 2, 3), policy="load", holders=None, **kw):
    bal = build_balancer(policy, list(ranks), sizes, BalancerConfig(batch=32), holders)
    bal.plan_epoch(0, list(range(len(sizes))))
    return TaskLedger(bal, sizes, ranks, holders=holders, **kw), bal


# ---------------------------------------------------------------- replicas
def test_resource_tags_have_their_own_range_below_the_mpi_minimum_bound():
    tags = {resource_tag(1000 + 2 * n) for n in range(10000)}
    assert min(tags) == RESOURCE_TAG_BASE and max(tags) + 1 <= 32767
    assert all(t % 2 == 0 for t in tags)            # t and t + 1 (samples, labels)
    assert resource_tag(resource_tag(1000)) == resource_tag(1000)
    p = placement(7, [1, 2, 3], replicas=2)
    assert all(holders_of(s, 7, [1, 2, 3], 2) == p[s] for s in range(7))


def test_rows_a_lost_holder_owed_are_ordered_from_another_copy():
    holders = {0: [1, 2], 1: [2, 3]}
    ledger, _ = ledger_for([100, 100], holders=holders, row_nbytes=8)
    ledger.assign(3, 0, 0, 100, source=1)       # rank 3 holds no copy: rank 1 sends
    (first,) = ledger.take_orders(1)
    ledger.gone.add(1)                            # rank 1 lost before the rows arrived
    ((receiver, task),) = ledger.resource(1)
    assert receiver == 3 and task.src == 2 and task.tag == resource_tag(first.tag)
    assert ledger.take_orders(2) == [OrderMsg(0, 0, 0, 100, 3, resource_tag(first.tag))]
    assert 2 in ledger.take_ordered()
    assert ledger.expects_rows_from(1) == []
    # a holder that is lost too leaves no copy: a clear error, not a hang
    ledger.gone.add(2)
    with pytest.raises(RuntimeError, match="no other live rank holds a copy"):
        ledger.resource(2)


def test_a_holder_reads_its_own_copy_of_a_tail_it_takes_over():
    holders = {0: [1, 2], 1: [2, 3]}
    ledger, _ = ledger_for([100, 100], holders=holders)
    ledger.assign(2, 0, 50, 100, source=1, event="move")
    assert ledger.tasks(2)[-1].src == -1 and not ledger.has_orders(1)


def test_no_part_way_move_from_a_donor_whose_rows_are_in_flight():
    holders = {0: [1], 1: [2], 2: [3]}
    ledger, bal = ledger_for([400, 400, 400], holders=holders, row_nbytes=8)
    for r in (1, 2, 3):
        ledger.of[r].tasks.clear()
    ledger.assign(2, 0, 0, 400)                   # rows of shard 0 on their way to rank 2
    ledger.of[2].batch_sent = 32
    assert ledger.split_for(3, 32) is None
    ledger.advance(2, 32)                         # they arrived: it started
    assert ledger.split_for(3, 32) is not None


@pytest.mark.mpi
@pytest.mark.parametrize("pipeline", ["0", "1"])
def test_local_store_replicas_survive_a_lost_holder(synth_dir, tmp_path, pipeline):
    """--store local --replicas 2 and a rank hung mid-epoch: exit 3, degraded, every sample
    exactly once (rows the lost rank owed come from the other copy); also pipelined, where
    a worker blocked for rows must serve the send orders behind its reply (see
    test_worker_parts: quality.py's case (d) pipelined lost its slow reader in 3 of 4 runs)."""
    log = tmp_path / "run.h5"
    res = mpirun.run(4, "train", "--data", synth_dir, "--model", "mlp", "--hidden", "32",
                     "--batch", "32", "--epochs", "4", "--store", "local", "--replicas", "2",
                     # hung 0.3 s in: on a quiet machine the whole run takes about 1 s
                     "--inject", "2:hang@0.3", "--inject", "1:readbw=2", "--worker-timeout", "3",
                     "--pipeline", pipeline, "--no-progress", "--log", log, timeout=120)
    assert res.returncode == 3, res.stderr
    s = summarize_log(str(log))
    assert s["status"] == "degraded" and s["lost_workers"] == [2] and s["epochs_completed"] == 4
    cov = s["coverage"]
    assert cov["applied"] == cov["expected"] > 0 and cov["duplicates"] == 0 and cov["missing"] == 0, cov


# ---------------------------------------------------------------- rates learnt fast
def test_first_buckets_are_averaged_evenly():
    from mpilb.core.rates import EwmaRate

    est = EwmaRate(alpha=0.1, bucket_s=0.05)
    est.update(50, 0.05)                 # a cold first step: 1000/s
    for _ in range(4):
        est.update(60, 0.05)             # then 1200/s (within the level-shift factor)
    # near the mean of the five (guarded) buckets; 4 alpha steps would leave it at 1054
    assert 1100 <= est.value <= 1160
    for _ in range(40):
        est.update(60, 0.05)
    assert est.value == pytest.approx(1200.0, rel=0.01)


def test_a_stale_estimate_is_replaced_by_the_next_bucket():
    from mpilb.core.rates import EwmaRate

    est = EwmaRate(alpha=0.1, bucket_s=0.05)
    for _ in range(30):
        est.update(5, 0.05)              # a slow reader: 100/s
    est.mark_stale()
    assert est.value == pytest.approx(100.0)    # kept until the probe reports
    est.update(200, 0.05)                # it reads fast again: 4000/s
    assert est.value == pytest.approx(4000.0)


# ---------------------------------------------------------------- probes, readmission
def test_a_silent_worker_gets_a_probe_shard_once_per_interval():
    bal = build_balancer("load", [1, 2, 3], [100] * 12, BalancerConfig(batch=32, rebalance_interval=2.0))
    for t in (0.1, 0.2, 0.3):
        bal.observe(1, t, 100, 0.05)
        bal.observe(3, t, 100, 0.05)
        bal.observe(2, t, 1, 1.0)        # rank 2: 2000 times slower
    bal.plan_epoch(0, list(range(12)))
    assert bal.queued(2) == []           # too slow for even one shard: it falls silent
    moves = bal.rebalance(1.0, {1: 100, 2: 0, 3: 100})
    probes = [m for m in moves if m.reason == "probe"]
    assert [(m.dst, len(bal.queued(2))) for m in probes] == [(2, 1)]
    assert bal.next_shard(2) == probes[0].shard        # an idle worker takes it at once
    assert not [m for m in bal.rebalance(2.0, {1: 100, 2: 100, 3: 100}) if m.reason == "probe"]
    bal.observe(2, 2.5, 100, 0.05)      # the probe: it is fast now
    assert bal.rate(2) == pytest.approx(2000.0)


def _slow_reader(interval=2.0, busy_s=0.34, comm_s=0.001):
    """Ranks 1 and 3 at 200,000 samples/s; rank 2 a slow reader whose every report carries
    a whole 1,600-sample shard's read (0.33 s at 5 MB/s) in its first batch: too slow for
    even one shard of the next plan. (`busy_s`, `comm_s`: rank 2's reports of 128 samples
    otherwise.)"""
    bal = build_balancer("load", [1, 2, 3], [1600] * 48,
                         BalancerConfig(batch=128, rebalance_interval=interval))
    for k in range(5):
        t = 0.1 * (k + 1)
        for w in (1, 3):
            bal.observe(w, t, 12800, 0.064, comm_s=0.03)
        bal.observe(2, t, 128, busy_s, comm_s=comm_s)
    bal.plan_epoch(1, list(range(48)))
    assert bal.queued(2) == []
    return bal


def _run_probe(bal, t, read_s=0.018, step_s=0.0007):
    """Rank 2 takes its probe shard and does it at full speed, batch by batch: 1,600
    samples in 0.027 s of compute and I/O, less than one 50 ms rate bucket."""
    shard = bal.next_shard(2)
    assert shard is not None
    for k, lo in enumerate(range(0, 1600, 128)):
        n = min(128, 1600 - lo)
        t += 0.001
        bal.observe(2, t, n, step_s * n / 128 + (read_s if k == 0 else 0.0), comm_s=0.0003)
    return t


def test_a_probe_shorter_than_a_rate_bucket_still_brings_the_worker_back():
    """The slow-reader miss of issue 17: a probe done at full speed took 27 ms of busy time,
    its 50 ms bucket never closed, and the stale slow estimate stayed: no more shards, no
    more reports, the rate never recovered. The probe's last report now closes its bucket."""
    bal = _slow_reader()
    assert bal.rate(2) < 400
    moves = bal.rebalance(4.0, {1: 16000, 2: 0, 3: 16000})     # reads are fast again by now
    assert [m.dst for m in moves if m.reason == "probe"] == [2]
    _run_probe(bal, 4.0)
    busy = 0.018 + 0.0007 * 1600 / 128
    assert bal.rate(2) == pytest.approx(1600 / busy)             # ~59,000/s, what it measured
    assert bal.next_shard(2) is not None                         # it gets work again at once
    plan = bal.plan_epoch(2, list(range(48)))
    assert len(plan[2]) >= 3                                     # and its share of the next plan


def test_a_silent_worker_is_probed_at_every_rebalance_despite_clock_jitter():
    bal = _slow_reader()
    assert [m.dst for m in bal.rebalance(1.0, {1: 1600, 2: 0, 3: 1600}) if m.reason == "probe"] == [2]
    bal.next_shard(2)
    bal.observe(2, 1.4, 1600, 0.36, comm_s=0.001)               # still slow: silent again
    # the next rebalance, a hair under one interval later by the balancer's clock
    assert [m.dst for m in bal.rebalance(2.9995, {1: 1600, 2: 0, 3: 1600})
            if m.reason == "probe"] == [2]


def _probe_times(bal, until, report, interval=2.0):
    """Rebalance every `interval` s from 1 s until `until`; rank 2 does each probe as
    `report` (samples, busy_s, comm_s) says, still too slow for a shard. When it was probed."""
    probed, t = [], 1.0
    while t < until:
        if [m for m in bal.rebalance(t, {1: 1600, 2: 0, 3: 1600}) if m.reason == "probe"]:
            probed.append(t)
            bal.next_shard(2)
            samples, busy_s, comm_s = report
            bal.observe(2, t + 0.4, samples, busy_s, comm_s=comm_s)
            assert not bal.queued(2)
        t += interval
    return probed


def test_a_worker_behind_a_slow_link_is_probed_every_few_intervals():
    """Cluster case (f): rank 2's time goes to its link (a 1,600-sample shard: 12 ms of
    compute, 3.7 s of transfers), and each probe shard held an epoch's end up; it is probed
    once per COMM_PROBE_SPACING intervals, the first of them counted from its last report
    (0.5 s: its estimate is that old), not at the first rebalance. A slow reader (issue 17)
    still is at every one."""
    from mpilb.core.balancer.policies import COMM_PROBE_SPACING

    bal = _slow_reader(busy_s=0.001, comm_s=0.3)   # behind a slow link instead
    assert COMM_PROBE_SPACING == 4
    assert _probe_times(bal, 20.0, (1600, 0.0125, 3.7)) == [9.0, 17.0]
    assert _probe_times(_slow_reader(), 8.0, (1600, 0.36, 0.001)) == [1.0, 3.0, 5.0, 7.0]


def test_a_probe_that_found_every_queue_empty_is_made_at_the_next_epoch_start():
    bal = _slow_reader()
    for w in (1, 3):                                             # the epoch's end: all handed out
        while bal.queued(w):
            bal.next_shard(w)
    assert not [m for m in bal.rebalance(4.0, {1: 3200, 2: 0, 3: 3200}) if m.reason == "probe"]
    bal.observe(1, 4.1, 128, 0.00064, comm_s=0.0003)
    bal.plan_epoch(2, list(range(48)))
    probes = [m for m in bal.take_moves() if m.reason == "probe"]
    assert [m.dst for m in probes] == [2] and bal.queued(2) == [probes[0].shard]
    _run_probe(bal, 4.2)
    assert bal.rate(2) > 10_000


def test_seed_rate_sizes_a_readmitted_worker_at_once():
    cfg = BalancerConfig(batch=64, batch_policy="proportional", min_batch=1, max_batch=512)
    bal = build_balancer("load", [1, 2], [100] * 4, cfg)
    for t in (0.1, 0.2, 0.3):
        bal.observe(1, t, 100, 0.05)
        bal.observe(2, t, 10, 0.05)
    bal.seed_rate(2, 100, 0.05)          # its probe step: as fast as rank 1 now
    assert bal.rate(2) == pytest.approx(2000.0)
    assert bal.batch_sizes() == {1: 64, 2: 64}


def test_utilization_leaves_out_seconds_on_the_bench():
    from mpilb.server.peers import Peer
    from mpilb.core.sitout import SitOut

    bal = build_balancer("load", [1, 2], [100] * 4, BalancerConfig(batch=32))
    bal.plan_epoch(0, [0, 1, 2, 3])
    ledger = TaskLedger(bal, [100] * 4, [1, 2])
    sit = SitOut(bal, ledger, 32, 1, 512, rebalance_interval=0.5)
    a, b = Peer(rank=1, batch=32), Peer(rank=2, batch=32)
    assert sit.bench(b, [a, b], now=10.0)
    assert sit.benched_s(2, 9.0, 12.0) == pytest.approx(2.0)
    sit.start_probes([a, b], now=13.0)   # back after 3 s on the bench
    assert sit.benched_s(2, 9.0, 20.0) == pytest.approx(3.0)
    assert sit.benched_s(2, 11.0, 12.0) == pytest.approx(1.0)
    assert sit.benched_s(1, 9.0, 20.0) == 0.0


# ---------------------------------------------------------------- the shard cache
def test_shard_cache_reads_each_shard_once_and_injected_reads_only_then(small_dataset):
    import numpy as np

    from mpilb.data.shards import ShardReader

    delays = []
    mb = sum(small_dataset.shard_nbytes(s) for s in range(len(small_dataset.shards))) / 2**20
    reader = ShardReader(small_dataset, seed=1, cache_mb=mb * 1.01,
                         io_delay=lambda nbytes, s: delays.append(nbytes) or 0.0)
    assert reader.caching
    first = reader.load(0, 1)
    again = reader.load(1, 1)             # the next epoch: another order, no storage read
    assert len(delays) == 1 and reader.loads_done == 2
    assert sorted(first.y.tolist()) == sorted(again.y.tolist())
    assert not np.array_equal(first.y, again.y)
    x, _ = reader.read(1, 0, 10)          # a part of a shard is read from storage as before
    assert len(delays) == 2 and len(x) == 10
    reader.close()
    # the shards this rank may read do not all fit: nothing is kept
    small = ShardReader(small_dataset, seed=1, cache_mb=mb / 2,
                        io_delay=lambda nbytes, s: delays.append(nbytes) or 0.0)
    assert not small.caching
    small.load(0, 1)
    small.load(1, 1)
    assert len(delays) == 4
    # ... unless only a few are this rank's (a node-local store's copies)
    assert ShardReader(small_dataset, cache_mb=mb / 2, shards=[0]).caching


def test_first_rebalance_comes_with_the_first_rates_then_at_doubling_gaps():
    from mpilb.core.decisions import RebalanceTimer
    from mpilb.server.peers import Peer, Waiting

    bal = build_balancer("load", [1, 2], [100] * 4, BalancerConfig(batch=32))
    peers = [Peer(rank=1, waiting=Waiting.COMPUTING), Peer(rank=2, waiting=Waiting.COMPUTING)]
    timer = RebalanceTimer(2.0, proportional=False, start=0.0)
    assert not timer.warmup_due(0.1, peers, bal.rate_known)    # no rates yet: nothing to plan on
    bal.observe(1, 0.1, 100, 0.05)
    assert not timer.warmup_due(0.15, peers, bal.rate_known)   # one worker is not all of them
    bal.observe(2, 0.2, 50, 0.05)
    due = []
    for k in range(1, 400):
        mono = 0.2 + 0.01 * k
        if timer.warmup_due(mono, peers, bal.rate_known):
            due.append(round(mono, 2))
            timer.done(mono)
    assert due[0] == 0.21                          # as soon as every busy worker has a rate
    gaps = [b - a for a, b in zip(due, due[1:])]
    assert gaps == pytest.approx([0.25, 0.5, 1.0], abs=0.011)   # then every --rebalance-interval
