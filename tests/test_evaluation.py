"""Evaluation, stop rules and validation hold-out (mpilb.training): pure, no MPI."""

import math

import numpy as np
import pytest

from mpilb.config import build_config
from mpilb.errors import UsageError
from mpilb.models import build_model
from mpilb.training import (Evaluation, StopRule, build_evaluator, build_stop_rule,
                            hold_out_validation)


def test_stop_rule_target_metric_uses_validation_when_held_out():
    rule = build_stop_rule(build_config({}, {"target_metric": 0.5, "epochs": 9}))
    test_only = Evaluation(loss=1.0, accuracy=math.nan, metric=0.6, metric_name="r2")
    assert rule.check(1, 1.0, test_only) and rule.reason == "target_metric"
    rule = build_stop_rule(build_config({}, {"target_metric": 0.5, "epochs": 9}))
    held_out = Evaluation(1.0, math.nan, 0.6, "r2", val_metric=0.4, val_accuracy=math.nan)
    assert not rule.check(1, 1.0, held_out)          # the test set does not decide
    assert StopRule(9, None, 0.9).check(1, 1.0, 0.95)  # a plain accuracy still works
    assert held_out.columns() == {"test_loss": 1.0, "test_accuracy": held_out.accuracy,
                                  "test_metric": 0.6, "val_metric": 0.4}


def test_validation_holds_out_whole_shards_and_the_evaluator_reads_them(small_dataset):
    cfg = build_config({}, {"validation_fraction": 0.3})
    ds = hold_out_validation(cfg, small_dataset)
    assert len(ds.shards) == 3 and [s.file for s in ds.validation] == ["shard-00003.h5"]
    assert ds.total_samples == 1200 and small_dataset.total_samples == 1600
    model = build_model("softmax", ds.sample_shape, ds.num_classes)
    ev = build_evaluator(model, ds).evaluate(model.init_params(0))
    assert ev.metric_name == "accuracy" and 0 <= ev.val_metric <= 1 and ev.val_metric == ev.val_accuracy
    with pytest.raises(UsageError, match="leaves no shard to train on"):
        hold_out_validation(build_config({}, {"validation_fraction": 0.9}), small_dataset)
    assert hold_out_validation(build_config({}, {}), small_dataset) is small_dataset


def test_evaluator_requires_the_models_metric(small_dataset):
    class Broken:
        metric = "r2"

        def evaluate(self, params, x, y):
            return {"loss": 1.0}

    from mpilb.errors import MpilbError
    from mpilb.training import Evaluator

    with pytest.raises(MpilbError, match="must return 'loss' and its metric 'r2'"):
        Evaluator(Broken(), np.zeros((2, 3)), np.zeros(2)).evaluate(np.zeros(3))


def test_an_evaluation_in_the_background_is_logged_in_order_by_collect():
    """Rank 0 evaluates an epoch's end on a thread while it serves pushes (session.py)."""
    import threading

    from mpilb.session import Session

    release = threading.Event()
    seen = []

    class SlowEvaluator:
        def evaluate(self, params):
            release.wait(10.0)
            seen.append(params.copy())
            return Evaluation(loss=1.0, accuracy=float(params[0]), metric=float(params[0]),
                              metric_name="accuracy")

    class Log:
        rows = []

        def append(self, group, **row):
            self.rows.append((group, row))

    s = Session.__new__(Session)
    s.evaluator, s.log, s._eval_pool, s._pending = SlowEvaluator(), Log(), None, None
    s.accuracy, s.evaluation, s.eval_version = None, None, -1
    params = np.array([0.5, 0.0], dtype=np.float32)
    done = []
    s.evaluate_later(params, t=1.0, version=7, epoch=0, then=lambda: done.append(s.accuracy))
    params[0] = 0.9                       # the server steps on: the evaluation has its copy
    assert not s.collect() and s.eval_version == -1 and not Log.rows
    release.set()
    assert s.collect(wait=True)
    assert seen[0][0] == np.float32(0.5) and s.accuracy == 0.5 and s.eval_version == 7
    assert done == [0.5]
    s.evaluate(params, t=2.0, version=8, epoch=1)   # a synchronous one after it
    assert [(g, r["epoch"], r["version"]) for g, r in Log.rows] == [("eval", 0, 7), ("eval", 1, 8)]
    assert not s.collect()
