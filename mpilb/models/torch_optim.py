"""A torch.optim optimizer class stepping mpilb's flat parameter vector
(``--optimizer torch.optim.NAME`` or ``torch:NAME``, with ``--optimizer-arg KEY=VALUE``).

The class steps one parameter tensor, the whole flat float32 vector of the store, shared
with mpilb's numpy array (``torch.from_numpy``: no copy); ``.grad`` is the pushed gradient,
shared the same way. The learning rate is ``--lr`` times the step's scale (schedule,
warmup, batch), set in the parameter group before each step, as a torch LR scheduler would.

A per-tensor optimizer sees the whole model as one tensor: element-wise ones (SGD, Adam,
AdamW, RMSprop, Adagrad, Adadelta, Adamax, NAdam, RAdam, Rprop, ASGD) step exactly as on
the model's own tensors; those that compute per-tensor norms or factorisations (Adafactor,
LARS-like ones) do not. LBFGS, which needs a closure, is refused.

Besides the torch adapter, this is the one module that imports torch, and it does so only
when such an optimizer is asked for.
"""

from __future__ import annotations

import os

import numpy as np

from mpilb.errors import UsageError

try:
    import torch
except ImportError:   # pragma: no cover - the config only names torch classes with torch
    torch = None


def class_name(spec: str) -> str:
    """``torch.optim.RMSprop`` or ``torch:RMSprop`` -> ``RMSprop``."""
    return spec.split(":", 1)[1] if spec.startswith("torch:") else spec[len("torch.optim."):]


def resolve(spec: str):
    """The torch.optim class that ``spec`` names; UsageError naming the problem."""
    from mpilb.config.options import closest

    if torch is None:
        raise UsageError(f"--optimizer {spec} needs PyTorch, which is not installed: "
                         f"pip install torch (CPU build: docs/models.md)")
    name = class_name(spec)
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        known = [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                 and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)]
        raise UsageError(f"--optimizer {spec}: torch.optim has no optimizer class {name!r}"
                         f"{closest(name, known)}; it has {', '.join(sorted(known))}")
    if cls is torch.optim.LBFGS:
        raise UsageError(f"--optimizer {spec}: LBFGS needs a closure that re-evaluates the "
                         f"loss, which a parameter store cannot call; choose another optimizer")
    return cls


class TorchOptimizer:
    """A torch.optim class with the interface of :class:`mpilb.core.optimizers.Optimizer`.

    Args:
        spec: ``torch.optim.NAME`` or ``torch:NAME``.
        num_params: length of the flat parameter vector.
        lr: --lr.
        kwargs: the --optimizer-arg values (and weight_decay when --weight-decay is given).
        xp: numpy (a torch optimizer steps host parameters).
        dtype: dtype of the parameters.
    """

    into_grad = False    # steps in place: out starts as a copy of params
    ranged = False       # steps the whole vector (one torch step)
    _buffers: tuple[str, ...] = ()   # the state is not sliced over stores (--servers 1)
    kernel = "torch"

    def __init__(self, spec: str, num_params: int, *, lr: float, kwargs: dict, xp=np,
                 dtype=np.float32):
        cls = resolve(spec)
        if xp is not np:
            raise UsageError(f"--optimizer {spec} steps host parameters: use --device cpu, or "
                             f"a built-in optimizer (sgd, momentum, adam, adamw) on the GPU")
        for key in ("params", "lr"):
            if key in kwargs:
                raise UsageError(f"--optimizer-arg {key}=...: "
                                 + ("set the learning rate with --lr" if key == "lr" else
                                    "the parameters are the model's flat vector"))
        # as the torch adapter: the launcher's OMP_NUM_THREADS (1 per rank) holds for torch
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))
        self.name = f"torch.optim.{cls.__name__}"
        self.num_params = int(num_params)
        self.lr = float(lr)
        self.steps = 0
        self.dtype = np.dtype(dtype)
        self.param = torch.nn.Parameter(torch.zeros(self.num_params,
                                                    dtype=torch.from_numpy(np.zeros(0, self.dtype)).dtype))
        try:
            self.opt = cls([self.param], lr=self.lr, **kwargs)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--optimizer {spec} --optimizer-arg {kwargs}: {exc}") from None

    def __repr__(self) -> str:
        return f"{self.name}({self.opt.defaults})"

    def step(self, params, grad, lr_scale: float = 1.0, out=None) -> None:
        """Update ``params`` from ``grad`` with learning rate ``lr * lr_scale``, in place or
        into ``out`` (as :meth:`mpilb.core.optimizers.Optimizer.step`)."""
        self.steps += 1
        if out is None:
            out = params
        elif out is not params:
            if out is grad:
                grad = grad.copy()
            out[...] = params
        self.param.data = torch.from_numpy(out)      # the step writes `out` itself
        self.param.grad = torch.from_numpy(np.ascontiguousarray(grad))
        for group in self.opt.param_groups:
            group["lr"] = self.lr * lr_scale
        self.opt.step()
        self.param.grad = None

    def state_dict(self) -> dict:
        """name, steps and torch's per-parameter state as numpy (``state.KEY``: vectors and
        0-d arrays such as ``step``; plain numbers as they are)."""
        state = {"name": self.name, "steps": self.steps}
        for key, value in self.opt.state_dict()["state"].get(0, {}).items():
            if torch.is_tensor(value):
                state["state." + key] = value.detach().cpu().numpy().copy()
            elif isinstance(value, (bool, int, float)):
                state["state." + key] = value
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (a checkpoint's optimizer group)."""
        if state.get("name") != self.name:
            raise UsageError(f"optimizer state is for {state.get('name')!r}, but this run "
                             f"uses {self.name!r}; use the same --optimizer as the checkpoint")
        per = {}
        for key, value in state.items():
            if not key.startswith("state."):
                continue
            array = np.asarray(value)
            if array.ndim and array.shape != (self.num_params,):
                raise UsageError(f"optimizer state {key!r} has shape {array.shape}, expected "
                                 f"({self.num_params},); the checkpoint is for another model")
            if array.dtype.kind in "fiub":
                per[key[len("state."):]] = torch.from_numpy(np.array(array, copy=True))
            else:
                per[key[len("state."):]] = value
        saved = self.opt.state_dict()
        saved["state"] = {0: per} if per else {}
        self.opt.load_state_dict(saved)
        self.steps = int(state["steps"])

    def state_slice(self, buf: str, lo: int, hi: int):
        raise NotImplementedError("a torch.optim optimizer's state is not sliced (--servers 1)")

    def load_state_slice(self, buf: str, lo: int, hi: int, values) -> None:
        raise NotImplementedError("a torch.optim optimizer's state is not sliced (--servers 1)")
