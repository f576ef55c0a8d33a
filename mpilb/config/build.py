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
from typing import Any, Optional

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - older Pythons get tomli from setup.py
    import tomli as tomllib  # type: ignore[no-redef]

from mpilb.errors import UsageError


from mpilb.config.options import INT32_MAX, NO_EFFECT, OPTION_BY_NAME, OPTIONS, Option, is_torch_optimizer


@dataclass
class Config:
    """Validated training configuration (attribute per option)."""

    values: dict = field(default_factory=dict)
    # where each option the user set came from: "" the command line, else the config
    # file's path (only in the Config that build_config returns; for refusing or warning
    # about an option with no effect, see no_effect)
    given: dict = field(default_factory=dict, compare=False, repr=False)
    # the parameter stores' ranks, placed by node at start-up (launch.py; topology.stores_of)
    store_ranks: tuple = field(default=(), compare=False, repr=False)

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
    if not sizes or any(s < 1 or s > INT32_MAX for s in sizes):
        raise UsageError(f"--hidden {text!r}: expected comma-separated positive layer sizes, e.g. 256,128")
    return sizes


def _coerce(opt: Option, value: Any, source: str) -> Any:
    where = f"{source}: {opt.name}" if source else opt.flag
    if value is None:
        return None
    if isinstance(value, str) and value.strip() in opt.words:
        return value.strip()
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
        kind += "".join(f" or {w}" for w in opt.words)
        raise UsageError(f"{where} = {value!r}: expected {kind}") from None


def _validate_value(opt: Option, value: Any, source: str) -> None:
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


def load_toml(path: str) -> dict:
    """Read a TOML config file into {option name: raw value}; UsageError on any problem."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            # a UTF-8 byte-order mark (Windows editors write one) is not part of the TOML
            raw = tomllib.loads(fh.read().removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
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
    if values["weight_decay"] is None and not is_torch_optimizer(values["optimizer"]):
        values["weight_decay"] = 0.01 if values["optimizer"] == "adamw" else 0.0
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
from mpilb.config.reference import reference_markdown  # noqa: E402


if __name__ == "__main__":  # pragma: no cover
    print(reference_markdown(), end="")
