"""Training configuration, built once at the edge: defaults < config file < command line.

The table :data:`~mpilb.config.options.OPTIONS` is the single source of truth: the argument
parser, TOML config files, validation (mpilb.config.validate) and the generated
configuration reference (docs/configuration.md, mpilb.config.reference) all read it.
Options on the command line override keys in a config file; either spelling (dashes or
underscores) is accepted in the file. :func:`build_config` returns the typed
:class:`~mpilb.config.sections.Config`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - older Pythons get tomli from setup.py
    import tomli as tomllib  # type: ignore[no-redef]

from mpilb.config.options import OPTION_BY_NAME, OPTIONS, Option, closest, is_torch_optimizer
from mpilb.config.reference import reference_markdown
from mpilb.config.sections import Config, parse_hidden
from mpilb.core.corrections import (ASYNC_DEFAULT, MOMENTUM_DEFAULT, MOMENTUM_RULES, dana_fits,
                                    predicted_default)
from mpilb.config.validate import check_combinations, check_no_effect, check_value, warn
from mpilb.errors import UsageError

__all__ = ["Config", "build_config", "closest", "load_toml", "parse_hidden", "reference_markdown",
           "unknown_key"]


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
        check_value(opt, values[name], source)
    for name, raw in (cli_values or {}).items():
        if name not in OPTION_BY_NAME:
            raise UsageError(f"unknown option --{name.replace('_', '-')}{closest(name, OPTION_BY_NAME)}")
        opt = OPTION_BY_NAME[name]
        values[name] = _coerce(opt, raw, "")
        check_value(opt, values[name], "")
    if values["weight_decay"] is None and not is_torch_optimizer(values["optimizer"]):
        values["weight_decay"] = 0.01 if values["optimizer"] == "adamw" else 0.0
    if values["correction"] is None:
        # a momentum recipe's workers predict the parameters unless told not to (below), and
        # the stores keep a momentum per worker (dana; where its velocities do not fit, gap or
        # lookahead: settle_correction); told not to predict, dynamic
        predicts = values["optimizer"] == "momentum" and values["weight_prediction"] != "off"
        values["correction"] = ("none" if values["mode"] == "sync" else
                                MOMENTUM_DEFAULT if predicts else ASYNC_DEFAULT)
    if values["pipeline"] is None:
        # async computes ahead by default: 1.03-1.21x the samples/s where measured, at the
        # same accuracy (docs/balancing.md). Not with ssp (its bound stays what it says) or
        # sync (it cannot), nor under --correction inverse: computing ahead about doubles a
        # gradient's staleness, which that correction divides the learning rate by (digits,
        # 20 epochs: 0.94-0.95 final accuracy instead of 0.96-0.97). Nor with a momentum
        # recipe under a momentum policy (lookahead or dynamic, the defaults, or momentum):
        # twice the staleness cost 1.5x the samples to target (docs/benchmarks/staleness.md)
        values["pipeline"] = int(values["mode"] == "async" and values["correction"] != "inverse"
                                 and not (values["correction"] in MOMENTUM_RULES
                                          and values["optimizer"] == "momentum"))
    if values["weight_prediction"] is None:
        # with a momentum recipe the parameters move steadily enough to extrapolate by the
        # staleness; with plain SGD they do not, and it gained nothing there
        # (docs/benchmarks/staleness.md)
        values["weight_prediction"] = ("on" if values["mode"] in ("async", "ssp")
                                       and values["optimizer"] == "momentum" else "off")
    given = {name: source or "the config file" for name in (file_values or {})}
    given.update({name: "" for name in (cli_values or {})})
    parse_hidden(values["hidden"])
    cfg = Config.from_values(values, given)
    check_combinations(cfg)
    for warning in check_no_effect(cfg):
        warn(warning)
    return cfg


if __name__ == "__main__":  # pragma: no cover
    print(reference_markdown(), end="")


def settle_correction(cfg: Config, slice_floats: int, workers: int) -> Config:
    """`cfg` with its default correction settled once rank 0 has built the model, for stores
    of at most `slice_floats` parameters each and `workers` workers: `dana` where its
    velocities fit (:func:`~mpilb.core.corrections.dana_fits`), else
    :func:`~mpilb.core.corrections.predicted_default` (`gap` for small models, `lookahead`
    otherwise); `cfg` itself where --correction was given or the default is another (sync,
    no momentum, no prediction)."""
    u = cfg.updates
    if "correction" in cfg.given or u.correction != MOMENTUM_DEFAULT or dana_fits(slice_floats, workers):
        return cfg
    u = dataclasses.replace(u, correction=predicted_default(slice_floats, u.wire))
    return dataclasses.replace(cfg, updates=u)
