"""``mpilb.Model``: the public protocol every model follows, built-in or the user's.

The engine knows a model only through this protocol: a flat float32 parameter vector of
``num_params`` entries, a gradient step on ``xp`` arrays (NumPy on the CPU, CuPy on a GPU)
and an evaluation. A user's subclass writes its own ``__init__`` (no base constructor call
is needed) and provides::

    num_params                              # attribute or property
    init_params(seed) -> np.ndarray         # flat float32, the same on every rank for a seed
    loss_and_grad(params, x, y, out=None)   # -> (loss SUMMED over the batch, flat gradient)
    evaluate(params, x, y) -> dict          # {"loss": mean loss, <metric>: value, ...}

The loss is a sum, not a mean, so that gradients of batches of different sizes add up on
the server (it divides by the batch). ``out``, when given, is where the gradient must be
written (the worker's message buffer): writing there saves a copy per step.

Everything else has a default here: ``metric`` (the headline metric's name), ``signature()``
(what a checkpoint records to refuse resuming a different model), ``layout()`` (named views
of the flat vector, for ``mpilb export``), and ``num_state``/``get_state()``/``set_state()``
for state that is not trained by gradients but travels with each push (BatchNorm's running
statistics in a torch module); the server keeps the latest.
"""

from __future__ import annotations

import numpy as np


class Model:
    """Base class and documentation of the model protocol (see the module docstring)."""

    #: name of the headline metric in :meth:`evaluate`'s dict ("accuracy", "r2", ...)
    metric = "accuracy"
    #: floats of non-trained state sent with each push (0: none)
    num_state = 0

    def init_params(self, seed: int) -> np.ndarray:
        """Initial flat float32 parameters, a function of ``seed`` only."""
        raise NotImplementedError(f"{type(self).__name__} must define init_params(seed)")

    def loss_and_grad(self, params, x, y, out=None):
        """``(loss summed over the batch, flat gradient)`` at ``params`` on one batch."""
        raise NotImplementedError(f"{type(self).__name__} must define loss_and_grad(params, x, y, out=None)")

    def evaluate(self, params, x, y) -> dict:
        """``{"loss": mean loss, self.metric: value, ...}`` over ``x``, ``y``."""
        raise NotImplementedError(f"{type(self).__name__} must define evaluate(params, x, y)")

    def signature(self) -> dict:
        """JSON-able identity for checkpoints: resuming requires an equal signature."""
        return {"model": type(self).__qualname__, "num_params": int(self.num_params),
                "layout": [[name, list(shape)] for name, shape in self.layout()]}

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of each array inside the flat vector, in order."""
        return [("params", (int(self.num_params),))]

    def get_state(self):
        """The non-trained state as a flat float32 host array of ``num_state`` (or None)."""
        return None

    def set_state(self, flat) -> None:
        """Take over state written by :meth:`get_state` (on another rank)."""


# --------------------------------------------------------------------------- metrics


def accuracy(scores, y) -> float:
    """Fraction of rows whose highest score is the label."""
    return float((scores.argmax(axis=1) == y).mean()) if len(y) else float("nan")


def r2_score(pred, y) -> float:
    """Coefficient of determination, averaged over outputs (scikit-learn's default).

    1 - sum (y - pred)^2 / sum (y - mean y)^2 per output; 1 is perfect, 0 is as good as
    predicting the mean.
    """
    y = np.asarray(y, dtype=np.float64).reshape(len(y), -1)
    pred = np.asarray(pred, dtype=np.float64).reshape(y.shape)
    if len(y) < 2:
        return float("nan")
    ss_res = ((y - pred) ** 2).sum(axis=0)
    ss_tot = ((y - y.mean(axis=0)) ** 2).sum(axis=0)
    scores = np.where(ss_tot > 0, 1.0 - ss_res / np.where(ss_tot > 0, ss_tot, 1.0), 0.0)
    return float(scores.mean())
