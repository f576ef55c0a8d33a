"""The simulator drives the balancers like the server does (pure, no MPI)."""

from collections import Counter

import pytest

from mpilb.balancer import BALANCERS, BalancerConfig
from mpilb.simulate import simulate

CONFIG = BalancerConfig(batch=10, rebalance_interval=2.0)
ONE_SLOW = [lambda t: 100.0, lambda t: 100.0, lambda t: 25.0]
RAMP = [lambda t: 100.0, lambda t: 100.0, lambda t: max(5.0, 100.0 - 6.0 * t)]


def test_load_beats_static_with_one_slow_worker():
    static = simulate("static", ONE_SLOW, [100] * 48, epochs=1, config=CONFIG)
    load = simulate("load", ONE_SLOW, [100] * 48, epochs=1, config=CONFIG)
    assert static.epoch_s[0] == pytest.approx(64.0)      # 16 shards at 25 samples/s
    assert load.epoch_s[0] < 0.6 * static.epoch_s[0]
    assert load.utilization[0] > 0.9 > static.utilization[0]
    assert any(m.reason == "rebalance" for m in load.moves)
    assert static.moves == []


def test_predictive_beats_load_on_a_steady_slowdown():
    # With 48 shards of 100 samples, load commits the ramping worker to a shard it then
    # does at its floor rate; the forecast sees that coming.
    load = simulate("load", RAMP, [100] * 48, epochs=1, config=CONFIG)
    predictive = simulate("predictive", RAMP, [100] * 48, epochs=1, config=CONFIG)
    assert predictive.epoch_s[0] < 0.9 * load.epoch_s[0]


def test_lazy_hand_out_ends_the_epoch_sooner():
    # The ramping worker is not given a prefetch shard near the epoch end that a steady
    # worker would finish sooner, so load does better than demand on 96 small shards.
    demand = simulate("demand", RAMP, [50] * 96, epochs=1, config=CONFIG)
    load = simulate("load", RAMP, [50] * 96, epochs=1, config=CONFIG)
    assert load.epoch_s[0] < 0.8 * demand.epoch_s[0]


@pytest.mark.parametrize("name", sorted(BALANCERS))
def test_every_shard_processed_once_per_epoch(name):
    sizes = [30 + 7 * k for k in range(20)]
    res = simulate(name, ONE_SLOW, sizes, epochs=2, config=CONFIG, noise=0.2, seed=3)
    for processed in res.processed:
        assert processed == Counter(range(len(sizes)))
    assert len(res.epoch_s) == 2 and all(0 < u <= 1.0 for u in res.utilization)
    assert sum(res.busy_s.values()) == pytest.approx(
        sum(u * 3 * e for u, e in zip(res.utilization, res.epoch_s)))


@pytest.mark.parametrize("name", sorted(BALANCERS))
def test_lost_worker_shards_reassigned(name):
    res = simulate(name, ONE_SLOW, [100] * 24, epochs=2, config=CONFIG, lost={2: 5.0})
    for processed in res.processed:
        assert set(processed) == set(range(24))
        assert sum(processed.values()) == 24         # the lost worker's done shards count once
    if name != "demand":
        assert any(m.reason == "lost" and m.src == 2 for m in res.moves)
