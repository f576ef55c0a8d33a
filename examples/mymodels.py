"""A NumPy-only user model: the worked example of the ``mpilb.Model`` protocol.

    PYTHONPATH=examples mpiexec -n 4 mpilb train --data d --model mymodels:Linear

``Linear`` is a linear layer trained with softmax cross entropy on class labels or with
squared error on float targets. It runs on NumPy and, unchanged, on CuPy arrays (the ``xp``
idiom), because every array operation goes through the arrays' own module.
"""

import numpy as np

import mpilb


class Linear(mpilb.Model):
    """y = x W + b on flattened samples; ``scale`` multiplies the initial weights."""

    def __init__(self, input_shape, num_classes, num_targets, scale: float = 0.01):
        self.d = int(np.prod(input_shape))
        self.k = num_targets
        self.classifier = num_classes > 0
        self.metric = "accuracy" if self.classifier else "r2"
        self.scale = scale
        self.num_params = self.d * self.k + self.k

    def init_params(self, seed):
        rng = np.random.default_rng(seed)
        params = np.zeros(self.num_params, dtype=np.float32)
        params[: self.d * self.k] = self.scale * rng.standard_normal(self.d * self.k)
        return params

    def _split(self, params):
        return params[: self.d * self.k].reshape(self.d, self.k), params[self.d * self.k:]

    def _forward(self, params, x):
        W, b = self._split(params)
        x = x.reshape(len(x), self.d).astype(params.dtype, copy=False)
        return x, x @ W + b

    def _loss_and_dz(self, z, y):
        xp = mpilb.get_array_module(z)
        if self.classifier:
            z = z - z.max(axis=1, keepdims=True)
            p = xp.exp(z)
            p /= p.sum(axis=1, keepdims=True)
            rows = xp.arange(len(y))
            loss = float(-xp.log(p[rows, y] + 1e-12).sum())
            p[rows, y] -= 1
            return loss, p
        diff = z - y.reshape(z.shape).astype(z.dtype)
        return float((diff * diff).sum()), 2 * diff

    def loss_and_grad(self, params, x, y, out=None):
        xp = mpilb.get_array_module(params)
        out = xp.empty_like(params) if out is None else out
        x, z = self._forward(params, x)
        loss, dz = self._loss_and_dz(z, y)
        gW, gb = self._split(out)
        xp.matmul(x.T, dz, out=gW)
        gb[...] = dz.sum(axis=0)
        return loss, out

    def evaluate(self, params, x, y):
        _, z = self._forward(params, x)
        loss, _ = self._loss_and_dz(z.copy(), y)
        if self.classifier:
            return {"loss": loss / len(y), "accuracy": float((z.argmax(axis=1) == y).mean())}
        return {"loss": loss / len(y), "r2": mpilb.r2_score(z, y)}
