"""The built-in classifiers, written once for NumPy and CuPy (``xp`` idiom).

They follow the public protocol of :class:`mpilb.Model` like any user model does.

Every model keeps all its parameters in ONE contiguous flat vector (what the server and the
workers send as a single buffer); each layer's weights are reshaped views into it, and the
gradient is written through the same views into one flat gradient vector.

The loss is the softmax cross-entropy SUMMED over the batch, so that gradients from batches
of different sizes add up correctly on the server (it divides by the global batch).

Models: ``softmax`` (multinomial logistic regression), ``mlp`` (ReLU hidden layers) and
``cnn`` (two conv3x3+ReLU+maxpool2x2 blocks with 16 and 32 channels, then a dense layer).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from mpilb.backend import get_array_module
from mpilb.errors import UsageError
from mpilb.models.base import Model

MODELS: dict[str, Callable[..., "FlatClassifier"]] = {}


def register_model(name: str):
    """Class decorator adding a model to :data:`MODELS` under ``name``."""

    def deco(cls):
        cls.name = name
        MODELS[name] = cls
        return cls

    return deco


def build_builtin(
    name: str,
    input_shape: tuple,
    num_classes: int,
    hidden: tuple[int, ...] = (256, 128),
) -> "FlatClassifier":
    """Build a registered built-in model.

    Args:
        name: one of :data:`MODELS` ("softmax", "mlp", "cnn").
        input_shape: shape of one sample, e.g. ``(64,)`` or ``(1, 8, 8)``.
        num_classes: number of output classes (>= 2).
        hidden: hidden layer widths; used by ``mlp`` only (the cnn's channels are fixed).

    Raises:
        UsageError: unknown name, or bad shapes or sizes.
    """
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}; valid models: {', '.join(sorted(MODELS))}")
    input_shape = tuple(int(d) for d in input_shape)
    if not input_shape or any(d <= 0 for d in input_shape):
        raise UsageError(f"model {name}: bad sample shape {input_shape}; dimensions must be > 0")
    if int(num_classes) < 2:
        raise UsageError(f"model {name}: num_classes must be >= 2, got {num_classes}")
    return MODELS[name](input_shape, int(num_classes), tuple(hidden))


# ---------------------------------------------------------------------------------------
# Shared pieces


def _he(rng, shape, fan_in):
    """He-normal init, the right scale for layers followed by a ReLU."""
    return rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)


def _glorot(rng, shape, fan_in, fan_out):
    """Glorot-uniform init for the linear output layer."""
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape)


def _softmax_xent(z, y):
    """Sum of softmax cross-entropy over the batch and its gradient w.r.t. the logits.

    ``z`` (batch, classes) is overwritten with the gradient (softmax - onehot); the
    log-softmax is computed stably by subtracting each row's max first.
    """
    xp = get_array_module(z)
    rows = xp.arange(z.shape[0])
    z -= z.max(axis=1, keepdims=True)
    picked = z[rows, y].sum()
    xp.exp(z, out=z)
    norm = z.sum(axis=1)
    loss = float(xp.log(norm).sum() - picked)
    z /= norm[:, None]
    z[rows, y] -= 1
    return loss, z


def _dense_backward(h, dz, gW, gb, W=None):
    """Write dL/dW and dL/db into the gradient views; return dL/dh if ``W`` is given."""
    xp = get_array_module(dz)
    xp.matmul(h.T, dz, out=gW)
    xp.sum(dz, axis=0, out=gb)
    return None if W is None else dz @ W.T


class FlatClassifier(Model):
    """A classifier over a flat parameter vector (the built-ins' shared machinery).

    Subclasses call ``_set_layout`` and implement ``_forward``/``_backward``/``_init``.

    Attributes:
        name: registry name.
        input_shape: shape of one sample as given by the dataset.
        num_classes: number of classes.
        num_params: length of the flat vector.
    """

    name = "model"
    metric = "accuracy"

    def __init__(self, input_shape: tuple[int, ...], num_classes: int):
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        self.in_features = int(np.prod(self.input_shape))
        self._layout: list[tuple[str, tuple[int, ...]]] = []

    def _set_layout(self, layout):
        self._layout = [(n, tuple(int(d) for d in s)) for n, s in layout]
        self.num_params = int(sum(math.prod(s) for _, s in self._layout))

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of each parameter array, in order inside the flat vector."""
        return list(self._layout)

    def signature(self) -> dict:
        return {"model": self.name, "num_params": int(self.num_params),
                "input_shape": list(self.input_shape), "num_classes": int(self.num_classes),
                "layout": [[name, list(shape)] for name, shape in self._layout]}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_shape={self.input_shape}, "
                f"num_classes={self.num_classes}, num_params={self.num_params})")

    def views(self, flat) -> dict:
        """Reshaped views (no copies) of each parameter array inside ``flat``."""
        if flat.shape != (self.num_params,):
            raise ValueError(f"{self.name}: expected a flat vector of {self.num_params} "
                             f"parameters, got shape {flat.shape}")
        out, pos = {}, 0
        for name, shape in self._layout:
            n = math.prod(shape)
            out[name] = flat[pos:pos + n].reshape(shape)
            pos += n
        return out

    def init_params(self, seed: int) -> np.ndarray:
        """Seeded initial parameters as a float32 host vector (He for ReLU layers,
        Glorot for the output layer, zero biases)."""
        rng = np.random.default_rng(seed)
        flat = np.zeros(self.num_params, dtype=np.float32)
        for name, value in self._init(rng).items():
            self.views(flat)[name][...] = value
        return flat

    def _prepare(self, params, x):
        xp = get_array_module(params)
        x = xp.asarray(x, dtype=params.dtype)
        return x.reshape(x.shape[0], self.in_features)

    def logits(self, params, x):
        """Logits (batch, num_classes) for samples ``x`` (any shape with batch first)."""
        logits, _ = self._forward(self.views(params), self._prepare(params, x))
        return logits

    def loss_and_grad(self, params, x, y, out=None):
        """Summed softmax cross-entropy over the batch and its gradient.

        Args:
            params: flat parameter vector (float32 or float64, numpy or cupy).
            x: samples, (batch, *input_shape) or (batch, prod(input_shape)); cast to
                ``params.dtype``.
            y: integer labels (batch,).
            out: optional flat array (same dtype as params) to write the gradient into.

        Returns:
            ``(loss, grad)``: loss as a Python float (sum, not mean) and the flat gradient.
        """
        xp = get_array_module(params)
        if out is None:
            out = xp.empty_like(params)  # every entry is written below
        y = xp.asarray(y)
        logits, cache = self._forward(self.views(params), self._prepare(params, x))
        loss, dz = _softmax_xent(logits, y)
        self._backward(self.views(params), self.views(out), cache, dz)
        return loss, out

    def evaluate(self, params, x, y, batch_size: int = 4096) -> dict:
        """``{"loss": mean loss, "accuracy": ...}`` over all of ``x``, in batches."""
        xp = get_array_module(params)
        n = len(x)
        if n == 0:
            return {"loss": float("nan"), "accuracy": float("nan")}
        total_loss, correct = 0.0, 0
        for start in range(0, n, batch_size):
            yb = xp.asarray(y[start:start + batch_size])
            z = self.logits(params, x[start:start + batch_size])
            correct += int((z.argmax(axis=1) == yb).sum())
            total_loss += _softmax_xent(z, yb)[0]
        return {"loss": total_loss / n, "accuracy": correct / n}

    # Subclass hooks -----------------------------------------------------------------
    def _init(self, rng) -> dict:
        raise NotImplementedError

    def _forward(self, v, x):
        """Return (logits, cache); ``x`` is (batch, in_features) in params' dtype."""
        raise NotImplementedError

    def _backward(self, v, g, cache, dz) -> None:
        """Write the gradient through the views ``g`` given dL/dlogits ``dz``."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------
# Dense models


@register_model("mlp")
class MLP(FlatClassifier):
    """Flattened input, ReLU hidden layers of widths ``hidden``, linear output layer."""

    def __init__(self, input_shape, num_classes, hidden=(256, 128)):
        super().__init__(input_shape, num_classes)
        hidden = tuple(hidden)
        if not hidden or any(int(h) != h or h <= 0 for h in hidden):
            raise UsageError(f"model {self.name}: hidden sizes must be one or more positive "
                             f"integers, e.g. --hidden 256,128; got {hidden}")
        self.hidden = tuple(int(h) for h in hidden)
        widths = (self.in_features, *self.hidden, num_classes)
        layout = []
        for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
            layer = "out" if i == len(widths) - 2 else f"dense{i + 1}"
            layout += [(f"{layer}.W", (fan_in, fan_out)), (f"{layer}.b", (fan_out,))]
        self._set_layout(layout)
        self._layers = [n[:-2] for n, _ in layout[::2]]

    def _init(self, rng):
        init = {}
        shapes = dict(self._layout)
        for layer in self._layers:
            fan_in, fan_out = shapes[f"{layer}.W"]
            if layer == "out":
                init[f"{layer}.W"] = _glorot(rng, (fan_in, fan_out), fan_in, fan_out)
            else:
                init[f"{layer}.W"] = _he(rng, (fan_in, fan_out), fan_in)
        return init

    def _forward(self, v, x):
        xp = get_array_module(x)
        acts = [x]
        h = x
        for layer in self._layers:
            z = h @ v[f"{layer}.W"]
            z += v[f"{layer}.b"]
            if layer != "out":
                xp.maximum(z, 0, out=z)
            acts.append(z)
            h = z
        return h, acts[:-1]

    def _backward(self, v, g, acts, dz):
        for i in range(len(self._layers) - 1, -1, -1):
            layer = self._layers[i]
            W = v[f"{layer}.W"] if i > 0 else None  # no gradient w.r.t. the input
            dh = _dense_backward(acts[i], dz, g[f"{layer}.W"], g[f"{layer}.b"], W)
            if dh is not None:
                dh *= acts[i] > 0  # ReLU: the stored activation is post-ReLU
                dz = dh


@register_model("softmax")
class Softmax(MLP):
    """Multinomial logistic regression on the flattened input (an mlp without hidden layers)."""

    def __init__(self, input_shape, num_classes, hidden=()):
        FlatClassifier.__init__(self, input_shape, num_classes)
        self.hidden = ()  # ``hidden`` is accepted for a uniform signature and ignored
        self._set_layout([("out.W", (self.in_features, num_classes)),
                          ("out.b", (num_classes,))])
        self._layers = ["out"]


# ---------------------------------------------------------------------------------------
# Convolutional model


def _image_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(C, H, W) for the cnn, or UsageError; a flat perfect square n*n becomes (1, n, n)."""
    if len(shape) == 1 and math.isqrt(shape[0]) ** 2 == shape[0]:
        side = math.isqrt(shape[0])
        shape = (1, side, side)
    elif len(shape) == 2:
        shape = (1, *shape)
    if len(shape) != 3 or shape[1] % 4 or shape[2] % 4:
        raise UsageError(
            f"model cnn needs image-shaped samples (C, H, W) with H and W divisible by 4 "
            f"(or a flat perfect square such as 64 = 1x8x8); got sample shape {shape}; "
            f"use --model mlp for this data")
    return shape


def _im2col(x, out=None):
    """NHWC batch -> (batch*H*W, 9*C) patch matrix for a 3x3 convolution with padding 1.

    The column order is (kernel row, kernel col, channel), matching HWIO weights reshaped
    to (9*C, C_out). Nine strided slice copies: vectorised over samples, works on cupy.
    """
    xp = get_array_module(x)
    b, h, w, c = x.shape
    padded = xp.zeros((b, h + 2, w + 2, c), dtype=x.dtype)
    padded[:, 1:-1, 1:-1, :] = x
    cols = xp.empty((b, h, w, 3, 3, c), dtype=x.dtype) if out is None else out
    for i in range(3):
        for j in range(3):
            cols[:, :, :, i, j, :] = padded[:, i:i + h, j:j + w, :]
    return cols.reshape(b * h * w, 9 * c)


def _col2im(dcols, shape):
    """Adjoint of :func:`_im2col`: sum patch gradients back into an NHWC gradient."""
    xp = get_array_module(dcols)
    b, h, w, c = shape
    dcols = dcols.reshape(b, h, w, 3, 3, c)
    dpad = xp.zeros((b, h + 2, w + 2, c), dtype=dcols.dtype)
    for i in range(3):
        for j in range(3):
            dpad[:, i:i + h, j:j + w, :] += dcols[:, :, :, i, j, :]
    return dpad[:, 1:-1, 1:-1, :]


def _maxpool2(a):
    """2x2 max-pool of an NHWC batch; returns the pooled batch and the window view."""
    b, h, w, c = a.shape
    windows = a.reshape(b, h // 2, 2, w // 2, 2, c)
    return windows.max(axis=(2, 4)), windows


def _maxpool2_backward(windows, pooled, dpooled):
    """Route each pooled gradient to its window's max (ties only occur at ReLU zeros,
    where the ReLU mask discards the gradient anyway)."""
    mask = windows == pooled[:, :, None, :, None, :]
    grad = mask * dpooled[:, :, None, :, None, :]
    b, h2, _, w2, _, c = windows.shape
    return grad.reshape(b, 2 * h2, 2 * w2, c)


@register_model("cnn")
class CNN(FlatClassifier):
    """conv3x3(16)+ReLU+maxpool2 -> conv3x3(32)+ReLU+maxpool2 -> dense to the classes.

    Channels are fixed at 16 and 32 (``hidden`` is ignored): the model targets small images
    such as digits (1x8x8). Weights are stored HWIO, (3, 3, C_in, C_out), and activations are
    NHWC internally so that im2col and the matmuls need no transposes.
    """

    channels = (16, 32)

    def __init__(self, input_shape, num_classes, hidden=()):
        super().__init__(input_shape, num_classes)
        self.image_shape = _image_shape(self.input_shape)
        c, h, w = self.image_shape
        c1, c2 = self.channels
        self._set_layout([
            ("conv1.W", (3, 3, c, c1)), ("conv1.b", (c1,)),
            ("conv2.W", (3, 3, c1, c2)), ("conv2.b", (c2,)),
            ("out.W", ((h // 4) * (w // 4) * c2, num_classes)), ("out.b", (num_classes,)),
        ])

    def _init(self, rng):
        shapes = dict(self._layout)
        fan_in, fan_out = shapes["out.W"]
        return {
            "conv1.W": _he(rng, shapes["conv1.W"], 9 * shapes["conv1.W"][2]),
            "conv2.W": _he(rng, shapes["conv2.W"], 9 * shapes["conv2.W"][2]),
            "out.W": _glorot(rng, (fan_in, fan_out), fan_in, fan_out),
        }

    @staticmethod
    def _conv_relu(x, W, b):
        xp = get_array_module(x)
        cols = _im2col(x)
        z = cols @ W.reshape(-1, W.shape[-1])
        z += b
        xp.maximum(z, 0, out=z)
        return z.reshape(*x.shape[:3], W.shape[-1]), cols

    def _forward(self, v, x):
        c, h, w = self.image_shape
        x = x.reshape(-1, c, h, w).transpose(0, 2, 3, 1)  # NCHW -> NHWC (a view)
        a1, cols1 = self._conv_relu(x, v["conv1.W"], v["conv1.b"])
        p1, win1 = _maxpool2(a1)
        a2, cols2 = self._conv_relu(p1, v["conv2.W"], v["conv2.b"])
        p2, win2 = _maxpool2(a2)
        flat = p2.reshape(p2.shape[0], -1)
        z = flat @ v["out.W"]
        z += v["out.b"]
        return z, (cols1, a1, p1, win1, cols2, a2, p2, win2, flat)

    def _backward(self, v, g, cache, dz):
        cols1, a1, p1, win1, cols2, a2, p2, win2, flat = cache
        dflat = _dense_backward(flat, dz, g["out.W"], g["out.b"], v["out.W"])
        da2 = _maxpool2_backward(win2, p2, dflat.reshape(p2.shape))
        da2 *= a2 > 0
        dz2 = da2.reshape(-1, da2.shape[-1])
        W2 = v["conv2.W"]
        dcols2 = _dense_backward(cols2, dz2, g["conv2.W"].reshape(-1, W2.shape[-1]),
                                 g["conv2.b"], W2.reshape(-1, W2.shape[-1]))
        dp1 = _col2im(dcols2, p1.shape)
        da1 = _maxpool2_backward(win1, p1, dp1)
        da1 *= a1 > 0
        dz1 = da1.reshape(-1, da1.shape[-1])
        _dense_backward(cols1, dz1, g["conv1.W"].reshape(-1, v["conv1.W"].shape[-1]),
                        g["conv1.b"])
