"""The run's components built from its configuration, the same on every rank: the model,
its optimizer (built-in or torch.optim) and the dataset with its validation shards held out.

Each takes the section it reads (``cfg.optim``, ``cfg.inputs``); a whole Config serves too
while callers still hand it (its flat names are the sections' fields)."""

from __future__ import annotations

import dataclasses

import numpy as np

from mpilb.config.sections import Config, DataConfig, OptimizerConfig
from mpilb.config.options import is_torch_optimizer
from mpilb.errors import UsageError


def config_model(cfg: Config, dataset):
    """The run's model (built-in or the user's: ``cfg.network``), built from --seed: the
    same on every rank."""
    from mpilb.models import build_model, parse_model_args

    net = cfg.network
    return build_model(net.model, tuple(dataset.sample_shape), dataset.num_classes,
                       net.hidden_sizes, target_shape=tuple(getattr(dataset, "target_shape", ())),
                       model_args=parse_model_args(net.model_arg), seed=cfg.experiment.seed)


def hold_out_validation(inputs: DataConfig, dataset):
    """The dataset without its last ``round(F x shards)`` shards (at least one), which become
    its ``validation`` set; the dataset itself when ``--validation-fraction`` is 0."""
    fraction = inputs.validation_fraction
    if not fraction:
        return dataset
    n = len(dataset.shards)
    k = max(1, round(fraction * n))
    if k >= n:
        raise UsageError(f"--validation-fraction {fraction} of {n} shard(s) in "
                         f"{dataset.root} leaves no shard to train on; prepare more shards (--shards)")
    return dataclasses.replace(dataset, shards=dataset.shards[:n - k], validation=dataset.shards[n - k:])


def config_optimizer(optim: OptimizerConfig, num_params: int, xp=np):
    """The run's optimizer over `num_params` floats: a built-in one (optimizers.py) or a
    torch.optim class (torch_optim.py), with --optimizer-arg."""
    from mpilb.models import parse_model_args
    from mpilb.core.optimizers import build_optimizer

    args = parse_model_args(optim.optimizer_arg, "--optimizer-arg")
    if is_torch_optimizer(optim.optimizer):
        from mpilb.models.torch_optim import TorchOptimizer

        if optim.weight_decay is not None:
            args["weight_decay"] = optim.weight_decay
        return TorchOptimizer(optim.optimizer, num_params, lr=optim.lr, kwargs=args, xp=xp)
    return build_optimizer(optim.optimizer, num_params, lr=optim.lr, momentum=optim.momentum,
                           nesterov=optim.nesterov, weight_decay=optim.weight_decay, xp=xp,
                           **_builtin_args(optim.optimizer, args))


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
