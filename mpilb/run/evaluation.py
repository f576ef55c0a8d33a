"""Test-set (and validation-set) evaluation on rank 0: :class:`Evaluator` and the
:class:`Evaluation` it returns, which the stop rules decide on and the eval/ rows log.
Run on rank 0's thread, or in a process of its own (evalproc.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from mpilb.errors import MpilbError


@dataclass
class Evaluation:
    """One evaluation: the test set's loss, accuracy (NaN for non-classifiers) and the
    model's metric, plus the validation metric when a validation set is held out."""

    loss: float
    accuracy: float
    metric: float
    metric_name: str
    val_metric: Optional[float] = None
    val_accuracy: Optional[float] = None

    @property
    def decides(self) -> tuple[float, float]:
        """(accuracy, metric) that --target-* look at: validation's when there is one."""
        if self.val_metric is not None:
            return self.val_accuracy, self.val_metric
        return self.accuracy, self.metric

    def columns(self) -> dict:
        """The eval/ row's values (docs/logs.md, `eval/`)."""
        return {"test_loss": self.loss, "test_accuracy": self.accuracy, "test_metric": self.metric,
                "val_metric": float("nan") if self.val_metric is None else self.val_metric}


class Evaluator:
    """Test-set (and validation-set) evaluation on rank 0 (NumPy), with its time accounted."""

    def __init__(self, model, x: np.ndarray, y: np.ndarray, validation=None):
        self.model = model
        self.x = x
        self.y = y
        self.validation = validation      # (x, y) held out from training, or None
        self.seconds = 0.0

    def _one(self, params, x, y) -> tuple[float, float, float]:
        result = self.model.evaluate(params, x, y)
        name = self.model.metric
        if "loss" not in result or name not in result:
            raise MpilbError(f"{type(self.model).__name__}.evaluate returned keys {sorted(result)}; "
                             f"it must return 'loss' and its metric {name!r}")
        return (float(result["loss"]), float(result.get("accuracy", float("nan"))),
                float(result[name]))

    def evaluate(self, params: np.ndarray) -> Evaluation:
        t0 = time.perf_counter()
        loss, acc, metric = self._one(params, self.x, self.y)
        ev = Evaluation(loss, acc, metric, self.model.metric)
        if self.validation is not None:
            _, ev.val_accuracy, ev.val_metric = self._one(params, *self.validation)
        self.seconds += time.perf_counter() - t0
        return ev

    def __call__(self, params: np.ndarray) -> tuple[float, float]:
        """(test loss, test accuracy): the older two-number form."""
        ev = self.evaluate(params)
        return ev.loss, ev.accuracy


def build_evaluator(model, dataset) -> Evaluator:
    """The test set, and the held-out validation shards if any (:func:`hold_out_validation`)."""
    test_x, test_y = dataset.load_test()
    validation = None
    if getattr(dataset, "validation", None):   # (stand-ins such as bench's have none)
        parts = [dataset.load_file(s.file, s.samples) for s in dataset.validation]
        validation = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    return Evaluator(model, test_x, test_y, validation)
