"""Weight prediction (`--weight-prediction`): a worker computes its gradient on the
parameters it expects the server to hold when the gradient arrives, not on the ones it read.

With staleness tau a gradient computed on w_t is applied to w_{t+tau}. Under momentum the
parameters move steadily, so the recent trajectory foretells the next steps:

    w_hat = w + k * (w - w_prev) / (v - v_prev)

w_prev, v_prev: the parameters and version of this worker's previous read; k: the staleness
its own pushes have met lately (corrections.StalenessMeter over what the replies showed).
The gradient is then nearly a fresh one's (SpecTrain: Chen et al. 2018, "Efficient and
robust parallel DNN training through model parallelism on multi-GPU platform"; PipeMare,
Yang et al. 2021, for pipelines). It costs the worker three passes over the parameters and
one copy of them a step; the server does nothing more and the wire carries nothing more.

Measured (docs/benchmarks/staleness.md): with a momentum recipe it brings the samples to a
target closer to sync's; with plain SGD the trajectory is too noisy to extrapolate, and it
gained nothing, so the default is on only for --optimizer momentum in async and ssp.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mpilb.core.corrections import StalenessMeter


class WeightPrediction:
    """Extrapolates the parameters a worker reads by the staleness it expects.

    Args:
        floats: the parameters' length.
        xp: the array module of the parameters (numpy, or cupy on a GPU).
        alpha: the weight of each new staleness observation in the mean.
    """

    def __init__(self, floats: int, xp: Any = np, alpha: float = 0.2):
        self.xp = xp
        self.prev: Optional[Any] = None       # the parameters of the previous read (a copy)
        self.prev_version = -1
        self.out = xp.empty(floats, dtype=np.float32)
        self.predicted = False                # whether `out` holds the last read's prediction
        self.factor = 0.0                     # w_hat = w + factor * (w - w_from): the last read's
        self.from_version = -1                # (0 and -1 where it was not extrapolated)
        self.meter = StalenessMeter(alpha)    # the staleness of this worker's pushes

    @property
    def staleness(self) -> Optional[float]:
        """The mean staleness of this worker's pushes so far (None before the first)."""
        return self.meter.mean if self.meter.count else None

    @property
    def used(self) -> tuple[float, int]:
        """(factor, from version) of the last read's extrapolation: (0.0, -1) where it had
        none (a push carries it: wire.Push.PRED_F)."""
        return self.factor, self.from_version

    def observe(self, staleness: int) -> None:
        """A reply showed the staleness this worker's last push met (versions applied
        between the parameters it was computed on and its own application)."""
        if staleness >= 0:
            self.meter.add(staleness)

    def params(self, params: Any, version: int) -> Any:
        """The parameters to compute on, given the ones read at `version`: extrapolated
        along the trajectory since the previous read, or `params` themselves where there is
        nothing to extrapolate from (the first read, no staleness seen yet)."""
        if version == self.prev_version:   # the same read again (a retried push)
            return self.out if self.predicted else params
        xp = self.xp
        k = self.staleness or 0.0
        self.predicted = self.prev is not None and version > self.prev_version and k > 0
        self.factor, self.from_version = 0.0, -1
        if self.predicted:
            out = self.out
            xp.subtract(params, self.prev, out=out)
            self.factor = float(np.float32(k / (version - self.prev_version)))
            self.from_version = self.prev_version
            out *= np.float32(self.factor)
            out += params
        if self.prev is None:
            self.prev = xp.empty_like(self.out)
        self.prev[...] = params
        self.prev_version = version
        return self.out if self.predicted else params
