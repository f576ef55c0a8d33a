"""Staleness corrections, chosen by name (`--correction`).

Staleness tau = server version now - version the gradient was computed on. A correction
maps (gradient, tau) to the gradient to apply and a learning-rate factor. Like Horovod's
compressors these are tiny objects with one method, so adding one is a few lines.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .errors import UsageError

CORRECTIONS: dict[str, type] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        CORRECTIONS[name] = cls
        return cls
    return deco


class Correction:
    """Base: apply the gradient as it is."""

    name = "none"
    needs_old_params = False

    def __init__(self, dc_lambda: float = 0.04):
        self.dc_lambda = dc_lambda

    def apply(self, grad: np.ndarray, staleness: int, params_now: np.ndarray,
              params_then: Optional[np.ndarray]) -> float:
        """Correct `grad` in place for `staleness`; return the learning-rate factor."""
        return 1.0


@register("none")
class NoCorrection(Correction):
    pass


@register("inverse")
class InverseStaleness(Correction):
    """lr / max(1, tau): a stale gradient takes a proportionally smaller step."""

    def apply(self, grad, staleness, params_now, params_then):
        return 1.0 / max(1, staleness)


@register("dc")
class DelayCompensation(Correction):
    """Delay-compensated ASGD (Zheng et al., 2017): g + lambda * g*g*(w_now - w_then).

    The first-order Taylor term approximates the gradient at the current parameters from the
    one computed on the old ones, using g*g as a cheap diagonal Hessian estimate.
    """

    needs_old_params = True

    def __init__(self, dc_lambda: float = 0.04):
        super().__init__(dc_lambda)
        self._scratch: Optional[np.ndarray] = None

    def apply(self, grad, staleness, params_now, params_then):
        if staleness <= 0 or params_then is None or self.dc_lambda == 0:
            return 1.0
        if self._scratch is None or self._scratch.shape != grad.shape:
            self._scratch = np.empty_like(grad)
        s = self._scratch
        np.subtract(params_now, params_then, out=s)
        s *= grad
        s *= grad
        s *= self.dc_lambda
        grad += s
        return 1.0


def build_correction(name: str, dc_lambda: float = 0.04) -> Correction:
    try:
        return CORRECTIONS[name](dc_lambda)
    except KeyError:
        raise UsageError(f"--correction {name!r}: allowed values are {', '.join(CORRECTIONS)}") from None
