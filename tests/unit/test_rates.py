"""Rate estimators on synthetic traces, with the stated error bounds (pure, no MPI)."""

import numpy as np
import pytest

from mpilb.core.rates import EwmaRate, TrendRate


def _settled(rate=100.0, reports=30):
    est = EwmaRate()
    for _ in range(reports):
        est.update(rate, 1.0)
    return est


@pytest.mark.parametrize("factor", [2.0, 0.5, 4.0, 0.25])
def test_step_change_tracked_within_10_percent_after_3_reports(factor):
    est = _settled()
    errors = []
    for _ in range(3):
        est.update(100.0 * factor, 1.0)
        errors.append(abs(est.value / (100.0 * factor) - 1.0))
    assert errors[-1] < 0.10          # N = 3 reports for a 2x or 4x step
    assert errors[0] > 0.10           # and not instantly: one report is not a step


def test_small_step_tracked_by_the_ewma_within_8_reports():
    est = _settled()
    for _ in range(8):                # 1.25x stays under the shift detector; (0.9)^n decay
        est.update(125.0, 1.0)
    assert abs(est.value / 125.0 - 1.0) < 0.10


@pytest.mark.parametrize("seed", range(5))
def test_noise_within_10_percent(seed):
    rng = np.random.default_rng(seed)
    est = EwmaRate()
    errors = []
    for k in range(500):
        est.update(100.0 * rng.uniform(0.8, 1.2), 1.0)     # +-20% multiplicative
        if k >= 20:
            errors.append(abs(est.value / 100.0 - 1.0))
    assert max(errors) < 0.10
    assert np.mean(errors) < 0.04


@pytest.mark.parametrize("spike", [50.0, 1 / 50.0])
def test_single_outlier_moves_estimate_less_than_20_percent(spike):
    est = _settled()
    est.update(100.0 * spike, 1.0)
    assert abs(est.value / 100.0 - 1.0) < 0.20
    est.update(100.0, 1.0)
    assert abs(est.value / 100.0 - 1.0) < 0.20


def test_empty_reports_are_ignored():
    est = EwmaRate()
    assert est.update(0, 1.0) is None and est.update(10, 0.0) is None
    assert est.update(10, 1.0) == 10.0


def test_ramp_forecast_beats_ewma_lag():
    # The rate falls by 2 samples/s per second; reports of 10 samples each.
    trend, t = TrendRate(), 0.0
    ewma_err, forecast_err = [], []
    horizon = 2.0
    for k in range(150):
        rate = 100.0 - 2.0 * t
        busy = 10.0 / rate
        t += busy
        trend.update(t, 10.0, busy)
        if k >= 20:
            truth = 100.0 - 2.0 * (t + horizon / 2.0)     # mean rate over the next interval
            ewma_err.append(abs(trend.value - truth) / truth)
            forecast_err.append(abs(trend.forecast(t, horizon) - truth) / truth)
    assert np.mean(forecast_err) < 0.5 * np.mean(ewma_err)
    assert np.mean(forecast_err) < 0.05
    assert trend.slope() == pytest.approx(-2.0, rel=0.1)


def test_forecast_clamped_and_flat_without_trend():
    trend = TrendRate()
    assert trend.forecast(0.0, 2.0) is None
    for k in range(20):
        trend.update(float(k), 100.0, 1.0)
    assert trend.forecast(20.0, 2.0) == pytest.approx(100.0)
    assert trend.forecast(1e6, 1e6) == pytest.approx(100.0)
    steep = TrendRate()
    for k in range(20):
        steep.update(float(k), max(1.0, 100.0 - 20.0 * k), 1.0)
    assert steep.forecast(100.0, 100.0) >= 0.05 * steep.value > 0


def test_time_for_integrates_a_falling_rate():
    trend = TrendRate()
    for _ in range(3):
        trend.update(0.0, 100.0, 1.0)
    assert trend.time_for(200.0, 0.0) == pytest.approx(2.0)       # flat: samples / rate
    falling, t = TrendRate(), 0.0
    for _ in range(60):
        rate = 100.0 - 2.0 * t
        t += 10.0 / rate
        falling.update(t, 10.0, 10.0 / rate)
    assert falling.time_for(500.0, t) > 500.0 / falling.value


def test_state_round_trip():
    import json
    trend = TrendRate()
    for k in range(12):
        trend.update(float(k), 100.0 - k, 1.0)
    copy = TrendRate()
    copy.load_state_dict(json.loads(json.dumps(trend.state_dict())))
    assert copy.forecast(12.0, 2.0) == trend.forecast(12.0, 2.0)
    trend.update(12.0, 50.0, 1.0)
    copy.update(12.0, 50.0, 1.0)
    assert copy.value == trend.value


def test_buckets_remove_the_bias_of_heavy_tailed_steps():
    # A fast worker on a shared node: 70% of 1 ms steps run clean, 30% are preempted and
    # take 4 ms. What it gets done is samples / seconds (ratio of sums); the mean of
    # per-step rates is biased high by the clean steps.
    rng = np.random.default_rng(0)
    busy = np.where(rng.random(4000) < 0.3, 4e-3, 1e-3)
    truth = 100 * busy.size / busy.sum()
    per_report, bucketed = EwmaRate(0.1), EwmaRate(0.1, bucket_s=0.05)
    for b in busy:
        per_report.update(100, b)
        bucketed.update(100, b)
    assert abs(bucketed.value / truth - 1.0) < 0.05
    assert per_report.value / truth - 1.0 > 0.15


def test_bucket_waits_for_enough_busy_time():
    est = EwmaRate(0.1, bucket_s=0.05)
    for _ in range(4):
        assert est.update(10, 0.01) is None and not est.closed
    assert est.update(10, 0.01) == pytest.approx(1000.0) and est.closed


def test_overhead_from_report_times_ignores_idle_gaps():
    # 1 ms of compute per 100 samples, a report every 3 ms: 2 ms of overhead per step.
    trend, t = TrendRate(bucket_s=0.01), 0.0
    for k in range(400):
        t += 0.5 if k == 200 else 3e-3         # one idle wait (an epoch end) of half a second
        trend.update(t, 100, 1e-3)
    assert trend.value == pytest.approx(1e5)
    assert trend.overhead == pytest.approx(2e-5, rel=0.1)
    measured = TrendRate()
    for k in range(20):
        measured.update(float(k), 100, 1e-3, comm_s=5e-3)
    assert measured.overhead == pytest.approx(5e-5)


def _run_rounds(bal, cost, over, rounds=250, t=0.0):
    """Feed `rounds` reports per worker at its current batch: busy = a + c*b, and the step
    seen by the server = busy + over (transfers). Returns the time reached."""
    sizes = bal.batch_sizes()
    for _ in range(rounds):
        for w, (a, c) in cost.items():
            b = sizes[w]
            if b == 0:
                continue
            busy = a + c * b
            t += busy + over[w]
            bal.observe(w, t, b, busy, step_s=busy + over[w])
    return t


def _steps(cost, over, sizes):
    return {w: cost[w][0] + cost[w][1] * sizes[w] + over[w] for w in sizes if sizes[w] > 0}


def test_proportional_batches_converge_to_equal_step_times_with_fixed_costs():
    from mpilb.core.balancer import BalancerConfig, build_balancer

    bal = build_balancer("load", [1, 2, 3], [100] * 12,
                         BalancerConfig(batch=128, batch_policy="proportional"))
    cost = {1: (0.0002, 6e-6), 2: (0.0002, 6e-6), 3: (0.0008, 24e-6)}   # rank 3: 4x slower
    over = {1: 3e-4, 2: 3e-4, 3: 3e-4}
    t = 0.0
    for _ in range(8):   # successive rebalances
        t = _run_rounds(bal, cost, over, t=t)
    sizes = bal.batch_sizes()
    assert sum(sizes.values()) == 3 * 128
    steps = _steps(cost, over, sizes)
    assert max(steps.values()) / min(steps.values()) < 1.1, (sizes, steps)
    assert sizes[3] < sizes[1] / 3   # the fixed costs push it below the 1:4 rate split
    a, c = bal.step_model(1)
    assert a == pytest.approx(3e-4, rel=0.05)
    assert 1.0 / c == pytest.approx(sizes[1] / (0.0002 + 6e-6 * sizes[1]), rel=0.25)


def test_sit_out_gives_zero_to_a_worker_whose_overhead_outlasts_the_round():
    from mpilb.core.balancer import BalancerConfig, build_balancer

    cost = {1: (0.0002, 6e-6), 2: (0.0002, 6e-6), 3: (0.0002, 6e-6)}
    over = {1: 2e-4, 2: 2e-4, 3: 5e-3}   # rank 3 waits 5 ms per step for its transfers
    for sit_out, expect_zero in ((True, True), (False, False)):
        bal = build_balancer("load", [1, 2, 3], [100] * 12,
                             BalancerConfig(batch=128, batch_policy="proportional", sit_out=sit_out))
        t = 0.0
        for _ in range(6):
            t = _run_rounds(bal, cost, over, t=t)
        sizes = bal.batch_sizes()
        assert (sizes[3] == 0) == expect_zero, sizes
        assert sum(sizes.values()) == 3 * 128
        if expect_zero:
            assert bal.round_step < over[3]
