"""Pieces shared by the serial trainer and the parameter server.

Epochs are strict (docs/cli.md): an epoch ends when every one of its samples has been applied
exactly once. A batch is a range [lo, hi) of positions in one shard's permuted order in one
epoch, so the server can count coverage per sample with one small array per epoch.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from mpilb.config.build import Config, no_effect
from mpilb.errors import MpilbError, UsageError
from mpilb.core.topology import stores_of, workers_of

# Set by the SIGTERM handler (any rank; SIGUSR1 too in a one-rank run): checkpoint and stop.
PREEMPTED = threading.Event()
# Set by SIGUSR1 on a rank of a multi-rank job. Slurm's `--signal=USR1` means preemption, but
# MPICH's Hydra under `-disable-auto-cleanup` sends the same signal to the survivors when a
# rank dies; rank 0 tells them apart (server/chores.py): a preemption only when every worker
# present at the signal reports it too, none of them dying first.
USR1_NOTICE = threading.Event()

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


def hold_out_validation(cfg: Config, dataset):
    """The dataset without its last ``round(F x shards)`` shards (at least one), which become
    its ``validation`` set; the dataset itself when ``--validation-fraction`` is 0."""
    import dataclasses

    if not cfg.validation_fraction:
        return dataset
    n = len(dataset.shards)
    k = max(1, round(cfg.validation_fraction * n))
    if k >= n:
        raise UsageError(f"--validation-fraction {cfg.validation_fraction} of {n} shard(s) in "
                         f"{dataset.root} leaves no shard to train on; prepare more shards (--shards)")
    return dataclasses.replace(dataset, shards=dataset.shards[:n - k], validation=dataset.shards[n - k:])


def batch_ranges(size: int, start: int, batch: int):
    """The next batch [lo, hi) of a shard of `size` samples from position `start`."""
    hi = min(size, start + batch)
    return start, hi


def config_model(cfg: Config, dataset):
    """The run's model (built-in or the user's), built from --seed: the same on every rank."""
    from mpilb.models import build_model, parse_model_args

    return build_model(cfg.model, tuple(dataset.sample_shape), dataset.num_classes,
                       cfg.hidden_sizes, target_shape=tuple(getattr(dataset, "target_shape", ())),
                       model_args=parse_model_args(cfg.model_arg), seed=cfg.seed)


def check_model_step(cfg: Config, model, dataset) -> None:
    """One gradient of two training samples on the CPU at start-up, so that a model whose
    gradient has the wrong length is one line (exit 2) before any rank trains, not an
    abort from a worker. Only that protocol check decides here: a model that cannot run on
    NumPy arrays (a CuPy-only one on a GPU run) is left to the workers."""
    from mpilb.backend import select_backend
    from mpilb.core.batches import gradient_into
    from mpilb.models import initial_params

    x, y = dataset.first_rows(2)
    params = initial_params(model, cfg.seed, cfg.model)
    out = np.zeros(model.num_params, dtype=np.float32)
    try:
        with np.errstate(all="ignore"):
            _, grad = model.loss_and_grad(params, x, y, out)
    except UsageError:
        raise
    except Exception:  # noqa: BLE001 - the workers report the model's own errors
        return
    if grad is not out:
        gradient_into(model, grad, out, select_backend("cpu", 0))


def config_optimizer(cfg: Config, num_params: int, xp=np):
    """The run's optimizer over `num_params` floats: a built-in one (optimizers.py) or a
    torch.optim class (torch_optim.py), with --optimizer-arg."""
    from mpilb.config.build import is_torch_optimizer
    from mpilb.models import parse_model_args
    from mpilb.core.optimizers import build_optimizer

    args = parse_model_args(cfg.optimizer_arg, "--optimizer-arg")
    if is_torch_optimizer(cfg.optimizer):
        from mpilb.models.torch_optim import TorchOptimizer

        if cfg.weight_decay is not None:
            args["weight_decay"] = cfg.weight_decay
        return TorchOptimizer(cfg.optimizer, num_params, lr=cfg.lr, kwargs=args, xp=xp)
    return build_optimizer(cfg.optimizer, num_params, lr=cfg.lr, momentum=cfg.momentum,
                           nesterov=cfg.nesterov, weight_decay=cfg.weight_decay, xp=xp,
                           **_builtin_args(cfg.optimizer, args))


def _builtin_args(name: str, args: dict) -> dict:
    """--optimizer-arg of a built-in optimizer: betas=[B1, B2] and eps (adam, adamw)."""
    allowed = ("betas", "eps") if name in ("adam", "adamw") else ()
    for key in args:
        if key not in allowed:
            raise UsageError(f"--optimizer-arg {key}=...: --optimizer {name} takes "
                             + (f"only {', '.join(allowed)}" if allowed else
                                "none (its options are --lr, --momentum, --nesterov, "
                                "--weight-decay)"))
    out = {}
    if "betas" in args:
        betas = args["betas"]
        if not (isinstance(betas, list) and len(betas) == 2
                and all(isinstance(b, (int, float)) for b in betas)):
            raise UsageError(f"--optimizer-arg betas={betas!r}: expected two numbers, "
                             f"e.g. betas=[0.9,0.999]")
        out["beta1"], out["beta2"] = float(betas[0]), float(betas[1])
    if "eps" in args:
        if not isinstance(args["eps"], (int, float)) or isinstance(args["eps"], bool):
            raise UsageError(f"--optimizer-arg eps={args['eps']!r}: expected a number, e.g. eps=1e-8")
        out["eps"] = float(args["eps"])
    return out


def check_optimizer(cfg: Config, world_size: int) -> None:
    """The optimizer builds (name, --optimizer-arg), and combinations with --servers."""
    from mpilb.config.build import is_torch_optimizer

    config_optimizer(cfg, 1)
    several = len(stores_of(cfg)) > 1   # (--servers per-node on one node is one store)
    if several and is_torch_optimizer(cfg.optimizer):
        raise UsageError(f"--optimizer {cfg.optimizer} with --servers {cfg.servers}: the state "
                         f"of a torch.optim optimizer is not sliced over parameter stores; use "
                         f"--servers 1, or a built-in optimizer (sgd, momentum, adam, adamw)")
    if cfg.clip_norm is not None and cfg.mode == "sync" and several and world_size > 1:
        raise UsageError(f"--clip-norm with --mode sync and --servers {cfg.servers}: the norm "
                         f"of a round's mean gradient would need every store's slice; use "
                         f"--servers 1 (or --mode async/ssp, where workers clip)")


def check_world(cfg: Config, world_size: int, dataset) -> None:
    """Combinations that depend on the job size or the data."""
    workers = max(1, len(workers_of(cfg, world_size)))
    if cfg.store == "local" and cfg.replicas > workers:
        raise UsageError(f"--replicas {cfg.replicas} exceeds the {workers} worker rank(s) of this job")
    if not dataset.num_classes:
        no_effect(cfg, "target_accuracy", f"regression data ({dataset.root} holds float "
                  "targets, num_classes 0)", "accuracy is measured for classifiers only; "
                  "use --target-metric V to stop on the model's metric (e.g. r2)")
    from mpilb.data.standardize import unscaled

    warning = unscaled(dataset)
    if warning:
        import sys

        print(f"mpilb: warning: {warning}", file=sys.stderr, flush=True)
    if cfg.model == "cnn" and len(dataset.sample_shape) not in (1, 3):
        raise UsageError(f"--model cnn needs image-shaped samples (C,H,W); {dataset.root} has shape {tuple(dataset.sample_shape)}")
