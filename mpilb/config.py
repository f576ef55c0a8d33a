"""Training configuration: every `mpilb train` option, defined once.

The table :data:`OPTIONS` is the single source of truth: the argument parser, TOML config
files, validation and the generated configuration reference (docs/configuration.md) all read
it. Options on the command line override keys in a config file; either spelling (dashes or
underscores) is accepted in the file.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - older Pythons get tomli from setup.py
    import tomli as tomllib  # type: ignore[no-redef]

from .errors import UsageError


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

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_POSITIVE = (lambda v: v > 0, "a number > 0")
_NON_NEGATIVE = (lambda v: v >= 0, "a number >= 0")
_POSITIVE_INT = (lambda v: v >= 1, "an integer >= 1")
_OPTIONAL_POSITIVE = (lambda v: v is None or v > 0, "a number > 0")
_FRACTION = (lambda v: v is None or 0 < v <= 1, "a number in (0, 1]")
_UNIT = (lambda v: 0 <= v < 1, "a number in [0, 1)")

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
    Option("correction", str, None, "staleness correction: momentum = the optimizer's "
           "momentum lowered as the measured staleness grows (asynchrony adds momentum of "
           "its own); none = as given (the old default); inverse = lr/max(1,tau); dc = "
           "delay-compensated ASGD", ("none", "momentum", "inverse", "dc"),
           group="mode", default_text="momentum with --mode async or ssp, none with sync"),
    Option("dc_lambda", float, 0.04, "dc: the compensation strength lambda", check=_NON_NEGATIVE,
           group="mode"),
    Option("pipeline", int, None, "1: compute the next gradient while the previous push is in "
           "flight (one more step of staleness, less waiting)", (0, 1), group="mode",
           default_text="1 with --mode async, 0 with ssp or sync, under --correction inverse, "
           "or under --correction momentum with --optimizer momentum"),
    # optimizer
    Option("optimizer", str, "sgd", "optimizer run by the server", ("sgd", "momentum", "adam"),
           group="optimizer"),
    Option("lr", float, 0.1, "learning rate", check=_POSITIVE, group="optimizer"),
    Option("momentum", float, 0.9, "momentum coefficient (momentum optimizer)", check=_UNIT,
           group="optimizer"),
    Option("nesterov", bool, False, "Nesterov momentum (momentum optimizer)", group="optimizer"),
    Option("weight_decay", float, 0.0, "L2 weight decay", check=_NON_NEGATIVE, group="optimizer"),
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
           "each epoch end)", check=_POSITIVE, group="stopping", metavar="SECONDS"),
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
    Option("progress", bool, True, "live progress on rank 0 (--no-progress silences it)",
           group="output"),
    # models from user code, schedules, validation (docs/models.md)
    Option("model_arg", list, [], "keyword argument for a user model, KEY=VALUE with VALUE a "
           "TOML scalar (repeatable; [model_args] table in a config file)",
           group="data and model", metavar="KEY=VALUE"),
    Option("lr_schedule", str, "constant", "learning-rate schedule over the run, applied by the "
           "server on its update count: step = x0.1 at 50% and 75%, cosine = to 0",
           ("constant", "step", "cosine"), group="optimizer"),
    Option("warmup", str, "0", "linear learning-rate warmup: N updates, or Ns seconds (e.g. 5s)",
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
    Option("overwrite", bool, False, "replace an existing --log (and its checkpoint) instead "
           "of refusing to start", group="output"),
    Option("servers", int, 1, "parameter stores: ranks 0..K-1 each hold a slice of the "
           "parameters (rank 0 also coordinates); workers are ranks K..P-1",
           check=_POSITIVE_INT, group="mode", metavar="K"),
)

# Options that do nothing given another option's value: (option, applies(cfg), the option
# that decides, why). Set on the command line, such an option is an error naming both; set
# in a config file (often shared by several runs), it is a warning (docs/configuration.md).
NO_EFFECT: tuple[tuple[str, Callable[[Any], bool], str, str], ...] = (
    ("hidden", lambda c: c.model == "mlp", "model", "only the mlp has hidden layers"),
    ("momentum", lambda c: c.optimizer == "momentum", "optimizer",
     "only the momentum optimizer uses it"),
    ("nesterov", lambda c: c.optimizer == "momentum", "optimizer",
     "only the momentum optimizer uses it"),
    ("staleness_bound", lambda c: c.mode == "ssp", "mode", "only --mode ssp bounds staleness"),
    ("dc_lambda", lambda c: c.correction == "dc", "correction", "only --correction dc uses it"),
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


@dataclass
class Config:
    """Validated training configuration (attribute per option)."""

    values: dict = field(default_factory=dict)
    # where each option the user set came from: "" the command line, else the config
    # file's path (only in the Config that build_config returns; for refusing or warning
    # about an option with no effect, see no_effect)
    given: dict = field(default_factory=dict, compare=False, repr=False)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def to_json(self) -> str:
        return json.dumps(self.values, sort_keys=True)

    @property
    def hidden_sizes(self) -> tuple[int, ...]:
        return parse_hidden(self.values["hidden"])

    @property
    def workers_cuda_aware(self) -> bool:
        return bool(self.values["cuda_aware"]) or os.environ.get("MPILB_CUDA_AWARE", "") == "1"


def closest(name: str, candidates) -> str:
    """Return a ' (did you mean X?)' hint for a misspelt name, or ''."""
    match = difflib.get_close_matches(name, list(candidates), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(m) for m in match)}?)" if match else ""


def parse_hidden(text) -> tuple[int, ...]:
    """Parse `--hidden 256,128` into (256, 128); UsageError for anything else."""
    if isinstance(text, (list, tuple)):
        parts = [str(p) for p in text]
    else:
        parts = [p.strip() for p in str(text).split(",")]
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if not sizes or any(s < 1 for s in sizes):
        raise UsageError(f"--hidden {text!r}: expected comma-separated positive layer sizes, e.g. 256,128")
    return sizes


def _coerce(opt: Option, value: Any, source: str) -> Any:
    where = f"{source}: {opt.name}" if source else opt.flag
    if value is None:
        return None
    try:
        if opt.type is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if opt.type is list:
            return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
        if opt.type is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if opt.type is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if opt.type is str and opt.name == "hidden" and isinstance(value, (list, tuple)):
            return ",".join(str(v) for v in value)
        return str(value)
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                list: "a list of strings"}[opt.type]
        raise UsageError(f"{where} = {value!r}: expected {kind}") from None


def _validate_value(opt: Option, value: Any, source: str) -> None:
    where = f"{source}: {opt.name}" if source else opt.flag
    if value is None:
        return
    if opt.choices is not None and value not in opt.choices:
        allowed = ", ".join(str(c) for c in opt.choices)
        raise UsageError(f"{where} = {value!r}: allowed values are {allowed}{closest(str(value), map(str, opt.choices))}")
    if opt.check is not None and not opt.check[0](value):
        raise UsageError(f"{where} = {value!r}: must be {opt.check[1]}")


def load_toml(path: str) -> dict:
    """Read a TOML config file into {option name: raw value}; UsageError on any problem."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise UsageError(f"{path}: config file not found") from None
    except PermissionError:
        raise UsageError(f"{path}: config file is not readable (permission denied)") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: is a directory, expected a TOML config file") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                         f"at offset {exc.start}); save the file as UTF-8") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the config file ({exc.strerror or exc})") from None
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in OPTION_BY_NAME and name != "model_args":
            raise UsageError(unknown_key(path, key))
        if name == "model_args":   # [model_args] table: the --model-arg KEY=VALUE pairs
            if not isinstance(value, dict):
                raise UsageError(f"{path}: model_args must be a table, e.g. [model_args] width = 64")
            out.setdefault("model_arg", [])
            out["model_arg"] = out["model_arg"] + [f"{k}={json.dumps(v)}" for k, v in value.items()]
            continue
        if isinstance(value, dict):
            raise UsageError(f"{path}: key {key!r} must be a value, not a table")
        out[name] = value
    return out


def unknown_key(path, key: str) -> str:
    """The message for an unknown key of a config file: the closest known key if there is
    one, else every valid key (docs/cli.md: the error names the key and the allowed values)."""
    keys = sorted([*OPTION_BY_NAME, "model_args"])
    hint = closest(key.replace("-", "_"), keys)
    if hint:
        return (f"{path}: unknown key {key!r}{hint}; valid keys are the `mpilb train` options "
                "with underscores (docs/configuration.md)")
    return f"{path}: unknown key {key!r}; valid keys: {', '.join(keys)}"


def build_config(file_values: Optional[dict] = None, cli_values: Optional[dict] = None,
                 source: str = "") -> Config:
    """Merge defaults < config file < command line, coerce types and validate everything.

    Args:
        file_values: raw values from a TOML file (names with underscores).
        cli_values: values given on the command line (only those the user set).
        source: the config file's path, used in error messages.

    Returns:
        The validated Config.

    Raises:
        UsageError: naming the key and the allowed values.
    """
    values = {o.name: (list(o.default) if isinstance(o.default, list) else o.default) for o in OPTIONS}
    for name, raw in (file_values or {}).items():
        opt = OPTION_BY_NAME[name]
        values[name] = _coerce(opt, raw, source)
        _validate_value(opt, values[name], source)
    for name, raw in (cli_values or {}).items():
        if name not in OPTION_BY_NAME:
            raise UsageError(f"unknown option --{name.replace('_', '-')}{closest(name, OPTION_BY_NAME)}")
        opt = OPTION_BY_NAME[name]
        values[name] = _coerce(opt, raw, "")
        _validate_value(opt, values[name], "")
    if values["correction"] is None:
        values["correction"] = "none" if values["mode"] == "sync" else "momentum"
    if values["pipeline"] is None:
        # async computes ahead by default: 1.03-1.21x the samples/s where measured, at the
        # same accuracy (docs/balancing.md). Not with ssp (its bound stays what it says) or
        # sync (it cannot), nor under --correction inverse: computing ahead about doubles a
        # gradient's staleness, which that correction divides the learning rate by (digits,
        # 20 epochs: 0.94-0.95 final accuracy instead of 0.96-0.97). Nor with a momentum
        # recipe under the momentum policy: twice the staleness cost 1.5x the samples to
        # target (docs/benchmarks/staleness.md)
        values["pipeline"] = int(values["mode"] == "async" and values["correction"] != "inverse"
                                 and not (values["correction"] == "momentum"
                                          and values["optimizer"] == "momentum"))
    given = {name: source or "the config file" for name in (file_values or {})}
    given.update({name: "" for name in (cli_values or {})})
    cfg = Config(values, given)
    parse_hidden(values["hidden"])
    _check_combinations(cfg)
    for warning in _check_no_effect(cfg):
        _warn(warning)
    return cfg


def _show(name: str, value: Any, source: str) -> str:
    if source:
        return f"{name} = {json.dumps(value)}"
    if value is True or value is False:
        return ("--" if value else "--no-") + name.replace("_", "-")
    return f"{OPTION_BY_NAME[name].flag} {value}"


def _check_no_effect(cfg: Config) -> list[str]:
    """UsageError for an option set on the command line that has no effect (see NO_EFFECT);
    the warnings for such options set in the config file (where each came from:
    ``cfg.given``)."""
    warnings = []
    for name, applies, other, why in NO_EFFECT:
        if applies(cfg) or name not in cfg.given:
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
    _warn(f"{source}: {_show(name, cfg.values[name], source)} has no effect with {given_what}: "
          f"{why}; ignored")


def _warn(text: str) -> None:
    """A warning, from rank 0 only (every rank builds the configuration)."""
    import sys

    rank = next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
                 if os.environ.get(v, "").strip().isdigit()), "0")
    if int(rank) == 0:
        print(f"mpilb: warning: {text}", file=sys.stderr, flush=True)


def _check_combinations(cfg: Config) -> None:
    if cfg.min_batch > cfg.max_batch:
        raise UsageError(f"--min-batch {cfg.min_batch} is larger than --max-batch {cfg.max_batch}")
    if cfg.resume and not (cfg.checkpoint or cfg.log):
        raise UsageError("--resume needs --log RUN.h5 (the run to continue; its checkpoint is "
                         "RUN.ckpt.h5) or --checkpoint CKPT.h5")
    if cfg.resume and cfg.overwrite:
        raise UsageError("--resume continues the log and checkpoint that --overwrite would "
                         "replace: give one of them")
    if cfg.pipeline and cfg.mode == "sync":
        raise UsageError("--pipeline 1 cannot be combined with --mode sync (a sync round waits for every gradient)")
    if cfg.log and Path(cfg.log).is_dir():
        raise UsageError(f"--log {cfg.log}: is a directory, expected a file name such as run.h5")


def default_cache_dir() -> Path:
    """$MPILB_CACHE, else ~/.cache/mpilb."""
    return Path(os.environ.get("MPILB_CACHE") or Path.home() / ".cache" / "mpilb")


# the reference page lives in its own module; it reads the tables above
from .options_doc import reference_markdown  # noqa: E402


if __name__ == "__main__":  # pragma: no cover
    print(reference_markdown(), end="")
