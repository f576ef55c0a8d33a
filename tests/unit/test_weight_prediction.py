"""Weight prediction (`--weight-prediction`, core/prediction.py) without MPI: what a worker
computes on, the staleness it extrapolates by, and the option's defaults."""

import numpy as np
import pytest

from mpilb.config.build import build_config
from mpilb.core.prediction import WeightPrediction
from mpilb.errors import UsageError


def test_nothing_is_predicted_before_a_trajectory_and_a_staleness_are_known():
    p = WeightPrediction(3)
    w0 = np.array([1.0, 2.0, 3.0], np.float32)
    assert p.params(w0, 0) is w0                 # the first read: nothing to extrapolate from
    w4 = w0 + 4
    assert p.params(w4, 4) is w4                 # a trajectory, but no staleness seen yet
    p.observe(-1)                                # a reply that says nothing (ignored)
    assert p.staleness is None


def test_the_parameters_are_extrapolated_by_the_staleness_along_the_last_reads():
    p = WeightPrediction(2, alpha=0.5)
    p.params(np.zeros(2, np.float32), 0)
    p.observe(3)
    w = np.array([4.0, -8.0], np.float32)        # 4 versions on: (1, -2) a version
    out = p.params(w, 4)
    np.testing.assert_allclose(out, w + 3 * np.array([1.0, -2.0]))
    assert w.tolist() == [4.0, -8.0]             # the read itself is left as it was
    # the same read again (a retried push) computes on the same prediction
    assert p.params(w, 4) is out
    # the staleness is a moving mean of what the replies showed
    p.observe(5)
    assert p.staleness == pytest.approx(4.0)
    w2 = np.array([6.0, -12.0], np.float32)      # 2 versions on: (1, -2) a version
    np.testing.assert_allclose(p.params(w2, 6), w2 + 4 * np.array([1.0, -2.0]))


def test_a_version_that_does_not_advance_is_not_extrapolated():
    p = WeightPrediction(2)
    p.params(np.ones(2, np.float32), 5)
    p.observe(2)
    w = np.full(2, 7.0, np.float32)
    assert p.params(w, 3) is w                   # older than the last read (a resumed run)


def test_under_a_steady_drift_the_prediction_is_where_the_server_will_be():
    """A server that moves every parameter by the same step each version, read every W
    versions by a worker whose pushes meet W - 1 others: the prediction is the parameters
    its gradient will be applied to."""
    step, W = np.float32(-0.01), 4
    server = np.zeros(5, np.float32)
    p = WeightPrediction(5)
    version = 0
    for _ in range(10):
        out = p.params(server.copy(), version)
        applied_at = version + W - 1
        if version >= 2 * W:
            np.testing.assert_allclose(out, np.full(5, step * applied_at), rtol=1e-5)
        version = applied_at + 1
        server[:] = step * version
        p.observe(W - 1)


@pytest.mark.parametrize("values,on", [
    ({}, "off"),                                               # sgd
    ({"optimizer": "momentum"}, "on"),
    ({"optimizer": "momentum", "mode": "ssp"}, "on"),
    ({"optimizer": "momentum", "mode": "sync"}, "off"),
    ({"optimizer": "adam"}, "off"),
    ({"optimizer": "momentum", "weight_prediction": "off"}, "off"),
    ({"weight_prediction": "on"}, "on"),                       # asked for, with sgd
])
def test_the_default_is_on_for_a_momentum_recipe_in_async_and_ssp(values, on):
    assert build_config({}, values).updates.weight_prediction == on


def test_prediction_in_sync_rounds_is_refused():
    with pytest.raises(UsageError, match="--weight-prediction on has no effect with --mode sync"):
        build_config({}, {"mode": "sync", "weight_prediction": "on"})
    assert build_config({}, {"mode": "sync", "weight_prediction": "off"}).updates.weight_prediction == "off"
    with pytest.raises(UsageError, match="--weight-prediction.*allowed values are on, off"):
        build_config({}, {"weight_prediction": "linear"})
