"""The momentum staleness policy (`--correction momentum`) without MPI: the staleness meter,
the momentum it leaves the optimizer, and the old behaviour under `--correction none`."""

import numpy as np
import pytest

from mpilb.core.corrections import (LOOKAHEAD_WARMUP, MOMENTUM_RULES, StalenessMeter,
                                    build_correction, dynamic_momentum, explicit_momentum,
                                    implicit_momentum, lookahead_momentum)
from mpilb.core.optimizers import build_optimizer
from mpilb.server.modes import ParamRing, Update, build_rule
from mpilb.server.peers import Peer


def test_the_meter_is_the_plain_mean_then_a_moving_average():
    m = StalenessMeter(alpha=0.25)
    assert [m.add(s) for s in (2, 4, 6)] == [2, 3, 4]   # mean while 1/count > alpha
    assert m.add(4) == 4
    assert m.add(8) == pytest.approx(4 + 0.25 * 4)


def test_implicit_and_explicit_momentum():
    assert implicit_momentum(0) == 0 and implicit_momentum(3) == pytest.approx(0.75)
    assert explicit_momentum(0.9, 0) == pytest.approx(0.9)       # no staleness: the recipe's
    assert explicit_momentum(0.9, 1) == pytest.approx(0.4)       # 0.9 - (1 - 1/2)
    assert explicit_momentum(0.9, 3) == pytest.approx(0.15)
    assert explicit_momentum(0.9, 7) == pytest.approx(0.025)
    assert explicit_momentum(0.9, 30) == 0.0                     # never below 0
    # decreasing in the staleness
    values = [explicit_momentum(0.9, t) for t in np.linspace(0, 30, 61)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_dynamic_momentum_divides_the_long_run_step_by_tau_plus_one():
    assert dynamic_momentum(0.9, 0) == pytest.approx(0.9)        # no staleness: the recipe's
    assert dynamic_momentum(0.9, 3) == pytest.approx(0.6)        # 1 - 0.1 * 4
    assert dynamic_momentum(0.9, 7) == pytest.approx(0.2)
    assert dynamic_momentum(0.9, 9) == pytest.approx(0.0, abs=1e-12)
    assert dynamic_momentum(0.9, 30) == 0.0                      # never below 0
    assert dynamic_momentum(0.5, 0.5) == pytest.approx(0.25)
    for tau in (0, 0.5, 1, 2, 3, 5, 8):   # lr / (1 - mu) = the recipe's / (tau + 1)
        assert 1 / (1 - dynamic_momentum(0.9, tau)) == pytest.approx(10 / (tau + 1))
    # it keeps more momentum than `momentum` at every staleness short of 9, where both reach 0
    assert all(dynamic_momentum(0.9, t) >= explicit_momentum(0.9, t) for t in np.linspace(0, 9, 37))
    assert {k: v for k, v in MOMENTUM_RULES.items() if k not in ("gap", "dana")} == {
        "momentum": explicit_momentum, "dynamic": dynamic_momentum, "lookahead": lookahead_momentum}
    assert MOMENTUM_RULES["gap"](0.9, 7) == 0.9   # gap and dana keep the recipe's momentum
    assert MOMENTUM_RULES["dana"](0.9, 7) == 0.9


def test_lookahead_keeps_more_momentum_than_dynamic():
    assert lookahead_momentum(0.9, 0) == pytest.approx(0.9)
    assert lookahead_momentum(0.9, 3) == pytest.approx(0.69)     # 1 - 0.1 * (1 + 2.1)
    assert lookahead_momentum(0.9, 7) == pytest.approx(0.41)
    assert lookahead_momentum(0.9, 20) == 0.0                    # never below 0
    for tau in (1, 3, 7):   # the long-run step divided by 1 + 0.7 tau, not tau + 1
        assert 1 / (1 - lookahead_momentum(0.9, tau)) == pytest.approx(10 / (1 + 0.7 * tau))
        assert lookahead_momentum(0.9, tau) > dynamic_momentum(0.9, tau)


def test_lookahead_ramps_the_learning_rate_up_over_its_first_gradients():
    rule = build_rule("async", store(correction="lookahead"), lambda r: True)
    scales = [rule.push(Peer(1), Update(1, 0, 0, 0, 32, 32, 1.0, 3), np.ones(4, np.float32))[1]
              for _ in range(LOOKAHEAD_WARMUP + 5)]
    assert scales[0] == pytest.approx(1 / LOOKAHEAD_WARMUP)
    assert scales[9] == pytest.approx(10 / LOOKAHEAD_WARMUP)
    assert scales[LOOKAHEAD_WARMUP - 1:] == [1.0] * 6
    # a checkpoint's count goes on: a resumed run does not warm up again
    fresh = build_correction("lookahead")
    assert fresh.load_state_dict(rule.ring.correction.state_dict())
    assert fresh.apply(np.ones(4, np.float32), 3, None, None) == 1.0


@pytest.mark.parametrize("warmup,ramp", [("0", LOOKAHEAD_WARMUP), ("20", 0), ("5s", 0)])
def test_a_runs_own_warmup_replaces_lookaheads_ramp(warmup, ramp):
    # --warmup ramps the learning rate itself (the schedule): lookahead's ramp on top of it
    # would make the first step 1/(20 x 40) of the lr
    from types import SimpleNamespace

    from mpilb.server.store import slice_ring

    cfg = SimpleNamespace(
        updates=SimpleNamespace(correction="lookahead", dc_lambda=0.04, pipeline=0, mode="async",
                                servers=1),
        optim=SimpleNamespace(warmup=warmup, clip_norm=None), balancing=SimpleNamespace(batch=32))
    ring = slice_ring(cfg, np.zeros(4, np.float32), build_optimizer("momentum", 4, lr=0.1))
    assert ring.correction.ramp == ramp
    rule = build_rule("async", ring, lambda r: True)
    scale = rule.push(Peer(1), Update(1, 0, 0, 0, 32, 32, 1.0, 3), np.ones(4, np.float32))[1]
    assert scale == pytest.approx(1 / ramp if ramp else 1.0)
    other = build_correction("dynamic", own_warmup=True)   # (the others have no ramp)
    assert other.apply(np.ones(4, np.float32), 3, None, None) == 1.0


def store(optimizer="momentum", correction="momentum", n=4):
    opt = build_optimizer(optimizer, n, lr=0.1, momentum=0.9)
    return ParamRing(np.zeros(n, np.float32), opt, build_correction(correction), 32)


def push_all(rule, staleness, count=50):
    for _ in range(count):
        rule.push(Peer(1), Update(1, 0, 0, 0, 32, 32, 1.0, staleness), np.ones(4, np.float32))


@pytest.mark.parametrize("mode", ["async", "ssp"])
@pytest.mark.parametrize("policy", ["momentum", "dynamic", "lookahead"])
def test_the_policy_sets_the_momentum_from_the_measured_staleness(mode, policy):
    rule = build_rule(mode, store(correction=policy), lambda r: True, staleness_bound=100)
    push_all(rule, staleness=3)
    assert rule.ring.optimizer.momentum == pytest.approx(MOMENTUM_RULES[policy](0.9, 3))
    push_all(rule, staleness=0, count=2000)     # the staleness falls: the recipe's momentum
    assert rule.ring.optimizer.momentum == pytest.approx(0.9, abs=1e-3)


def test_the_old_behaviour_and_other_optimizers_are_left_alone():
    rule = build_rule("async", store(correction="none"), lambda r: True)
    push_all(rule, staleness=7)
    assert rule.ring.optimizer.momentum == 0.9
    rule = build_rule("async", store(optimizer="sgd"), lambda r: True)
    push_all(rule, staleness=7)                 # nothing to lower: a plain sgd step
    assert np.allclose(rule.ring.params, -0.1 * 50)
    assert not hasattr(rule.ring.optimizer, "momentum")


@pytest.mark.parametrize("policy", ["momentum", "dynamic"])
def test_the_policy_keeps_the_learning_rate(policy):
    rule = build_rule("async", store(correction=policy), lambda r: True)
    _, lr_scale = rule.push(Peer(1), Update(1, 0, 0, 0, 16, 16, 1.0, 5), np.ones(4, np.float32))
    assert lr_scale == 0.5          # only the batch scaling


def test_the_simulated_staleness_grows_with_workers_and_pipelining():
    from mpilb.simulate.staleness import mean_staleness, worker_staleness

    assert mean_staleness([1.0] * 4) == pytest.approx(3)
    assert mean_staleness([1.0] * 4, pipeline=1) == pytest.approx(7)
    rates = [1.0, 1.0, 1.0, 0.25]       # one 4x straggler: the mean stays W - 1,
    assert mean_staleness(rates) == pytest.approx(3)
    per = worker_staleness(rates)       # its own gradients are 12 versions old
    assert per[3] == pytest.approx(12) and per[0] == pytest.approx(2.25)


def test_dana_sends_the_look_ahead_of_every_worker_s_momentum():
    """Under `dana` the parameters a ring holds are DANA-Zero's look-ahead point
    theta - lr mu sum_j v_j, where theta and each worker's v_j follow heavy-ball momentum
    with one velocity per worker (Hakimi et al. 2019), here for 3 workers pushing in an
    uneven order; the recipe's momentum is left as it was."""
    rng = np.random.default_rng(0)
    n, lr, mu = 50, 0.1, 0.9
    start = rng.standard_normal(n).astype(np.float32)
    opt = build_optimizer("momentum", n, lr=lr, momentum=mu)
    ring = ParamRing(start.copy(), opt, build_correction("dana", own_warmup=True), 1)
    theta, v = start.astype(np.float64), {w: np.zeros(n) for w in (1, 2, 3)}
    for w in (1, 2, 1, 3, 3, 2, 1, 1, 2, 3):
        g = rng.standard_normal(n).astype(np.float32)
        ring.apply(g.copy(), 1, 2, worker=w)
        v[w] = mu * v[w] + g
        theta -= lr * v[w]
        ahead = theta - lr * mu * sum(v.values())
        assert np.allclose(ring.params, ahead, atol=1e-5)
    assert opt.momentum == mu
    # checkpointed: the mean of the workers' velocities (their sum, over as many workers)
    assert np.allclose(opt.state_dict()["velocity"], sum(v.values()) / 3, atol=1e-5)
    ring.forget(2)   # worker 2 left: its velocity goes
    assert sorted(opt._own) == [1, 3]


def test_keyed_velocities_start_from_the_loaded_one_and_a_load_replaces_them():
    opt = build_optimizer("momentum", 4, lr=1.0, momentum=0.5)
    p = np.zeros(4, np.float32)
    opt.select(7)
    opt.step(p, np.ones(4, np.float32))
    assert np.allclose(opt.velocity, 0) and np.allclose(opt.state_slice("velocity", 0, 4), 1)
    opt.load_state_slice("velocity", 0, 4, np.full(4, 2.0, np.float32))   # (a resume)
    assert np.allclose(opt.state_slice("velocity", 0, 4), 2)
    opt.select(7)   # key 7 again, and 8: both start from the loaded velocity
    opt.step(p, np.zeros(4, np.float32))
    opt.select(8)
    opt.step(p, np.zeros(4, np.float32))
    assert np.allclose(opt.state_slice("velocity", 0, 4), 1.0)   # 0.5 x 2, for each
    opt.forget(8)
    opt.select(None)   # the shared velocity: as loaded
    opt.step(p, np.zeros(4, np.float32))
    assert np.allclose(opt.velocity, 1.0) and list(opt._own) == [7]
