"""Every check of a run's configuration, in one place.

:func:`mpilb.config.build.build_config` runs the checks of the options alone: each value
(:func:`check_value`), the options that contradict each other (:func:`check_combinations`)
and those that have no effect given others (:func:`check_no_effect`, :data:`NO_EFFECT`).
Rank 0 then checks the configuration against the job before any rank trains (cli/launch.py,
in this order): the same options on every rank (:func:`same_options`), --inject against the
rank count (:func:`check_injects`), the data (:func:`check_world`), the optimizer
(:func:`check_optimizer`), the model (:func:`check_model_step`) and the parameter stores
(:func:`check_servers`). Every refusal is one line naming the option (UsageError, exit 2).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np

from mpilb.config.options import INT32_MAX, NO_EFFECT, OPTION_BY_NAME, Option, closest, is_torch_optimizer
from mpilb.config.sections import Config
from mpilb.core.inject import parse_inject, parse_injects
from mpilb.core.topology import PER_NODE, span, store_ranks, stores_of, workers_of
from mpilb.errors import UsageError
from mpilb.run.components import config_optimizer


# ---------------------------------------------------------------- the options alone
def check_value(opt: Option, value: Any, source: str) -> None:
    """`value` of option `opt` (coerced) against its choices, range and check; `source`: the
    config file it came from ("" the command line)."""
    where = f"{source}: {opt.name}" if source else opt.flag
    if value is None:
        return
    if opt.choices is not None and value not in opt.choices:
        allowed = ", ".join(str(c) for c in opt.choices)
        raise UsageError(f"{where} = {value!r}: allowed values are {allowed}{closest(str(value), map(str, opt.choices))}")
    # integers end up in 32-bit numpy arrays (log columns and the like): --batch 3000000000 was an
    # OverflowError deep in the run
    if opt.type is int and isinstance(value, int) and not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise UsageError(f"{where} = {value!r}: out of range (integers are 32-bit: at most {INT32_MAX:,})")
    if opt.type is float and value != value:
        raise UsageError(f"{where} = nan: expected a number")
    if opt.check is not None and not opt.check[0](value):
        raise UsageError(f"{where} = {value!r}: must be {opt.check[1]}")


def check_combinations(cfg: Config) -> None:
    """Options that contradict each other."""
    bal, out = cfg.balancing, cfg.output
    if bal.min_batch > bal.max_batch:
        raise UsageError(f"--min-batch {bal.min_batch} is larger than --max-batch {bal.max_batch}")
    if out.resume and not (out.checkpoint or out.log):
        raise UsageError("--resume needs --log RUN.h5 (the run to continue; its checkpoint is "
                         "RUN.ckpt.h5) or --checkpoint CKPT.h5")
    if out.resume and out.overwrite:
        raise UsageError("--resume continues the log and checkpoint that --overwrite would "
                         "replace: give one of them")
    if cfg.updates.pipeline and cfg.updates.mode == "sync":
        raise UsageError("--pipeline 1 cannot be combined with --mode sync (a sync round waits for every gradient)")
    if cfg.updates.correction == "gap" and cfg.updates.wire != "fp32":
        raise UsageError(f"--correction gap with --wire {cfg.updates.wire}: gap measures each "
                         "parameter's move against the parameters the worker computed on, which "
                         f"it read rounded to {cfg.updates.wire} (by more than many parameters "
                         "move in a step); use --wire fp32, or --correction lookahead")
    if cfg.updates.correction == "dana" and cfg.optim.optimizer != "momentum":
        raise UsageError(f"--correction dana keeps a momentum per worker: it needs --optimizer "
                         f"momentum, not {cfg.optim.optimizer}")
    if cfg.faults.respawn:
        check_respawn(cfg)
    if out.log and Path(out.log).is_dir():
        raise UsageError(f"--log {out.log}: is a directory, expected a file name such as run.h5")


def check_respawn(cfg: Config) -> None:
    """--respawn admits a replacement as a join is admitted (server/respawn.py): not where a
    worker arriving part-way is not supported yet."""
    servers = cfg.updates.servers
    why = ("--mode sync (a round's members are fixed)" if cfg.updates.mode == "sync" else
           "--store local (a replacement holds no shards)" if cfg.inputs.store == "local" else
           f"--servers {servers} (a replacement talks to rank 0's store only)" if servers != 1
           else "")
    if why:
        raise UsageError(f"--respawn cannot be combined with {why}: it works with --mode async "
                         f"or ssp, one store and the shared store")


def _show(name: str, value: Any, source: str) -> str:
    if source:
        return f"{name} = {json.dumps(value)}"
    if value is True or value is False:
        return ("--" if value else "--no-") + name.replace("_", "-")
    return f"{OPTION_BY_NAME[name].flag} {value}"


def check_no_effect(cfg: Config) -> list[str]:
    """UsageError for an option set on the command line that has no effect (see NO_EFFECT);
    the warnings for such options set in the config file (where each came from:
    ``cfg.given``)."""
    warnings = []
    flat = SimpleNamespace(**cfg.values)   # the table's rules read options by name
    for name, applies, other, why in NO_EFFECT:
        if applies(flat) or name not in cfg.given:
            continue
        source = cfg.given[name] or cfg.given.get(other, "")
        decided_on_cli = cfg.given.get(other, "") == ""
        if cfg.given[name] == "":
            raise UsageError(f"{_show(name, cfg.values[name], '')} has no effect with "
                             f"{_show(other, cfg.values[other], '' if decided_on_cli else source)}"
                             f" ({why}); drop it or change {OPTION_BY_NAME[other].flag}")
        warnings.append(f"{source}: {_show(name, cfg.values[name], source)} has no effect with "
                        f"{_show(other, cfg.values[other], '' if decided_on_cli else source)} "
                        f"({why}); ignored")
    return warnings


def no_effect(cfg: Config, name: str, given_what: str, why: str) -> None:
    """An option that has no effect given something other than an option (the dataset):
    refused when set on the command line, a warning when set in a config file, nothing
    when it is not set (the same rule as :data:`NO_EFFECT`)."""
    source = cfg.given.get(name)
    if source is None or cfg.values.get(name) is None:
        return
    if source == "":
        raise UsageError(f"{_show(name, cfg.values[name], '')} has no effect with {given_what}: "
                         f"{why}")
    warn(f"{source}: {_show(name, cfg.values[name], source)} has no effect with {given_what}: "
         f"{why}; ignored")


def warn(text: str) -> None:
    """A warning, from rank 0 only (every rank builds the configuration)."""
    rank = next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
                 if os.environ.get(v, "").strip().isdigit()), "0")
    if int(rank) == 0:
        print(f"mpilb: warning: {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- against the job
def same_options(mine: tuple, all_args: list) -> None:
    """Every rank of an MPMD job (`mpiexec ... : ...`, heterogeneous Slurm steps) must be
    started with the same options, or the ranks build different models and buffers."""
    for r, theirs in enumerate(all_args):
        if theirs == mine:
            continue
        if theirs[0] != mine[0]:
            raise UsageError(f"rank {r} was started with config file {theirs[0]!r}, rank 0 with "
                             f"{mine[0]!r}: every rank must get the same config and options")
        keys = sorted(set(mine[1]) | set(theirs[1]))
        differ = [k for k in keys if mine[1].get(k) != theirs[1].get(k)]
        shown = ", ".join(f"--{k.replace('_', '-')} {theirs[1].get(k)!r} vs {mine[1].get(k)!r}"
                          for k in differ[:3])
        raise UsageError(f"rank {r} was started with other options than rank 0 ({shown}): "
                         f"every rank of the job must get the same options")


def check_injects(cfg: Config, world_size: int) -> None:
    """Each --inject parses and names ranks of this job."""
    parse_injects(cfg.experiment.inject, world_size)


def check_world(cfg: Config, world_size: int, dataset) -> None:
    """Combinations that depend on the job size or the data."""
    workers = max(1, len(workers_of(cfg, world_size)))
    inputs = cfg.inputs
    if inputs.store == "local" and inputs.replicas > workers:
        raise UsageError(f"--replicas {inputs.replicas} exceeds the {workers} worker rank(s) of this job")
    if not dataset.num_classes:
        no_effect(cfg, "target_accuracy", f"regression data ({dataset.root} holds float "
                  "targets, num_classes 0)", "accuracy is measured for classifiers only; "
                  "use --target-metric V to stop on the model's metric (e.g. r2)")
    from mpilb.data.standardize import unscaled   # (reads the dataset's HDF5 files)

    warning = unscaled(dataset)
    if warning:
        print(f"mpilb: warning: {warning}", file=sys.stderr, flush=True)
    if cfg.network.model == "cnn" and len(dataset.sample_shape) not in (1, 3):
        raise UsageError(f"--model cnn needs image-shaped samples (C,H,W); {dataset.root} has shape {tuple(dataset.sample_shape)}")


def check_optimizer(cfg: Config, world_size: int) -> None:
    """The optimizer builds (name, --optimizer-arg), and combinations with --servers."""
    optim, servers = cfg.optim, cfg.updates.servers
    config_optimizer(optim, 1)
    several = len(stores_of(cfg)) > 1   # (--servers per-node on one node is one store)
    if several and is_torch_optimizer(optim.optimizer):
        raise UsageError(f"--optimizer {optim.optimizer} with --servers {servers}: the state "
                         f"of a torch.optim optimizer is not sliced over parameter stores; use "
                         f"--servers 1, or a built-in optimizer (sgd, momentum, adam, adamw)")
    if optim.clip_norm is not None and cfg.updates.mode == "sync" and several and world_size > 1:
        raise UsageError(f"--clip-norm with --mode sync and --servers {servers}: the norm "
                         f"of a round's mean gradient would need every store's slice; use "
                         f"--servers 1 (or --mode async/ssp, where workers clip)")


def check_model_step(cfg: Config, model, dataset) -> None:
    """One gradient of two training samples on the CPU at start-up, so that a model whose
    gradient has the wrong length is one line (exit 2) before any rank trains, not an
    abort from a worker. Only that protocol check decides here: a model that cannot run on
    NumPy arrays (a CuPy-only one on a GPU run) is left to the workers."""
    # (imported here: the model's code, not the configuration's)
    from mpilb.backend import select_backend
    from mpilb.core.batches import gradient_into
    from mpilb.models import initial_params

    x, y = dataset.first_rows(2)
    params = initial_params(model, cfg.experiment.seed, cfg.network.model)
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


def check_servers(cfg, world_size: int, num_params: int, num_state: int = 0,
                  nodes: Optional[list] = None) -> None:
    """--servers K or per-node on the node layout `nodes` (node index by rank; default one
    node): at least one worker rank left, and at least one float per store. `cfg`: reads
    the flat ``servers`` and ``inject``."""
    nodes = list(nodes) if nodes else [0] * world_size
    stores = store_ranks(nodes, cfg.updates.servers)
    k, shown = len(stores), cfg.updates.servers
    if k > 1 and num_state:
        raise UsageError(f"--servers {shown}: this model has {num_state} state values (buffers "
                         f"such as BatchNorm statistics), which travel to rank 0 with each push; "
                         f"several parameter stores do not carry them yet: use --servers 1")
    if world_size > 1 and shown == PER_NODE and k >= world_size:
        raise UsageError(f"--servers per-node leaves no worker: each of the job's {k} nodes has "
                         f"one rank, which would be its store; start more ranks per node "
                         f"(mpiexec -ppn 2, or -hosts n0:2,...) or give --servers K")
    if world_size > 1 and shown != PER_NODE and int(shown) >= world_size:
        raise UsageError(f"--servers {shown} leaves no worker: this job has {world_size} ranks "
                         f"(ranks 0..{int(shown) - 1} would all be parameter stores); use "
                         f"--servers {max(1, world_size - 1)} or fewer, or more ranks")
    if world_size == 1 and shown != PER_NODE and int(shown) > 1:
        raise UsageError(f"--servers {shown} needs an MPI job of more than {shown} ranks "
                         f"(mpiexec -n P with P > {shown}); a one-rank run trains serially")
    if k > num_params:
        raise UsageError(f"--servers {shown} exceeds the model's {num_params} parameters "
                         f"(each store needs at least one)")
    for text in cfg.experiment.inject or ():
        for rank in sorted(parse_inject(text).ranks or ()):
            if rank in stores[1:]:
                workers = [r for r in range(world_size) if r not in stores]
                raise UsageError(f"--inject {text!r}: rank {rank} is a parameter store "
                                 f"(--servers {shown}: ranks {span(stores)}), not a worker; "
                                 f"target workers {span(workers)}")
