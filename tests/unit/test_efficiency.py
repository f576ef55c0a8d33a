"""The report's statistical efficiency without MPI: samples at evaluations, samples to an
accuracy against a reference, per-worker staleness and effective momentum, warnings."""

import numpy as np
import pytest

from mpilb.runfiles import efficiency as E


def updates(staleness, batch=32, workers=(1, 2)):
    n = len(staleness)
    return {"version": np.arange(1, n + 1), "batch": np.full(n, batch),
            "staleness": np.asarray(staleness), "worker": np.resize(np.asarray(workers), n)}


def evals(versions, accuracy):
    return {"version": np.asarray(versions), "test_accuracy": np.asarray(accuracy, float)}


def test_samples_at_evals_counts_gradients_up_to_the_version_read():
    up = updates([0] * 10)
    ev = evals([0, 3, 10], [0.1, 0.5, 0.9])
    assert list(E.samples_at_evals(up, ev)) == [0, 96, 320]
    # a sync round: several updates rows share one version
    up = {"version": np.array([1, 1, 2, 2]), "batch": np.array([10, 20, 10, 20]),
          "staleness": np.zeros(4), "worker": np.array([1, 2, 1, 2])}
    assert list(E.samples_at_evals(up, evals([1, 2], [0.3, 0.4]))) == [30, 60]


def test_samples_to_a_target_against_the_reference():
    run = (np.array([100, 200, 300, 400]), np.array([0.5, 0.7, 0.8, 0.85]))
    ref = (np.array([100, 200, 300]), np.array([0.6, 0.8, 0.82]))
    assert E.samples_to(*run, 0.8) == 300 and E.samples_to(*run, 0.9) is None
    rows = E.against_reference(run, ref, targets=[0.8, 0.82, 0.9])
    assert rows[0] == {"accuracy": 0.8, "samples": 300, "reference_samples": 200, "ratio": 1.5,
                       "samples_after": 200, "reference_samples_after": 100}
    # reached between the evaluation before and this one: the coarsest, relative to its count
    assert E.coarsest(rows) == (100, 200)
    assert E.reached_after(*ref, 0.5) == 0 and E.reached_after(*ref, 0.9) is None
    assert E.coarsest([dict(rows[2], reference_samples=None)]) is None
    assert rows[1]["ratio"] == pytest.approx(400 / 300)
    assert rows[2]["samples"] is None and rows[2]["ratio"] is None
    # default targets: spread between the reference's first evaluation and its best
    levels = E.levels(ref[1])
    assert levels[-1] == 0.82 and levels == sorted(levels) and levels[0] > 0.6


def test_effective_momentum_per_worker():
    cfg = {"optimizer": "momentum", "momentum": 0.9, "correction": "none", "mode": "async"}
    up = updates([1, 7, 1, 7, 1, 7])      # worker 1 at staleness 1, worker 2 at 7
    rows = E.per_worker_staleness(up, cfg)
    assert [r["rank"] for r in rows] == [1, 2]
    assert rows[0]["staleness_mean"] == 1 and rows[1]["staleness_mean"] == 7
    assert rows[0]["effective_momentum"] == pytest.approx(0.9 + 0.5)
    assert rows[1]["effective_momentum"] == pytest.approx(0.9 + 7 / 8)
    # sgd: only what asynchrony adds
    rows = E.per_worker_staleness(up, dict(cfg, optimizer="sgd"))
    assert rows[1]["effective_momentum"] == pytest.approx(7 / 8)
    # dana: the recipe's (a velocity per worker, the parameters read past the others')
    rows = E.per_worker_staleness(up, dict(cfg, correction="dana"))
    assert [r["effective_momentum"] for r in rows] == pytest.approx([0.9, 0.9])


@pytest.mark.parametrize("policy,explicit", [("dynamic", 0.6), ("momentum", 0.15), ("none", 0.9)])
def test_the_momentum_applied_is_the_policy_s(policy, explicit):
    cfg = {"optimizer": "momentum", "momentum": 0.9, "correction": policy, "mode": "async"}
    assert E.explicit_used(cfg, 3.0) == pytest.approx(explicit)
    rows = E.per_worker_staleness(updates([3] * 6), cfg)
    assert rows[0]["effective_momentum"] == pytest.approx(explicit + 0.75)


def test_warning_when_staleness_is_high_for_the_momentum():
    cfg = {"optimizer": "momentum", "momentum": 0.9, "correction": "none", "mode": "async"}
    up = updates([7] * 20)
    lines = E.warnings(cfg, up, np.zeros(0), np.zeros(0))
    assert len(lines) == 1 and "--correction" in lines[0] and "staleness 7.0" in lines[0]
    # it names the default policy and the momentum that would apply: 1 - 0.1 * 8
    assert "--correction dynamic" in lines[0] and "--momentum 0.20" in lines[0]
    # low staleness, sgd, sync: nothing to say
    assert E.warnings(cfg, updates([0] * 20), np.zeros(0), np.zeros(0)) == []
    assert E.warnings(dict(cfg, optimizer="sgd"), up, np.zeros(0), np.zeros(0)) == []
    assert E.warnings(dict(cfg, mode="sync"), up, np.zeros(0), np.zeros(0)) == []


def learning_curve(samples, flat_from=None):
    acc = 0.9 - 0.5 * np.exp(-samples / 30000)
    if flat_from is not None:    # no better than evaluation `flat_from` from there on
        acc[flat_from:] = acc[flat_from - 1] - 0.002
    return acc


def test_plateau_below_the_trend_is_found():
    s = np.linspace(1000, 100000, 12)
    assert E.plateau(s, learning_curve(s)) is None        # still on its trend
    flat = learning_curve(s, flat_from=8)
    found = E.plateau(s, flat)
    assert found is not None
    best, expected = found
    assert best == pytest.approx(flat[-1]) and expected > best + 0.01
    assert E.plateau(s[:5], flat[:5]) is None             # too few evaluations to say
    cfg = {"optimizer": "momentum", "momentum": 0.9, "correction": "none", "mode": "async"}
    lines = E.warnings(cfg, updates([1] * 20), s, flat)
    assert any("plateaued" in line and "--correction" in line for line in lines)
    # a run that converged where its trend levels off is not warned about
    converged = 0.9 - 0.5 * np.exp(-s / 8000) + 0.002 * np.sin(s)
    assert E.plateau(s, converged) is None


def test_a_fall_from_the_best_accuracy_is_found():
    assert E.fell(np.array([0.2, 0.5, 0.45, 0.1])) == (0.5, 0.1)
    assert E.fell(np.array([0.2, 0.5, 0.47])) is None
    assert E.fell(np.array([0.2, 0.5, 0.15, 0.64, 0.6])) == (0.5, 0.15)   # swung, recovered
    serial = {"optimizer": "momentum", "momentum": 0.9, "correction": "momentum", "mode": "async"}
    assert E.warnings(serial, updates([0] * 20), np.arange(1, 5),
                      np.array([0.2, 0.5, 0.45, 0.1])) == []    # no staleness to blame
    cfg = {"optimizer": "momentum", "momentum": 0.9, "correction": "momentum", "mode": "async",
           "pipeline": 1}
    lines = E.warnings(cfg, updates([7] * 20), np.arange(1, 5), np.array([0.2, 0.5, 0.45, 0.1]))
    assert len(lines) == 1 and "fell from 0.5000 to 0.1000" in lines[0] and "--pipeline 0" in lines[0]
    # under dynamic (the default) the fall names the policy that keeps less momentum
    cfg = dict(cfg, correction="dynamic", pipeline=0)
    lines = E.warnings(cfg, updates([3] * 20), np.arange(1, 5), np.array([0.2, 0.5, 0.45, 0.1]))
    assert len(lines) == 1 and "try --correction momentum (momentum 0.15 instead of 0.60" in lines[0]
    assert "--weight-prediction" not in lines[0]   # a log without it, or with it on
    # under lookahead it names dynamic
    lines = E.warnings(dict(cfg, correction="lookahead"), updates([3] * 20), np.arange(1, 5),
                       np.array([0.2, 0.5, 0.45, 0.1]))
    assert len(lines) == 1 and "try --correction dynamic (momentum 0.60 instead of 0.69" in lines[0]
    # under dana (the default where workers predict), which keeps the recipe's, lookahead
    lines = E.warnings(dict(cfg, correction="dana"), updates([3] * 20), np.arange(1, 5),
                       np.array([0.2, 0.5, 0.45, 0.1]))
    assert len(lines) == 1 and "try --correction lookahead (momentum 0.69 instead of 0.90" in lines[0]
    # with prediction turned off, the fall names it first among the fresher gradients
    lines = E.warnings(dict(cfg, weight_prediction="off"), updates([3] * 20), np.arange(1, 5),
                       np.array([0.2, 0.5, 0.45, 0.1]))
    assert len(lines) == 1 and "or --weight-prediction on (gradients computed on where" in lines[0]


def test_efficiency_entry():
    cfg = {"optimizer": "momentum", "momentum": 0.9, "correction": "none", "mode": "async",
           "target_accuracy": 0.5}
    up, ev = updates([2] * 10), evals([5, 10], [0.4, 0.6])
    ref = (updates([0] * 10), evals([2, 10], [0.5, 0.7]))
    out = E.efficiency(cfg, up, ev, ref)
    assert out["samples_at_eval"] == [160, 320] and out["samples_to_target"] == 320
    rows = out["against_reference"]      # the reference's levels: up to its best, 0.7
    assert rows[0]["reference_samples"] == 320 and rows[0]["samples"] == 320
    assert rows[-1]["accuracy"] == 0.7 and rows[-1]["samples"] is None
    assert [w["rank"] for w in out["per_worker"]] == [1, 2]
