"""Every `mpilb train` option, defined once: name, type, default, help, check, group, and
which options do nothing given others. :mod:`mpilb.config.build` builds a run's configuration from
this table (argument parser, TOML files, validation); docs/configuration.md is generated
from it."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Option:
    """One training option.

    Attributes:
        name: key with underscores (`staleness_bound`); the flag is `--staleness-bound`.
        type: python type of the value (`int`, `float`, `str`, `bool`, `list`).
        default: value when neither config file nor command line sets it.
        help: one line for `--help` and the configuration reference.
        choices: allowed values, if the option is an enumeration.
        check: predicate on the value and the text saying what it must be.
        group: heading in the configuration reference.
        default_text: the default as the reference and ``--help`` show it, where it depends
            on other options (`default` is then None and build_config decides).
        words: values allowed beside those of `type` (`--servers per-node`), kept as text.
    """

    name: str
    type: type
    default: Any
    help: str
    choices: Optional[tuple] = None
    check: Optional[tuple[Callable[[Any], bool], str]] = None
    group: str = "training"
    metavar: Optional[str] = None
    default_text: Optional[str] = None
    words: tuple = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


INT32_MAX = 2**31 - 1
_POSITIVE = (lambda v: v > 0, "a number > 0")
_NON_NEGATIVE = (lambda v: v >= 0, "a number >= 0")
_POSITIVE_INT = (lambda v: v >= 1, "an integer >= 1")
_OPTIONAL_POSITIVE = (lambda v: v is None or v > 0, "a number > 0")
_FRACTION = (lambda v: v is None or 0 < v <= 1, "a number in (0, 1]")
_UNIT = (lambda v: 0 <= v < 1, "a number in [0, 1)")

BUILTIN_OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")


def is_torch_optimizer(name: str) -> bool:
    """``torch.optim.NAME`` or ``torch:NAME``: a torch.optim class (torch_optim.py)."""
    return str(name).startswith(("torch.optim.", "torch:"))

OPTIONS: tuple[Option, ...] = (
    # data and model
    Option("data", str, None, "dataset directory (from `mpilb prepare`); default: a built-in "
           "synthetic dataset generated once into $MPILB_CACHE", group="data and model", metavar="DIR"),
    Option("model", str, "mlp", "model to train: a built-in (softmax, mlp, cnn) or the user's "
           "FILE.py:NAME / package.module:NAME (an mpilb.Model or torch.nn.Module; docs/models.md)",
           check=(lambda v: v in ("softmax", "mlp", "cnn") or ":" in v,
                  "softmax, mlp, cnn, FILE.py:NAME or package.module:NAME"),
           group="data and model", metavar="MODEL"),
    Option("hidden", str, "256,128", "hidden layer sizes of the mlp, comma-separated",
           group="data and model", metavar="N,N"),
    Option("device", str, "auto", "where workers compute: auto = GPU when CuPy sees one",
           ("auto", "cpu", "gpu"), group="data and model"),
    Option("cuda_aware", bool, False, "hand device buffers straight to MPI (the MPI library "
           "must be CUDA-aware; also MPILB_CUDA_AWARE=1); otherwise stage through pinned host "
           "memory", group="data and model"),
    # training mode
    Option("mode", str, "async", "async: apply each gradient on arrival; ssp: bounded "
           "staleness; sync: synchronous rounds", ("async", "ssp", "sync"), group="mode"),
    Option("staleness_bound", int, 4, "ssp: steps a worker may run ahead of the slowest",
           check=(lambda v: v >= 0, "an integer >= 0"), group="mode", metavar="S"),
    Option("correction", str, None, "staleness correction: dana = a momentum vector per "
           "worker on the stores, stepped Nesterov's way, the parameters sent the look-ahead "
           "point (DANA; --optimizer momentum; workers x the parameters in memory), the "
           "lr ramped up over the first 40 gradients (or by --warmup); dynamic = the optimizer's "
           "momentum set to 1 - (1-mu)(tau+1), tau the measured mean staleness: each "
           "gradient's long-run step lr/(1-mu) divided by tau+1 (DynSGD through the "
           "momentum); lookahead = for workers that predict the parameters "
           "(--weight-prediction on): 1 - (1-mu)(1+0.7 tau), the lr ramped up over the first "
           "40 gradients (or by --warmup where given); gap = for such workers: the recipe's "
           "momentum kept, each coordinate of a gradient divided by max(1, G), G how far that "
           "parameter moved since the parameters it was computed on in units of its mean step "
           "(gap-aware), the lr ramped up over the first 20 gradients (or by --warmup); "
           "momentum = mu - tau/(tau+1), what "
           "asynchrony adds taken off; none = as given (the first default); inverse = lr/max(1,tau); dc = delay-compensated ASGD",
           ("none", "dana", "dynamic", "lookahead", "gap", "momentum", "inverse", "dc"),
           group="mode", default_text="with --mode async or ssp and weight prediction (--optimizer "
           "momentum): dana where its velocities take at most 1 GiB a store, else gap for a "
           "model of at most 65,536 parameters a store (--wire fp32), lookahead above; dynamic "
           "without prediction, none with sync"),
    Option("dc_lambda", float, 0.04, "dc: the compensation strength lambda", check=_NON_NEGATIVE,
           group="mode"),
    Option("pipeline", int, None, "1: compute the next gradient while the previous push is in "
           "flight (one more step of staleness, less waiting)", (0, 1), group="mode",
           default_text="1 with --mode async, 0 with ssp or sync, under --correction inverse, "
           "or under --correction dana, dynamic, lookahead or momentum with --optimizer momentum"),
    Option("weight_prediction", str, None, "on: a worker computes its gradient on the "
           "parameters it read extrapolated along their recent trajectory by the staleness "
           "its pushes meet, the ones the server will likely hold when the gradient arrives "
           "(SpecTrain's weight prediction); off: on the parameters as read", ("on", "off"),
           group="mode", default_text="on with --mode async or ssp and --optimizer momentum, "
           "else off"),
    # optimizer
    Option("optimizer", str, "sgd", "optimizer run by the parameter stores; adamw: decoupled "
           "weight decay, as torch.optim.AdamW; a torch.optim class by name needs torch "
           "(docs/models.md)",
           check=(lambda v: v in BUILTIN_OPTIMIZERS or is_torch_optimizer(v),
                  "sgd, momentum, adam, adamw, torch.optim.NAME or torch:NAME"),
           group="optimizer", metavar="NAME"),
    Option("optimizer_arg", list, [], "keyword argument for the optimizer, KEY=VALUE with VALUE "
           "a TOML value (repeatable): betas=[0.9,0.99] and eps=1e-6 for adam and adamw; any "
           "constructor argument but params and lr for a torch.optim class",
           group="optimizer", metavar="KEY=VALUE"),
    Option("clip_norm", float, None, "clip each applied gradient to this global L2 norm before "
           "the optimizer step, as torch.nn.utils.clip_grad_norm_ (sync: the round's mean)",
           check=_OPTIONAL_POSITIVE, group="optimizer", metavar="C"),
    Option("lr", float, 0.1, "learning rate", check=_POSITIVE, group="optimizer"),
    Option("momentum", float, 0.9, "momentum coefficient (momentum optimizer)", check=_UNIT,
           group="optimizer"),
    Option("nesterov", bool, False, "Nesterov momentum (momentum optimizer)", group="optimizer"),
    Option("weight_decay", float, None, "weight decay: L2, added to the gradient; decoupled "
           "for adamw", check=(lambda v: v is None or v >= 0, "a number >= 0"),
           group="optimizer", default_text="0.01 with --optimizer adamw (as torch.optim.AdamW), "
           "the class's own default for a torch.optim class, else 0"),
    # batches and balancing
    Option("batch", int, 32, "samples per gradient (per worker; the global batch is batch x "
           "workers)", check=_POSITIVE_INT, group="balancing"),
    Option("batch_policy", str, "fixed", "fixed: every worker uses --batch; proportional: "
           "batch in proportion to each worker's rate", ("fixed", "proportional"), group="balancing"),
    Option("min_batch", int, 1, "smallest batch the proportional policy may give",
           check=_POSITIVE_INT, group="balancing"),
    Option("max_batch", int, 4096, "largest batch the proportional policy may give",
           check=_POSITIVE_INT, group="balancing"),
    Option("sit_out", int, 1, "sync with proportional batches: 1 lets a worker too slow to "
           "finish even --min-batch samples within the others' step sit rounds out (its data "
           "goes to the others; it is tried again every few seconds)", (0, 1), group="balancing"),
    Option("balancer", str, "load", "shard assignment policy",
           ("static", "round-robin", "demand", "load", "predictive"), group="balancing"),
    Option("rebalance_interval", float, 2.0, "seconds between balancer decisions",
           check=_POSITIVE, group="balancing", metavar="SECONDS"),
    Option("store", str, "shared", "shared: every rank reads every shard; local: each rank "
           "reads only shards placed on it", ("shared", "local"), group="balancing"),
    Option("replicas", int, 1, "local store: copies of each shard", check=_POSITIVE_INT,
           group="balancing", metavar="R"),
    Option("cache_mb", float, 0.0, "keep shards in memory after their first read when all "
           "those a rank may read fit in this many MB (0: off); injected slow reads then slow "
           "the first read of each shard only", check=_NON_NEGATIVE, group="balancing",
           metavar="MB"),
    # stopping and evaluation
    Option("epochs", int, 5, "epochs to train", check=_POSITIVE_INT, group="stopping"),
    Option("max_seconds", float, None, "stop after this many seconds of training",
           check=_OPTIONAL_POSITIVE, group="stopping", metavar="T"),
    Option("target_accuracy", float, None, "stop once test accuracy reaches this",
           check=_FRACTION, group="stopping", metavar="A"),
    Option("eval_interval", float, 5.0, "seconds between evaluations on test.h5 (also at "
           "each epoch end); with several ranks they run while training goes on, and one "
           "due while the last still runs is skipped (an epoch end's waits its turn)",
           check=_POSITIVE, group="stopping", metavar="SECONDS"),
    Option("eval_every", int, None, "also evaluate every N samples applied, counted over the "
           "run as `mpilb report` counts them: evaluations at the same sample counts whatever "
           "the machine's speed (queued behind one still running, not skipped)",
           check=(lambda v: v is None or v >= 1, "an integer >= 1"), group="stopping",
           metavar="N"),
    # experiments
    Option("inject", list, [], "simulated heterogeneity RANKS:KIND[=VALUE][@START[-END]]"
           "[,p=PROB] (repeatable)", group="experiments", metavar="SPEC"),
    Option("seed", int, 0, "seed for initialisation, shuffles and injection",
           check=(lambda v: v >= 0, "an integer >= 0"), group="experiments"),
    # output and fault tolerance
    Option("log", str, None, "run log (HDF5) written by rank 0; default: a new runs/NNN.h5 "
           "(the next free number) in the working directory", group="output", metavar="RUN.h5"),
    Option("checkpoint", str, None, "checkpoint file (HDF5); default: the log's name with "
           ".ckpt.h5 (runs/007.h5 -> runs/007.ckpt.h5)", group="output", metavar="CKPT.h5"),
    Option("checkpoint_interval", float, 60.0, "seconds between checkpoints",
           check=_POSITIVE, group="output", metavar="SECONDS"),
    Option("resume", bool, False, "continue from --checkpoint", group="output"),
    Option("worker_timeout", float, 60.0, "a worker silent this long is declared lost",
           check=_POSITIVE, group="output", metavar="SECONDS"),
    Option("survive_signals", bool, False, "run each rank under a small supervisor process "
           "that exits with a status when the rank is killed by a signal (kill -9, OOM), so that "
           "mpiexec -disable-auto-cleanup (and Open MPI 4's mpirun --mca "
           "orte_abort_on_non_zero_status 0) keep the other ranks (docs/faults.md)",
           group="output"),
    Option("join", bool, True, "take workers that join the run while it runs (mpilb join "
           "RUN.h5, docs/membership.md); --no-join refuses them", group="output"),
    Option("respawn", bool, False, "start a replacement (MPI_Comm_spawn, on the lost one's "
           "host where it can) for each worker declared lost, at most one per lost worker; "
           "async and ssp, one store, not --store local (docs/membership.md)", group="output"),
    Option("progress", bool, True, "live progress on rank 0 (--no-progress silences it)",
           group="output"),
    # models from user code, schedules, validation (docs/models.md)
    Option("model_arg", list, [], "keyword argument for a user model, KEY=VALUE with VALUE a "
           "TOML scalar (repeatable; [model_args] table in a config file)",
           group="data and model", metavar="KEY=VALUE"),
    Option("lr_schedule", str, "constant", "learning-rate schedule over the run, applied by the "
           "server on its update count: step = x0.1 at 50% and 75%, cosine = to 0",
           ("constant", "step", "cosine"), group="optimizer"),
    Option("warmup", str, "0", "linear learning-rate warmup: N updates, or Ns seconds (e.g. 5s); "
           "replaces --correction lookahead's own ramp of 40 gradients",
           check=(lambda v: _warmup_ok(v), "an integer >= 0 (updates) or a number of seconds with "
                  "an s suffix, e.g. 200 or 5s"), group="optimizer", metavar="N|Ns"),
    Option("validation_fraction", float, 0.0, "hold out this fraction of the training shards "
           "(whole shards, at least one) for --target-* and stopping, so the test set is not "
           "used to decide", check=_UNIT, group="stopping", metavar="F"),
    Option("target_metric", float, None, "stop once the model's metric (accuracy, r2, ...) "
           "reaches this", group="stopping", metavar="V"),
    Option("progress_interval", float, None, "seconds between progress lines when stderr is "
           "not a terminal (the first comes within 1 s)", check=_OPTIONAL_POSITIVE,
           group="output", metavar="S", default_text="5 when the launcher's output is a "
           "terminal, 60 otherwise (a batch job's output file)"),
    Option("tensorboard", str, None, "also write TensorBoard scalars (loss, metric, rates, "
           "utilization, staleness) into DIR; needs `pip install 'mpilb[tensorboard]'`",
           group="output", metavar="DIR"),
    Option("save_best", bool, False, "also keep the checkpoint of the best evaluation (the "
           "validation metric with --validation-fraction, else the test metric) in "
           "RUN.best.ckpt.h5 beside --checkpoint", group="output"),
    Option("overwrite", bool, False, "replace an existing --log (and its checkpoint) instead "
           "of refusing to start", group="output"),
    Option("servers", int, 1, "parameter stores, each holding a slice of the parameters "
           "(rank 0 is one and coordinates), the other ranks work: K stores go on K different "
           "nodes (each node's lowest rank; on one node ranks 0..K-1), per-node puts one "
           "beside the workers of every node (docs/scaling.md)",
           check=(lambda v: v == "per-node" or v >= 1, "an integer >= 1 or per-node"),
           group="mode", metavar="K|per-node", words=("per-node",)),
    Option("wire", str, "fp32", "element type of gradients (pushes) and parameters (replies) "
           "between workers and stores: bf16 and fp16 halve the bytes; the stores keep fp32 "
           "parameters and optimizer state, the workers convert (docs/cluster.md)",
           ("fp32", "bf16", "fp16"), group="mode"),
    Option("chunk_kb", int, 128, "between a worker and a store on different nodes, pushes "
           "and replies go in chunks of about KB kilobytes, and an async store applies and "
           "answers each chunk as it arrives (the two directions of a link overlap); 0: one "
           "message (docs/cluster.md)", check=(lambda v: v >= 0, "an integer >= 0"),
           group="mode", metavar="KB"),
)

# Options that do nothing given another option's value: (option, applies(cfg), the option
# that decides, why). Set on the command line, such an option is an error naming both; set
# in a config file (often shared by several runs), it is a warning (docs/configuration.md).
NO_EFFECT: tuple[tuple[str, Callable[[Any], bool], str, str], ...] = (
    ("hidden", lambda c: c.model == "mlp", "model", "only the mlp has hidden layers"),
    ("momentum", lambda c: c.optimizer == "momentum", "optimizer", "only the momentum "
     "optimizer uses it; a torch.optim class takes --optimizer-arg momentum=V"),
    ("nesterov", lambda c: c.optimizer == "momentum", "optimizer", "only the momentum "
     "optimizer uses it; a torch.optim class takes --optimizer-arg nesterov=true"),
    ("staleness_bound", lambda c: c.mode == "ssp", "mode", "only --mode ssp bounds staleness"),
    ("dc_lambda", lambda c: c.correction == "dc", "correction", "only --correction dc uses it"),
    ("weight_prediction", lambda c: c.mode != "sync" or c.weight_prediction == "off", "mode",
     "a sync round's gradients are all computed on the parameters they are applied to"),
    ("correction", lambda c: c.mode != "sync" or c.correction == "none", "mode",
     "a sync round's gradients are all computed on the parameters they are applied to: "
     "nothing is stale"),
    ("min_batch", lambda c: c.batch_policy == "proportional", "batch_policy",
     "a fixed batch is --batch"),
    ("max_batch", lambda c: c.batch_policy == "proportional", "batch_policy",
     "a fixed batch is --batch"),
    ("sit_out", lambda c: c.mode == "sync" and c.batch_policy == "proportional", "mode",
     "only sync rounds with --batch-policy proportional sit workers out"),
    ("replicas", lambda c: c.store == "local", "store", "a shared store reads every shard"),
    ("cuda_aware", lambda c: c.device != "cpu", "device", "CPU workers send host memory"),
    ("progress_interval", lambda c: c.progress, "progress", "no progress is shown"),
)


def _warmup_ok(text) -> bool:
    text = str(text).strip()
    try:
        value = float(text[:-1]) if text.endswith("s") else int(text)
    except ValueError:
        return False
    return value >= 0

OPTION_BY_NAME = {o.name: o for o in OPTIONS}


def closest(name: str, candidates) -> str:
    """Return a ' (did you mean X?)' hint for a misspelt name, or ''."""
    match = difflib.get_close_matches(name, list(candidates), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(m) for m in match)}?)" if match else ""


def default_cache_dir() -> Path:
    """$MPILB_CACHE, else ~/.cache/mpilb."""
    return Path(os.environ.get("MPILB_CACHE") or Path.home() / ".cache" / "mpilb")
