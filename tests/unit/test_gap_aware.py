"""`--correction gap` without MPI: a gradient damped per parameter by how far that parameter
moved since the (predicted) parameters it was computed on, in units of its mean step; the
ring rebuilding the worker's prediction from the versions it kept; and those versions kept
while a step would otherwise overwrite them in place."""

import numpy as np
import pytest

from mpilb.core import corrections
from mpilb.core.corrections import GAP_WARMUP, Extrapolated, GapAware, build_correction
from mpilb.core.optimizers import build_optimizer
from mpilb.core.prediction import WeightPrediction
from mpilb.server.modes import ParamRing


def walked(gap: GapAware, steps) -> None:
    """Apply zero gradients at the parameters of each of `steps` (a walk): the mean step
    learns each one's distance from the one before."""
    for p in steps:
        gap.apply(np.zeros(p.size, np.float32), 0, p, None)


def test_a_parameter_that_ran_ahead_is_damped_and_the_others_are_not():
    gap = GapAware(ramp=0)
    gap.bind(3)
    walked(gap, [np.array([k, 2 * k, 0], np.float32) for k in range(30)])   # mean steps 1, 2, 0
    now = np.array([30, 60, 0], np.float32)   # one step more (the mean stays)
    then = now - np.array([4, 1, 0], np.float32)   # 4 mean steps, half of one, none
    grad = np.ones(3, np.float32)
    assert gap.apply(grad, 3, now, then) == 1.0
    np.testing.assert_allclose(grad, [0.25, 1.0, 1.0], rtol=1e-5)
    grad = np.ones(3, np.float32)
    gap.apply(grad, 3, now + [1, 2, 0], None)   # the parameters it was computed on are gone
    np.testing.assert_allclose(grad, 1.0)


def test_chunks_give_the_floats_of_the_whole_vector():
    whole, parts = GapAware(ramp=0), GapAware(ramp=0)
    whole.bind(6)
    parts.bind(6)
    rng = np.random.default_rng(0)
    walk = np.cumsum(rng.normal(size=(20, 6)).astype(np.float32), axis=0)
    for p in walk:
        g1, g2 = np.ones(6, np.float32), np.ones(6, np.float32)
        then = p - rng.normal(size=6).astype(np.float32)
        whole.apply(g1, 2, p, then)
        for lo, hi in ((0, 2), (2, 5), (5, 6)):
            parts.apply(g2[lo:hi], 2, p[lo:hi], then[lo:hi], at=lo)
        np.testing.assert_array_equal(g1, g2)
    assert g1.min() < 1.0   # something was damped


def reference_damping(mean: np.ndarray, now: np.ndarray, then: np.ndarray) -> np.ndarray:
    """The factor on each coordinate as the method states it: 1 / max(1, |now - then| / mean)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = np.abs(now.astype(np.float64) - then) / mean
    return 1.0 / np.maximum(1.0, np.nan_to_num(gap, nan=0.0))


def test_blocks_and_an_unbuilt_prediction_give_the_floats_of_the_method(monkeypatch):
    monkeypatch.setattr(corrections, "GAP_BLOCK", 4)   # 11 floats: three blocks, the last short
    blocked = GapAware(ramp=0)
    blocked.bind(11)
    rng = np.random.default_rng(3)
    walk = np.cumsum(rng.normal(size=(12, 11)).astype(np.float32), axis=0)
    walk[:, 7] = 0.0   # a parameter that never moves: no damping (0/0)
    walked(blocked, walk[:-1])
    mean = blocked.mean_step.copy()
    base, old = walk[-3], walk[-5]
    predicted = Extrapolated(base, old, 1.5)
    built = np.asarray(predicted)
    np.testing.assert_allclose(built, base + 1.5 * (base - old), rtol=1e-5, atol=1e-5)
    now = walk[-1]
    mean_now = GapAware(ramp=0)   # the mean step once `now` joins it, by the whole-vector path
    mean_now.bind(11)
    walked(mean_now, walk)
    grad = np.ones(11, np.float32)
    blocked.apply(grad, 2, now, predicted)
    np.testing.assert_array_equal(blocked.mean_step, mean_now.mean_step)
    np.testing.assert_allclose(grad, reference_damping(mean_now.mean_step, now, built), rtol=1e-5)
    assert grad[7] == 1.0 and grad.min() < 0.5 and not np.array_equal(mean, blocked.mean_step)
    again = np.ones(11, np.float32)   # the built prediction gives the same floats
    twin = GapAware(ramp=0)
    twin.bind(11)
    walked(twin, walk[:-1])
    twin.apply(again, 2, now, built)
    np.testing.assert_array_equal(again, grad)


def test_the_learning_rate_ramps_up_and_the_momentum_stays_the_recipes():
    gap = build_correction("gap")
    assert gap.ramp == GAP_WARMUP and build_correction("gap", own_warmup=True).ramp == 0
    opt = build_optimizer("momentum", 4, lr=0.1, momentum=0.9)
    ring = ParamRing(np.zeros(4, np.float32), opt, gap, 32)
    scales = [ring.apply(np.ones(4, np.float32), 32, 3) for _ in range(GAP_WARMUP + 3)]
    assert scales[0] == pytest.approx(1 / GAP_WARMUP) and scales[-3:] == [1.0] * 3
    assert opt.momentum == 0.9


def test_the_ring_rebuilds_the_workers_prediction_from_the_versions_it_kept():
    opt = build_optimizer("momentum", 5, lr=0.1, momentum=0.9)
    ring = ParamRing(np.zeros(5, np.float32), opt, build_correction("gap"), 32, keep_sent=2)
    worker = WeightPrediction(5)
    rng = np.random.default_rng(1)
    for k in range(6):   # worker 1 reads every other version; its pushes met staleness 2
        if k % 2 == 0:
            ring.sent_version(1)
            worker.observe(2)
            predicted = worker.params(ring.params.copy(), ring.version)
        ring.apply(rng.normal(size=5).astype(np.float32), 32, 0)   # in place unless kept
    assert worker.predicted and worker.from_version == 2 and ring.version == 6
    rebuilt = ring.params_then(4, (worker.factor, worker.from_version))
    np.testing.assert_allclose(rebuilt, predicted, rtol=1e-6)
    np.testing.assert_array_equal(ring.params_then(4), ring.params_of(4))   # not predicted
    assert ring.params_then(0, (0.5, -7)) is None   # a version no longer kept


def test_a_kept_version_is_not_stepped_over_in_place():
    # no send reads the current parameters, but a worker's kept version is theirs: the step
    # goes to another buffer (dc and gap read it back when that worker's gradient comes)
    opt = build_optimizer("sgd", 3, lr=0.1)
    ring = ParamRing(np.zeros(3, np.float32), opt, build_correction("dc"), 32, keep_sent=1)
    ring.sent_version(2)
    ring.apply(np.ones(3, np.float32), 32, 0)
    np.testing.assert_array_equal(ring.params_of(0), 0.0)
    assert ring.version == 1 and ring.params[0] == pytest.approx(-0.1)
