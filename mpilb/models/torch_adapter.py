"""A ``torch.nn.Module`` as an :class:`mpilb.Model`. The only module of mpilb that imports torch.

The module's parameters become views of the flat vector the engine hands in (the worker's
message buffer or its device copy), so a pull copies nothing; the gradients autograd
computes are written with one ``torch.cat`` straight into the flat buffer the push sends
(the one copy any engine makes to send them; accumulating into ``.grad`` views instead costs
a zeroing and an addition more per step). On a GPU rank the flat buffers are CuPy arrays
shared with torch through DLPack, no copy.

Loss: the module's own ``loss(output, y)`` when it has one (a mean over the batch, as torch's
losses are by default; the adapter multiplies by the batch size), else cross entropy for
integer labels and mean squared error for float targets. Metrics: the module's own
``metrics(output, y) -> dict`` (with ``metric`` naming the headline) when it has one, else
accuracy or R². Buffers (BatchNorm running statistics, ...) are the model's "state": they
travel with each push and the server keeps the latest for evaluation and checkpoints.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from mpilb.backend import get_array_module
from mpilb.errors import MpilbError, UsageError
from mpilb.models.base import Model, r2_score


class FusedAdam:
    """torch's fused CPU Adam kernel on numpy vectors, for :class:`mpilb.core.optimizers.Adam`
    (one vectorised pass instead of numpy's ten ufuncs per block). The moments are torch's
    own m and v, in `exp_avg` and `exp_avg_sq` (shared, no copy); a step is in place."""

    def __init__(self, exp_avg: np.ndarray, exp_avg_sq: np.ndarray):
        self.m = [torch.from_numpy(exp_avg)]
        self.v = [torch.from_numpy(exp_avg_sq)]
        self.step = [torch.zeros((), dtype=torch.float32)]

    def __call__(self, params: np.ndarray, grad: np.ndarray, steps: int, lr: float,
                 beta1: float, beta2: float, weight_decay: float, eps: float) -> None:
        self.step[0].fill_(float(steps))   # the kernel reads t, the count of this step
        torch._fused_adam_([torch.from_numpy(params)], [torch.from_numpy(grad)], self.m, self.v,
                           [], self.step, lr=lr, beta1=beta1, beta2=beta2,
                           weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def checked_fused_adam(adam_class):
    """:class:`FusedAdam` when it steps like `adam_class`'s numpy blocks (mpilb's Adam),
    checked on a few floats (a private kernel may change between releases); else None."""
    try:
        rng = np.random.default_rng(0)
        p0 = rng.standard_normal(64).astype(np.float32)
        grads = [rng.standard_normal(64).astype(np.float32) for _ in range(3)]
        results = []
        for kernel in (None, FusedAdam):
            opt = adam_class(64, lr=0.01, weight_decay=0.1)
            opt.use_fused(kernel)
            p = p0.copy()
            for g in grads:
                opt.step(p, g, 0.5)
            results.append((p, opt.state_dict()))
        (pa, sa), (pb, sb) = results
        ok = np.allclose(pa, pb, rtol=1e-5, atol=1e-6) and all(
            np.allclose(sa[b], sb[b], rtol=1e-5, atol=1e-6) for b in adam_class._buffers)
    except Exception:  # noqa: BLE001 - any failure: the numpy kernel steps
        return None
    return FusedAdam if ok else None


def is_module(obj) -> bool:
    """True for a torch.nn.Module instance."""
    return isinstance(obj, torch.nn.Module)


def seed(value: int) -> None:
    """Seed torch's generators (CPU and every GPU) before a module is built."""
    torch.manual_seed(value)


def _tensor(a):
    """A numpy or cupy array as a torch tensor sharing its memory."""
    if isinstance(a, np.ndarray):
        if not a.flags.writeable:
            a = a.copy()
        return torch.from_numpy(a)
    return torch.from_dlpack(a)


def _layout_of(named) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(int(d) for d in t.shape)) for name, t in named]


class TorchModel(Model):
    """Adapter: train ``module`` with mpilb.

    Args:
        module: the user's module, already built (from ``--seed``).
        num_classes: classes of the labels; 0 for float targets of ``target_shape``.
        input_shape: one sample's shape; a forward pass on two zero samples checks the
            module and its output shape before training starts.
        where: the ``--model`` spec, for messages.
    """

    def __init__(self, module, *, num_classes: int, target_shape=(), input_shape=None,
                 where: str = "module"):
        self.module = module.float()
        self.where = where
        # several ranks share a node's cores: the launcher's OMP_NUM_THREADS (1 per rank in a
        # multi-rank job) holds for torch even when torch was imported before it was set
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))
        self.num_classes = int(num_classes)
        self.target_shape = tuple(target_shape)
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self._named = list(module.named_parameters())
        if not self._named:
            raise UsageError(f"--model {where}: {type(module).__name__} has no parameters to train "
                             "(a torch module needs at least one nn.Parameter)")
        self._buffers = list(module.named_buffers())
        self._shapes = _layout_of(self._named)
        self.num_params = int(sum(p.numel() for _, p in self._named))
        self.num_state = int(sum(b.numel() for _, b in self._buffers))
        user_metric = getattr(module, "metric", None)
        self.metric = user_metric if isinstance(user_metric, str) else (
            "accuracy" if self.num_classes else "r2")
        self._user_loss = callable(getattr(module, "loss", None))
        self._user_metrics = callable(getattr(module, "metrics", None))
        self._initial = torch.cat([p.detach().reshape(-1).cpu() for _, p in self._named]).numpy().copy()
        self._grad = None      # our own gradient buffer (xp array) when no `out` is given
        self._bound = None
        self._device = None
        if self.input_shape is not None:
            self._check_forward()

    def __repr__(self) -> str:
        return f"TorchModel({type(self.module).__name__}, num_params={self.num_params})"

    # ------------------------------------------------------------------ protocol
    def init_params(self, seed: int) -> np.ndarray:
        """The parameters as the module was built (the builder seeded torch with --seed)."""
        return self._initial.copy()

    def layout(self):
        return list(self._shapes)

    def signature(self) -> dict:
        return {"model": f"torch:{type(self.module).__qualname__}", "num_params": self.num_params,
                "layout": [[n, list(s)] for n, s in self._shapes],
                "state": [[n, list(b.shape)] for n, b in self._buffers]}

    def loss_and_grad(self, params, x, y, out=None):
        xp = get_array_module(params)
        if out is None:
            if self._grad is None or get_array_module(self._grad) is not xp:
                self._grad = xp.zeros(self.num_params, dtype=np.float32)
            out = self._grad
        flat_g = self._bind(params, out)
        self.module.train()
        loss = self._loss(self.module(self._features(x)), self._targets(y))
        trainable = [p for _, p in self._named if p.requires_grad]
        grads = iter(torch.autograd.grad(loss, trainable, allow_unused=True))
        pieces = []
        for _, p in self._named:
            g = next(grads) if p.requires_grad else None
            pieces.append(torch.zeros(p.numel(), device=flat_g.device) if g is None else g.reshape(-1))
        torch.cat(pieces, out=flat_g)
        return float(loss.detach()), out

    def evaluate(self, params, x, y, batch_size: int = 1024) -> dict:
        self._bind(params, None)
        n = len(x)
        if n == 0:
            return {"loss": float("nan"), self.metric: float("nan")}
        self.module.eval()
        try:
            with torch.no_grad():
                outputs = []
                for lo in range(0, n, batch_size):
                    outputs.append(self.module(self._features(x[lo:lo + batch_size])))
                output = torch.cat(outputs)
                yt = self._targets(y)
                loss = float(self._loss(output, yt)) / n
                if self._user_metrics:
                    result = {k: float(v) for k, v in self.module.metrics(output, yt).items()}
                elif self.num_classes:
                    result = {"accuracy": float((output.argmax(dim=1) == yt).double().mean())}
                else:
                    result = {"r2": r2_score(output.cpu().numpy(), yt.cpu().numpy())}
        finally:
            self.module.train()
        result["loss"] = loss
        if self.num_classes and "accuracy" not in result:
            result["accuracy"] = float((output.argmax(dim=1) == yt).double().mean())
        return result

    def get_state(self):
        if not self.num_state:
            return None
        return torch.cat([b.detach().reshape(-1).to("cpu", torch.float32)
                          for b in self._live_buffers()]).numpy()

    def set_state(self, flat) -> None:
        if not self.num_state:
            return
        src = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
        pos = 0
        with torch.no_grad():
            for b in self._live_buffers():
                k = b.numel()
                b.copy_(src[pos:pos + k].view(b.shape).to(b.dtype))
                pos += k

    def state_dict(self, params, state=None) -> dict:
        """The module's ``state_dict()`` holding ``params`` (and ``state``), as CPU tensors."""
        self._bind(np.array(params, dtype=np.float32), None)
        if state is not None:
            self.set_state(state)
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    # ------------------------------------------------------------------ internals
    def _live_buffers(self) -> list:
        """The module's buffers as they are now: ``module.to(device)`` replaces buffer
        tensors (parameters keep their objects), so the ones listed at construction are the
        CPU originals once the module is on a GPU (whose running statistics never move)."""
        return [b for _, b in self.module.named_buffers()]

    def _bind(self, params, grad):
        """Make every parameter a view of ``params`` (rebinding only when another buffer
        comes in, which step after step it does not); returns ``grad`` as a tensor."""
        pt = _tensor(params)
        if pt.dtype != torch.float32 or pt.shape != (self.num_params,):
            raise MpilbError(f"{self.where}: expected a flat float32 vector of {self.num_params} "
                             f"parameters, got {tuple(pt.shape)} {pt.dtype}")
        if pt.device != self._device:
            self.module.to(pt.device)   # buffers follow the parameters onto the GPU
            self._device = pt.device
        if pt.data_ptr() != self._bound:
            pos = 0
            for (_, p), (_, shape) in zip(self._named, self._shapes):
                k = math.prod(shape)
                p.data = pt[pos:pos + k].view(shape)
                pos += k
            self._bound = pt.data_ptr()
        return _tensor(grad) if grad is not None else None

    def _features(self, x):
        """Samples as a float32 tensor on the module's device (no copy when they are)."""
        xt = _tensor(x)
        if xt.dtype != torch.float32:
            xt = xt.float()
        return xt if self._device is None or xt.device == self._device else xt.to(self._device)

    def _targets(self, y):
        """Labels as int64, targets as float32, on the module's device."""
        yt = _tensor(y)
        yt = yt.long() if self.num_classes else yt.float()
        return yt if self._device is None or yt.device == self._device else yt.to(self._device)

    def _loss(self, output, y):
        if self._user_loss:
            return self.module.loss(output, y) * len(y)
        if self.num_classes:
            return F.cross_entropy(output, y, reduction="sum")
        if output.shape != y.shape:
            if output.numel() != y.numel():
                raise MpilbError(f"{self.where}: outputs of shape {tuple(output.shape)} do not "
                                 f"match targets of shape {tuple(y.shape)}")
            output = output.reshape(y.shape)
        return F.mse_loss(output, y, reduction="sum")

    def _check_forward(self) -> None:
        """One forward pass on two zero samples, in eval mode (BatchNorm stats untouched)."""
        x = torch.zeros((2, *self.input_shape))
        self.module.eval()
        try:
            with torch.no_grad():
                out = self.module(x)
        except Exception as exc:  # noqa: BLE001 - the user's forward, one line
            raise UsageError(f"--model {self.where}: forward pass on a batch of shape "
                             f"{tuple(x.shape)} raised {type(exc).__name__}: {exc}") from None
        finally:
            self.module.train()
        want = self.num_classes or math.prod(self.target_shape)
        if not isinstance(out, torch.Tensor):
            raise UsageError(f"--model {self.where}: forward returned a {type(out).__name__}, "
                             "expected a tensor")
        if self._user_loss:
            ok = True   # the module's own loss decides what its outputs mean
        elif self.num_classes:
            ok = tuple(out.shape) == (2, want)
        else:
            ok = out.numel() == 2 * want
        if not ok:
            kind = f"{want} class scores" if self.num_classes else f"{want} target value(s)"
            raise UsageError(f"--model {self.where}: outputs of shape {tuple(out.shape)} for a "
                             f"batch of 2; the dataset needs {kind} per sample")


def save_state_dict(state: dict, path) -> None:
    """``torch.save`` a state dict whose values are tensors or numpy arrays."""
    torch.save({k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))
                for k, v in state.items()}, path)
