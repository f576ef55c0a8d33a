"""In-place optimizers on flat parameter vectors (``xp`` idiom: numpy or cupy).

The parameter server calls :meth:`Optimizer.step` thousands of times per second on vectors
of millions of parameters, so a step allocates nothing: every optimizer preallocates its
state and its scratch at construction and updates through ``out=`` ufuncs.

On the host a step is also one pass over memory: the vectors are walked in blocks of
:data:`BLOCK` elements, and every ufunc of the update runs on one block (a few hundred kB
for all the vectors together, which stay in the core's L2 cache) before the next block is
touched. Main memory then sees each of params, grad and the state vectors read once and
written once per step, where whole-vector ufuncs would stream them ten times over (Adam:
10 ufuncs). The arithmetic, and so the result, is the same element by element. On a GPU
(cupy) the whole vector is one block: kernels launch per call, and the device has the
bandwidth.

Adam on a large host vector, with PyTorch installed, steps with torch's fused CPU kernel
instead (through the torch adapter, the one module that imports torch) (see :data:`FUSED_MIN_PARAMS`): one vectorised pass, 2.6x faster than the blocks.
Its moments are kept as torch keeps them; checkpoints and the transfers between parameter
stores use one form (:meth:`Optimizer.state_slice`), so kernels may differ between ranks.

Weight decay is classic L2 regularisation: ``weight_decay * params`` is added to the
gradient before the update (so with adam it is scaled by the adaptive denominator), except
for adamw, whose decay is decoupled (as torch.optim.AdamW). The caller's ``grad`` is never
modified.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Optional

import numpy as np

from mpilb.core.velocities import PerKeyVelocity
from mpilb.errors import UsageError

OPTIMIZERS: dict[str, Callable[..., "Optimizer"]] = {}

FUSED_MIN_PARAMS = 1 << 16
"""Adam on at least this many host float32 parameters steps with PyTorch's fused CPU kernel when
torch is installed (one vectorised pass: 0.6 ms on 10^6 floats here, against 1.6 ms for the
ten numpy ufuncs per block; smaller vectors gain nothing). ``MPILB_FUSED_ADAM=0``: off."""

BLOCK = 32768
"""Elements per block of a host step. Adam's blocks of params, grad, two moments and two
scratch vectors (float32) take 768 kB together, inside a 2 MB L2 cache; blocks of 8k
elements and fewer cost more in ufunc calls than they save (measured on 10^6 params)."""


def register_optimizer(name: str):
    """Class decorator adding an optimizer to :data:`OPTIMIZERS` under ``name``."""

    def deco(cls):
        cls.name = name
        OPTIMIZERS[name] = cls
        return cls

    return deco


def _to_host(a) -> np.ndarray:
    """Host copy of a numpy or cupy array (without importing cupy)."""
    return a.get() if hasattr(a, "get") else np.array(a, copy=True)


def _check(ok: bool, option: str, value, allowed: str) -> None:
    if not ok:
        raise UsageError(f"--{option} {value!r}: must be {allowed}")


def build_optimizer(
    name: str,
    num_params: int,
    *,
    lr: float,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    xp=np,
    dtype=np.float32,
) -> "Optimizer":
    """Build a registered optimizer with its state allocated on ``xp``.

    Args:
        name: "sgd", "momentum" (heavy-ball; ``nesterov=True`` for Nesterov), "adam" or
            "adamw" (decoupled weight decay).
        num_params: length of the flat parameter vector.
        lr: learning rate (> 0).
        momentum: momentum factor in [0, 1) ("momentum" only).
        nesterov: Nesterov momentum ("momentum" only).
        weight_decay: L2 factor (>= 0) added to the gradient as ``weight_decay * params``
            (adamw: the decoupled decay factor).
        beta1, beta2, eps: Adam's moment decay rates, in [0, 1), and denominator epsilon (> 0).
        xp: array module (numpy or cupy) the parameters live in.
        dtype: dtype of the parameters and the optimizer state.

    Raises:
        UsageError: unknown name or a value out of range.
    """
    if name not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer {name!r}; valid optimizers: "
                         f"{', '.join(sorted(OPTIMIZERS))}")
    _check(math.isfinite(lr) and lr > 0, "lr", lr, "a positive number")
    _check(0 <= momentum < 1, "momentum", momentum, "in [0, 1)")
    _check(math.isfinite(weight_decay) and weight_decay >= 0, "weight-decay", weight_decay, ">= 0")
    _check(0 <= beta1 < 1, "beta1", beta1, "in [0, 1)")
    _check(0 <= beta2 < 1, "beta2", beta2, "in [0, 1)")
    _check(eps > 0, "eps", eps, "a positive number")
    if int(num_params) <= 0:
        raise UsageError(f"optimizer {name}: num_params must be positive, got {num_params}")
    return OPTIMIZERS[name](
        int(num_params), lr=float(lr), momentum=float(momentum), nesterov=bool(nesterov),
        weight_decay=float(weight_decay), beta1=float(beta1), beta2=float(beta2),
        eps=float(eps), xp=xp, dtype=dtype)


class Optimizer:
    """Base class: holds hyperparameters, the state vectors and block-sized scratch.

    Subclasses implement ``_update(params, grad, lr, out)`` and list their state arrays in
    ``_buffers``; :meth:`_blocks` walks the vectors block by block. Hyperparameters are not
    part of the state: a resumed run takes them from its (validated) configuration.

    ``out`` is where the new parameters go: ``params`` itself (in place), another vector
    (the server steps into a free buffer while a send still reads the current one), or
    ``grad`` (the server's cheapest out-of-place step: the gradient's buffer, read anyway,
    is written instead of a third vector, so memory sees no extra stream). Every
    ``_update`` therefore reads each block of ``grad`` before it writes that block of
    ``out``, and never reads ``params`` after writing ``out``; the floats are the same
    whichever ``out`` is given.
    """

    name = "optimizer"
    _buffers: tuple[str, ...] = ()
    _scratch_vectors = 1
    _block = BLOCK     # elements per block of a host step
    into_grad = True   # ``out=grad`` costs no more than in place (see above)

    def _scale(self, buf: str) -> float:
        """State as checkpointed = ``_scale(buf)`` x state as kept (1: kept as it is)."""
        return 1.0

    def __init__(self, num_params, *, lr, weight_decay=0.0, xp=np, dtype=np.float32, **_):
        self.num_params = num_params
        self.lr = lr
        self.weight_decay = weight_decay
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self.steps = 0
        for buf in self._buffers:
            setattr(self, buf, xp.zeros(num_params, dtype=self.dtype))
        block = min(num_params, self._block) if xp is np else num_params
        scratch = [xp.empty(block, dtype=self.dtype) for _ in range(self._scratch_vectors)]
        # Per block: its span, views of the state vectors and of the scratch (the views
        # stay valid: load_state_dict writes into the same buffers).
        self._spans = []
        for lo in range(0, num_params, block):
            hi = min(lo + block, num_params)
            views = tuple(getattr(self, buf)[lo:hi] for buf in self._buffers)
            views += tuple(s[:hi - lo] for s in scratch)
            self._spans.append((lo, hi, views))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lr={self.lr}, weight_decay={self.weight_decay})"

    ranged = True   # step_range steps a part of the vector (False: whole steps only)
    _only: Optional[tuple[int, int]] = None   # the part step_range steps now

    def _walk(self):
        """The blocks ``(lo, hi, views)`` a step visits: every one, or during
        :meth:`step_range` the parts of those that overlap its range."""
        if self._only is None:
            yield from self._spans
            return
        a, b = self._only
        for lo, hi, views in self._spans:
            if hi <= a or lo >= b:
                continue
            x, y = max(lo, a), min(hi, b)
            yield x, y, tuple(v[x - lo:y - lo] for v in views)

    def _blocks(self, params, grad, out):
        """For each block: ``(params, decayed grad, out, *state, *scratch)`` blocks.

        The decayed gradient is ``grad + weight_decay * params`` in the first scratch
        block, or the ``grad`` block itself without weight decay.
        """
        wd = self.weight_decay
        for lo, hi, views in self._walk():
            p, g = params[lo:hi], grad[lo:hi]
            if wd:
                s = views[len(self._buffers)]
                self.xp.multiply(p, wd, out=s)
                s += g
                g = s
            yield (p, g, out[lo:hi]) + views

    def step(self, params, grad, lr_scale: float = 1.0, out=None) -> None:
        """Update ``params`` from ``grad`` with learning rate ``lr * lr_scale``: in place, or
        with ``out`` (a vector of the same length, which may be ``grad`` itself: the gradient
        is then consumed) written there, ``params`` left as it was."""
        self.steps += 1
        self._update(params, grad, self.lr * lr_scale, params if out is None else out)

    def step_range(self, params, grad, lr_scale: float, out, lo: int, hi: int,
                   first: bool) -> None:
        """The part [lo, hi) of one :meth:`step` (``out`` given; `first`: the step's first
        part, which counts it). The optimizers are elementwise, so a step taken in parts
        that cover the vector once gives the same floats as the whole step."""
        if first:
            self.steps += 1
        self._only = (lo, hi)
        try:
            self._update(params, grad, self.lr * lr_scale, out)
        finally:
            self._only = None

    def _update(self, params, grad, lr: float, out) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Everything needed to resume: name, step count and state vectors (host copies)."""
        state = {"name": self.name, "steps": self.steps}
        for buf in self._buffers:
            state[buf] = _to_host(getattr(self, buf))
            if self._scale(buf) != 1.0:
                state[buf] *= self._scale(buf)
        return state

    def state_slice(self, buf: str, lo: int, hi: int) -> np.ndarray:
        """A host copy of ``buf``'s elements [lo, hi) as checkpointed (the same floats
        whichever kernel keeps them: parameter stores of one run may differ in that)."""
        return _to_host(getattr(self, buf)[lo:hi]) * np.float32(self._scale(buf))

    def load_state_slice(self, buf: str, lo: int, hi: int, values) -> None:
        """Set ``buf``'s elements [lo, hi) from values as :meth:`state_slice` gives them."""
        getattr(self, buf)[lo:hi] = self.xp.asarray(np.asarray(values) / np.float32(self._scale(buf)),
                                                     dtype=self.dtype)

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (into the existing buffers).

        Raises:
            UsageError: the state belongs to another optimizer or parameter count.
        """
        if state.get("name") != self.name:
            raise UsageError(f"optimizer state is for {state.get('name')!r}, but this run "
                             f"uses {self.name!r}; use the same --optimizer as the checkpoint")
        for buf in self._buffers:
            value = np.asarray(state[buf])
            if value.shape != (self.num_params,):
                raise UsageError(f"optimizer state {buf!r} has shape {value.shape}, expected "
                                 f"({self.num_params},); the checkpoint is for another model")
            getattr(self, buf)[...] = self.xp.asarray(value / self._scale(buf), dtype=self.dtype)
        self.steps = int(state["steps"])


@register_optimizer("sgd")
class SGD(Optimizer):
    """Plain SGD: ``params -= lr * (grad + wd * params)``."""

    # two vectors and one scratch block: blocks twice as long stay in the same cache, for
    # half the ufunc calls (a step into the gradient on 10^6 floats: 0.405 -> 0.369 ms;
    # momentum and adam, with more vectors, do not gain)
    _block = 2 * BLOCK

    def _update(self, params, grad, lr, out):
        xp = self.xp
        shrink = 1.0 - lr * self.weight_decay
        in_place = out is params
        for lo, hi, (s,) in self._walk():
            p, o = params[lo:hi], out[lo:hi]
            if self.weight_decay:
                # p - lr*(g + wd*p) == p*(1 - lr*wd) - lr*g: one ufunc fewer than g + wd*p
                xp.multiply(grad[lo:hi], lr, out=s)
                xp.multiply(p, shrink, out=o)
                o -= s
            elif in_place:
                xp.multiply(grad[lo:hi], lr, out=s)
                p -= s
            else:
                # p - lr*g == (-lr)*g + p exactly (IEEE): no scratch, and into `grad`'s
                # block (out is grad) both ufuncs run in place
                xp.multiply(grad[lo:hi], -lr, out=o)
                o += p


@register_optimizer("momentum")
class Momentum(PerKeyVelocity, Optimizer):
    """Heavy-ball momentum (PyTorch convention).

    ``v = momentum * v + g``; then ``params -= lr * v``, or with Nesterov
    ``params -= lr * (g + momentum * v)``, where ``g = grad + wd * params``; ``select(key)``:
    a velocity of the key's own (velocities.py)."""

    _buffers = ("velocity",)

    def __init__(self, num_params, *, momentum=0.9, nesterov=False, **kw):
        super().__init__(num_params, **kw)
        self.momentum, self.nesterov = momentum, nesterov
        self._own_init()

    def _update(self, params, grad, lr, out):
        xp, mu = self.xp, self.momentum
        for p, g, o, v, s in self._blocks(params, grad, out):
            v *= mu
            v += g
            if self.nesterov:
                # p - lr*g, then - lr*mu*v, through the one scratch block (which may hold g
                # itself; g is read before o, which may be g's block, is written)
                xp.multiply(g, lr, out=s)
                xp.subtract(p, s, out=o)
                xp.multiply(v, lr * mu, out=s)
                o -= s
            else:
                xp.multiply(v, lr, out=s)
                xp.subtract(p, s, out=o)


@register_optimizer("adam")
class Adam(Optimizer):
    """Adam with bias correction (Kingma & Ba; the PyTorch formulation).

    ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g`` with ``g = grad + wd * params``;
    ``params -= lr / (1-b1**t) * m / (sqrt(v / (1-b2**t)) + eps)``, t = step count.

    The moments are kept divided by their weights, ``exp_avg = m / (1-b1)`` and
    ``exp_avg_sq = v / (1-b2)``, so that each update is ``M = b1*M + g``: two ufuncs
    instead of three for ``m`` and three instead of four for ``v`` (10 per block in all;
    the constant factors go into the step's scalars). Checkpoints hold ``m`` and ``v``
    themselves (:meth:`state_dict` multiplies, :meth:`load_state_dict` divides).
    """

    _buffers = ("exp_avg", "exp_avg_sq")
    _scratch_vectors = 2

    def __init__(self, num_params, *, beta1=0.9, beta2=0.999, eps=1e-8, **kw):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        super().__init__(num_params, **kw)
        self._fused = None
        if self.xp is np and self.dtype == np.float32 and num_params >= FUSED_MIN_PARAMS:
            self.use_fused(_fused_adam())

    def use_fused(self, kernel) -> None:
        """Step with `kernel` (the torch adapter's FusedAdam class), or with the numpy
        blocks (None). Only before the first step: the two keep the moments differently."""
        assert self.steps == 0
        self._fused = None if kernel is None else kernel(self.exp_avg, self.exp_avg_sq)
        self.into_grad = kernel is None   # the fused kernel steps in place only
        self.ranged = kernel is None      # ... and the whole vector at once

    @property
    def kernel(self) -> str:
        """"torch-fused" or "numpy" (what steps this optimizer)."""
        return "numpy" if self._fused is None else "torch-fused"

    def _scale(self, buf: str) -> float:
        if getattr(self, "_fused", None) is not None:   # it keeps m and v themselves
            return 1.0
        return 1.0 - (self.beta1 if buf == "exp_avg" else self.beta2)

    def _update(self, params, grad, lr, out):
        if self._fused is not None:
            self._fused_step(params, grad, lr, out, self.weight_decay)
        else:
            self._update_blocks(params, grad, lr, out)

    def _fused_step(self, params, grad, lr, out, weight_decay, shrink=1.0):
        if out is not params:   # in place only: out starts as a copy of params
            if out is grad:    # (the server avoids this case: into_grad is False)
                grad = grad.copy()
            out[...] = params
        if shrink != 1.0:
            out *= shrink
        self._fused(out, grad, self.steps, lr, self.beta1, self.beta2, weight_decay, self.eps)

    def _update_blocks(self, params, grad, lr, out, shrink=1.0):
        """The update block by block; with ``shrink`` (AdamW's decay) from ``params * shrink``."""
        xp, b1, b2 = self.xp, self.beta1, self.beta2
        bias1 = 1.0 - b1 ** self.steps
        bias2 = 1.0 - b2 ** self.steps
        # With m = (1-b1)*M and v = (1-b2)*V, m/bias1 / (sqrt(v/bias2) + eps)
        # == M / (sqrt(V) + eps/c) * (1-b1)/(bias1*c), where c = sqrt((1-b2)/bias2)
        c = math.sqrt((1.0 - b2) / bias2)
        eps, scale = self.eps / c, lr * (1.0 - b1) / (bias1 * c)
        for p, g, o, m, v, d, s in self._blocks(params, grad, out):
            m *= b1
            m += g
            xp.square(g, out=s)      # a unary ufunc: cheaper than multiply(g, g)
            v *= b2
            v += s
            xp.sqrt(v, out=s)
            s += eps
            xp.divide(m, s, out=s)
            s *= scale
            if shrink != 1.0:        # AdamW (no L2 term, so the first scratch block is free)
                xp.multiply(p, shrink, out=d)
                p = d
            xp.subtract(p, s, out=o)


@register_optimizer("adamw")
class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter; as ``torch.optim.AdamW``):
    ``params *= 1 - lr * weight_decay``, then Adam's update of the plain gradient."""

    def __init__(self, num_params, *, weight_decay=0.0, **kw):
        super().__init__(num_params, weight_decay=0.0, **kw)   # the blocks add no L2 term
        self.decay = weight_decay

    def _update(self, params, grad, lr, out):
        shrink = 1.0 - lr * self.decay
        if self._fused is not None:
            return self._fused_step(params, grad, lr, out, 0.0, shrink)
        self._update_blocks(params, grad, lr, out, shrink)


def clip_grad_norm(grad, max_norm, xp=np) -> None:
    """Scale ``grad`` in place to L2 norm ``max_norm`` when longer, as
    ``torch.nn.utils.clip_grad_norm_`` (by ``max_norm / (norm + 1e-6)``, at most 1);
    nothing when ``max_norm`` is None (no --clip-norm)."""
    if max_norm is not None:
        factor = max_norm / (float(xp.sqrt(xp.vdot(grad, grad))) + 1e-6)
        if factor < 1.0:
            grad *= grad.dtype.type(factor)


_FUSED: list = []   # [FusedAdam class or None], decided once per process


def _fused_adam():
    """The torch adapter's FusedAdam, when torch is installed and its kernel steps like
    :class:`Adam`'s numpy blocks (checked once on a few floats: a private kernel may change
    between releases); None without torch, with ``MPILB_FUSED_ADAM=0``, or when the check
    fails."""
    if not _FUSED:
        kernel = None
        if os.environ.get("MPILB_FUSED_ADAM", "1") != "0":
            try:
                from mpilb.models.torch_adapter import checked_fused_adam
            except ImportError:
                pass
            else:
                kernel = checked_fused_adam(Adam)
        _FUSED.append(kernel)
    return _FUSED[0]
