"""The run's components built from its configuration, the same on every rank: the model,
its optimizer (built-in or torch.optim) and the dataset with its validation shards held out."""

from __future__ import annotations

import dataclasses

import numpy as np

from mpilb.config.build import Config
from mpilb.config.options import is_torch_optimizer
from mpilb.errors import UsageError


def config_model(cfg: Config, dataset):
    """The run's model (built-in or the user's), built from --seed: the same on every rank."""
    from mpilb.models import build_model, parse_model_args

    return build_model(cfg.model, tuple(dataset.sample_shape), dataset.num_classes,
                       cfg.hidden_sizes, target_shape=tuple(getattr(dataset, "target_shape", ())),
                       model_args=parse_model_args(cfg.model_arg), seed=cfg.seed)


def hold_out_validation(cfg: Config, dataset):
    """The dataset without its last ``round(F x shards)`` shards (at least one), which become
    its ``validation`` set; the dataset itself when ``--validation-fraction`` is 0."""
    if not cfg.validation_fraction:
        return dataset
    n = len(dataset.shards)
    k = max(1, round(cfg.validation_fraction * n))
    if k >= n:
        raise UsageError(f"--validation-fraction {cfg.validation_fraction} of {n} shard(s) in "
                         f"{dataset.root} leaves no shard to train on; prepare more shards (--shards)")
    return dataclasses.replace(dataset, shards=dataset.shards[:n - k], validation=dataset.shards[n - k:])


def config_optimizer(cfg: Config, num_params: int, xp=np):
    """The run's optimizer over `num_params` floats: a built-in one (optimizers.py) or a
    torch.optim class (torch_optim.py), with --optimizer-arg."""
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
