"""Checks of a run's configuration against the job: its size, its data and its model.

The options' own values and their combinations are checked as the configuration is built
(:func:`mpilb.config.build.build_config`); what depends on the job (rank count, node
layout, the dataset, the model) is checked here, once, on rank 0 before any rank trains
(:func:`check_job`).
"""

from __future__ import annotations

import sys

import numpy as np

from mpilb.config.build import Config, no_effect
from mpilb.config.options import is_torch_optimizer
from mpilb.core.topology import stores_of, workers_of
from mpilb.errors import UsageError
from mpilb.run.components import config_optimizer


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
        print(f"mpilb: warning: {warning}", file=sys.stderr, flush=True)
    if cfg.model == "cnn" and len(dataset.sample_shape) not in (1, 3):
        raise UsageError(f"--model cnn needs image-shaped samples (C,H,W); {dataset.root} has shape {tuple(dataset.sample_shape)}")


def check_optimizer(cfg: Config, world_size: int) -> None:
    """The optimizer builds (name, --optimizer-arg), and combinations with --servers."""
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
