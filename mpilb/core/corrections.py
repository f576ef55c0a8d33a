"""Staleness corrections, chosen by name (`--correction`).

Staleness tau = server version now - version the gradient was computed on. A correction
maps (gradient, tau) to the gradient to apply and a learning-rate factor, and may first
adjust the optimizer's hyperparameters (:meth:`Correction.tune`: the `dynamic` policy, the
default of async and ssp, and the `momentum` one before it lower the momentum as the
measured staleness grows). Like Horovod's compressors these are tiny objects
with one or two methods, so adding one is a few lines. What a correction has measured (the
staleness average of `dynamic` and `momentum`) goes into rank 0's
checkpoints (:meth:`Correction.state_dict`), so that `--resume` goes on from it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from mpilb.errors import UsageError

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
    reads_kept = 1   # versions sent to each worker it may read back (2: the prediction's too)
    # staleness adds asynchrony's implicit momentum on top of the optimizer's (runfiles/
    # efficiency.py); not where each worker's gradients have a momentum of their own
    adds_implicit = True

    def __init__(self, dc_lambda: float = 0.04):
        self.dc_lambda = dc_lambda

    def bind(self, size: int) -> None:
        """The parameters' length (a store's slice), before the first gradient."""

    def apply(self, grad: np.ndarray, staleness: int, params_now: np.ndarray,
              params_then: Optional[np.ndarray], at: int = 0) -> float:
        """Correct `grad` in place for `staleness`; return the learning-rate factor. `at`:
        where `grad` starts in the parameters (a chunk's offset, ParamRing.apply_chunks)."""
        return 1.0

    def tune(self, optimizer, staleness: int) -> None:
        """Before the step of a gradient of `staleness`: adjust `optimizer`'s
        hyperparameters (the implicit-momentum policies); by default nothing."""

    def source(self, optimizer, worker: int) -> None:
        """Before each step (or chunk of one) of `worker`'s gradient: by default nothing
        (`dana`: that worker's own momentum)."""

    def state_dict(self) -> dict:
        """What it has measured, JSON-serialisable (a checkpoint keeps it); by default
        only its name."""
        return {"name": self.name}

    def load_state_dict(self, state: dict) -> bool:
        """Go on from :meth:`state_dict`'s output; False (and nothing changed) when it is
        another correction's (a resume with another --correction starts afresh)."""
        return state.get("name") == self.name


@register("none")
class NoCorrection(Correction):
    pass


@register("inverse")
class InverseStaleness(Correction):
    """lr / max(1, tau): a stale gradient takes a proportionally smaller step."""

    def apply(self, grad, staleness, params_now, params_then, at=0):
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

    def apply(self, grad, staleness, params_now, params_then, at=0):
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


class StalenessMeter:
    """The mean staleness of the gradients applied so far, as an exponentially weighted
    average (weight `alpha` on each new gradient, the plain mean until 1/alpha of them)."""

    def __init__(self, alpha: float = 0.01):
        self.alpha = alpha
        self.count = 0
        self.mean = 0.0

    def add(self, staleness: int) -> float:
        self.count += 1
        self.mean += (staleness - self.mean) * max(self.alpha, 1.0 / self.count)
        return self.mean

    def state_dict(self) -> dict:
        return {"alpha": self.alpha, "count": self.count, "mean": self.mean}

    def load_state_dict(self, state: dict) -> None:
        self.alpha = float(state["alpha"])
        self.count = int(state["count"])
        self.mean = float(state["mean"])


def implicit_momentum(mean_staleness: float) -> float:
    """The momentum asynchrony adds by itself at a mean staleness tau: 1 - 1/(tau + 1)
    (Mitliagkas et al. 2016, "Asynchrony begets momentum": with W workers applying in
    turn, tau = W - 1 and the implicit momentum is 1 - 1/W)."""
    return 1.0 - 1.0 / (1.0 + max(0.0, mean_staleness))


def explicit_momentum(momentum: float, mean_staleness: float) -> float:
    """The optimizer momentum the `momentum` policy applies at a mean staleness tau: the
    recipe's less what asynchrony adds (:func:`implicit_momentum`), down to 0, so that the
    total stays the recipe's (Mitliagkas et al.'s advice).

    Measured against the alternatives (docs/benchmarks/staleness.md): DynSGD's lr/(tau+1),
    lr raised to keep lr/(1-mu), and 1 - (1 - mu)(tau+1)/k for k = 2 and 4, which keep more
    momentum: as good on the synthetic MLP, unstable on the digits cnns.
    """
    return max(0.0, momentum - implicit_momentum(mean_staleness))


def dynamic_momentum(momentum: float, mean_staleness: float) -> float:
    """The optimizer momentum the `dynamic` policy applies at a mean staleness tau:
    1 - (1 - mu)(tau + 1), down to 0. A gradient's long-run step lr/(1 - mu) is then the
    recipe's divided by tau + 1, DynSGD's scaling (Jiang et al. 2017: lr/(tau+1)), reached
    through the momentum, so that a fresh gradient's own step stays the recipe's lr.
    (0.9 at tau 0, 0.6 at tau 3, 0.2 at tau 7, 0 from tau 9 on.)"""
    return max(0.0, 1.0 - (1.0 - momentum) * (1.0 + max(0.0, mean_staleness)))


@register("momentum")
class StalenessMomentum(Correction):
    """The optimizer's momentum lowered by the measured staleness (:func:`explicit_momentum`
    of an exponentially weighted mean of the staleness of applied gradients); the learning
    rate as given. The user's momentum is read from the optimizer at the first gradient,
    and an optimizer without momentum (sgd, adam) is left as it is."""

    rule = staticmethod(explicit_momentum)

    def __init__(self, dc_lambda: float = 0.04):
        super().__init__(dc_lambda)
        self.meter = StalenessMeter()
        self.momentum: Optional[float] = None

    def tune(self, optimizer, staleness):
        tau = self.meter.add(staleness)
        if not hasattr(optimizer, "momentum"):
            return
        if self.momentum is None:
            self.momentum = float(optimizer.momentum)
        optimizer.momentum = self.rule(self.momentum, tau)

    def state_dict(self) -> dict:
        """The staleness average so far. (Not the recipe's momentum: a resume reads it from
        its own optimizer, which --momentum sets, as a fresh run does.)"""
        return {"name": self.name, "meter": self.meter.state_dict()}

    def load_state_dict(self, state: dict) -> bool:
        if state.get("name") != self.name:
            return False
        self.meter.load_state_dict(state["meter"])
        return True


@register("dynamic")
class DynamicMomentum(StalenessMomentum):
    """As `momentum`, by :func:`dynamic_momentum`: the recipe's long-run step divided by the
    mean staleness + 1."""

    rule = staticmethod(dynamic_momentum)


def lookahead_momentum(momentum: float, mean_staleness: float) -> float:
    """The optimizer momentum the `lookahead` policy applies at a mean staleness tau:
    1 - (1 - mu)(1 + 0.7 tau), down to 0: a gradient's long-run step divided by 1 + 0.7 tau
    instead of `dynamic`'s tau + 1, since workers that compute on the parameters
    extrapolated by their staleness (weight prediction) meet less of it.
    (0.9 at tau 0, 0.69 at tau 3, 0.41 at tau 7, 0 from tau 12.9 on.)"""
    return max(0.0, 1.0 - (1.0 - momentum) * (1.0 + LOOKAHEAD_SHARE * max(0.0, mean_staleness)))


LOOKAHEAD_SHARE = 0.7
"""The share of the mean staleness `lookahead` divides a gradient's long-run step by."""

LOOKAHEAD_WARMUP = 40
"""Gradients over which `lookahead` ramps the learning rate up (1/40 of it for the first)."""


@register("lookahead")
class LookaheadMomentum(StalenessMomentum):
    """As `dynamic`, for workers that predict the parameters (--weight-prediction on):
    :func:`lookahead_momentum` keeps more of the recipe's momentum, and the learning rate
    ramps up linearly over the first `ramp` gradients applied (their measured staleness is
    not yet the run's, and the early gradients are the largest): LOOKAHEAD_WARMUP, or none
    where the run has a --warmup of its own (:func:`build_correction`)."""

    rule = staticmethod(lookahead_momentum)

    def __init__(self, dc_lambda: float = 0.04, ramp: int = LOOKAHEAD_WARMUP):
        super().__init__(dc_lambda)
        self.ramp = ramp

    def apply(self, grad, staleness, params_now, params_then, at=0):
        return min(1.0, self.meter.count / self.ramp) if self.ramp > 0 else 1.0


GAP_ALPHA = 0.05
"""Weight of each step in `gap`'s mean step per parameter (the plain mean for the first 20)."""

GAP_WARMUP = 20
"""Gradients over which `gap` ramps the learning rate up (half `lookahead`'s ramp: damped per
parameter, the first steps need less of it; 10 let the torch cnn fall behind once in ten)."""

GAP_BLOCK = 16384
"""`gap` works through a gradient this many floats at a time, so that the vectors it reads
stay in the core's cache across its dozen passes (2-core VM, 335k parameters, a ring of 4
workers' versions: 1.0 ms a push, against 1.3 ms in passes over each whole vector)."""


class Extrapolated:
    """The parameters a worker predicted, ``base + f (base - old)`` (``base`` the version it
    read, ``old`` the one it extrapolated from: core/prediction.py), left unbuilt: `gap`
    reads them a block at a time instead of a whole vector written and read again. Slicing
    gives the same slice of the prediction; ``np.asarray`` builds it (dc, tests)."""

    __slots__ = ("base", "old", "f")

    def __init__(self, base: np.ndarray, old: np.ndarray, f: float):
        self.base, self.old, self.f = base, old, np.float32(f)

    def __getitem__(self, span) -> "Extrapolated":
        return Extrapolated(self.base[span], self.old[span], self.f)

    def into(self, out: np.ndarray) -> np.ndarray:
        """Write the prediction into `out` (floats as the worker computed them)."""
        np.subtract(self.base, self.old, out=out)
        out *= self.f
        out += self.base
        return out

    def __array__(self, dtype=None, copy=None):
        out = self.into(np.empty_like(self.base))
        return out if dtype is None else out.astype(dtype, copy=False)


@register("gap")
class GapAware(LookaheadMomentum):
    """Gap-aware (Barkai et al. 2020, "Gap-Aware Mitigation of Gradient Staleness"), for
    workers that predict the parameters: each coordinate of a gradient is divided by
    max(1, G), G how far that parameter moved between the parameters the gradient was
    computed on (the worker's prediction of them, :class:`Extrapolated` from two versions it
    read) and the current ones, in units of its mean step. A parameter that moved as
    predicted, or oscillated, keeps its full step; one that ran ahead is damped.
    The recipe's momentum is kept; the learning rate ramps up over the first `ramp`
    gradients as under `lookahead`. The mean step (a float per parameter) is not in the
    checkpoint: a resumed run learns it again from its first steps."""

    needs_old_params = True
    reads_kept = 2
    rule = staticmethod(lambda momentum, mean_staleness: momentum)

    def __init__(self, dc_lambda: float = 0.04, ramp: int = GAP_WARMUP, alpha: float = GAP_ALPHA):
        super().__init__(dc_lambda, ramp)
        self.alpha = alpha
        self.mean_step: Optional[np.ndarray] = None   # |w_{k+1} - w_k| averaged, per parameter
        self.last: Optional[np.ndarray] = None        # the parameters at the last gradient
        self.scratch = np.empty(GAP_BLOCK, np.float32)
        self.ones = np.ones(GAP_BLOCK, np.float32)    # (fmin against a vector: twice as fast)
        self.moves = 0                                # steps seen in mean_step

    def bind(self, size):
        self.mean_step = np.zeros(size, np.float32)
        self.last = np.empty(size, np.float32)
        self.moves = -1   # `last` not yet set

    def tune(self, optimizer, staleness):
        self.meter.add(staleness)   # the recipe's momentum stays

    def apply(self, grad, staleness, params_now, params_then, at=0):
        if self.mean_step is None:
            self.bind(at + grad.size)
        if at == 0:
            self.moves += 1
        rate = np.float32(max(self.alpha, 1.0 / self.moves)) if self.moves > 0 else None
        damp = params_then is not None and rate is not None
        with np.errstate(divide="ignore", invalid="ignore"):
            for lo in range(0, grad.size, GAP_BLOCK):
                span = slice(lo, min(grad.size, lo + GAP_BLOCK))
                self._block(grad[span], params_now[span], params_then[span] if damp else None,
                            at + lo, rate)
        return super().apply(grad, staleness, params_now, params_then, at)

    def _block(self, grad, now, then, at, rate) -> None:
        """One block of :meth:`apply`, starting at `at` in the parameters."""
        span = slice(at, at + grad.size)
        s, mean, last = self.scratch[:grad.size], self.mean_step[span], self.last[span]
        if rate is not None:   # the step since the last gradient joins the mean
            np.subtract(now, last, out=s)
            np.abs(s, out=s)
            s -= mean
            s *= rate
            mean += s
        last[...] = now
        if then is None:
            return
        if isinstance(then, Extrapolated):   # prediction - now: the gap's sign does not count
            then.into(s)
            s -= now
        else:
            np.subtract(now, then, out=s)
        np.abs(s, out=s)
        np.divide(mean, s, out=s)   # 1/G: a gap of 0 is inf, 0/0 nan (both: no damping)
        np.fmin(s, self.ones[:grad.size], out=s)
        grad *= s


@register("dana")
class PerWorkerMomentum(LookaheadMomentum):
    """Each worker's gradients get a momentum vector of their own on the stores, stepped
    Nesterov's way (DANA-Zero: Hakimi et al. 2019, "Taming Momentum in a Distributed
    Asynchronous Environment"): ``v_i = mu v_i + g``, ``w -= lr (g + mu v_i)``. The
    parameters sent are then where every worker's momentum is carrying them (the look-ahead
    point), and a gradient's momentum decays at its own worker's pace, once per push of that
    worker, as a sync round's does, instead of once per gradient of any worker, which with
    the staleness made asynchrony's extra momentum. The recipe's momentum and learning rate
    are kept; the learning rate ramps up over the first `ramp` gradients as under
    `lookahead`. Costs the stores one velocity per worker (workers x the slice's floats)
    and nothing a push beyond the step. Workers that also predict the parameters
    (--weight-prediction on, the default) extrapolate from the look-ahead points they read.
    Needs a momentum optimizer (--optimizer momentum)."""

    rule = staticmethod(lambda momentum, mean_staleness: momentum)
    adds_implicit = False   # a velocity steps once a push of its own worker's, as in a round

    def tune(self, optimizer, staleness):
        self.meter.add(staleness)   # the recipe's momentum stays

    def source(self, optimizer, worker):
        if hasattr(optimizer, "select"):   # (config/validate: a momentum optimizer)
            optimizer.nesterov = True
            optimizer.select(worker)


MOMENTUM_DEFAULT = "dana"
"""The correction of async and ssp when --correction is not given and the workers predict
the parameters (--optimizer momentum, --weight-prediction not off), where its velocities
fit (:func:`dana_fits`)."""

DANA_DEFAULT_BYTES = 1 << 30
"""Up to this many bytes of velocities a store (workers x its slice x 4), `dana` is the
default; above it :func:`predicted_default`'s, which cost the stores nothing per worker."""


def dana_fits(slice_floats: int, workers: int) -> bool:
    """Whether `dana`'s velocities, one per worker, fit the default's budget on a store of
    `slice_floats` parameters (DANA_DEFAULT_BYTES)."""
    return max(1, workers) * slice_floats * 4 <= DANA_DEFAULT_BYTES


ASYNC_DEFAULT = "dynamic"
"""The correction of async and ssp when --correction is not given and the workers do not
predict the parameters (else MOMENTUM_DEFAULT)."""

PREDICTED_DEFAULT = "lookahead"
"""The correction of predicting workers where `dana`'s velocities do not fit, unless the
model is small enough for `gap` (:func:`predicted_default`, once its size is known)."""

GAP_DEFAULT_FLOATS = 65_536
"""Up to this many parameters a store (the largest slice), `gap` is the default where
PREDICTED_DEFAULT would be (config/build.settle_correction): its server work a push, about
3 ns a float on the 2-core VM (1.0 ms for 335k), is then at most 0.2 ms, a tenth of what rank
0 spends on a push besides (1.9 ms in the recipe of benchmarks/staleness.py); above it
`lookahead` keeps rank 0's time for the pushes (docs/benchmarks/staleness.md)."""


def predicted_default(slice_floats: int, wire: str) -> str:
    """The default correction of async and ssp where the workers predict the parameters,
    for stores of at most `slice_floats` parameters each and the run's --wire: `gap` while
    its server work is small and the parameters travel exact (GAP_DEFAULT_FLOATS, fp32),
    else PREDICTED_DEFAULT."""
    return "gap" if wire == "fp32" and slice_floats <= GAP_DEFAULT_FLOATS else PREDICTED_DEFAULT


MOMENTUM_RULES = {name: cls.rule for name, cls in CORRECTIONS.items() if hasattr(cls, "rule")}
"""Correction name -> (the recipe's momentum, mean staleness) -> the momentum applied, for
the corrections that set the optimizer's momentum from the measured staleness."""


def build_correction(name: str, dc_lambda: float = 0.04, own_warmup: bool = False) -> Correction:
    """The correction `name`; `own_warmup`: the run ramps its learning rate up itself
    (--warmup), which then replaces `lookahead`'s ramp instead of multiplying it."""
    try:
        cls = CORRECTIONS[name]
    except KeyError:
        raise UsageError(f"--correction {name!r}: allowed values are {', '.join(CORRECTIONS)}") from None
    if cls is GapAware:
        return cls(dc_lambda, ramp=0 if own_warmup else GAP_WARMUP)
    if cls in (LookaheadMomentum, PerWorkerMomentum):
        return cls(dc_lambda, ramp=0 if own_warmup else LOOKAHEAD_WARMUP)
    return cls(dc_lambda)
