"""Models from user code: ``--model FILE.py:NAME`` or ``--model package.module:NAME``.

NAME may be an :class:`mpilb.Model` subclass, a ``torch.nn.Module`` subclass, or a callable
returning an instance of either. It is called with the keyword arguments its signature
accepts among ``input_shape``, ``num_classes`` and ``num_targets``, plus every
``--model-arg`` (values parsed as TOML scalars). Every rank builds it from ``--seed``.

Everything a user can get wrong here is a :class:`~mpilb.errors.UsageError` naming the spec,
the file and what to do; torch is never imported by this module (the user's code imports
it, and only then is :mod:`mpilb.models.torch_adapter` loaded).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import random
import sys
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

import numpy as np

from mpilb.errors import UsageError
from mpilb.models.base import Model

TORCH_HINT = ('PyTorch is not installed: pip install "mpilb[torch]" (on CPU-only nodes first '
              'pip install torch --index-url https://download.pytorch.org/whl/cpu, ~0.2 GB '
              'instead of the CUDA build\'s several GB)')
# Objects handed to mpilb.train(model=...), registered by model_spec under "python:<name>".
_OBJECTS: dict[str, Any] = {}


def model_spec(model) -> str:
    """A ``--model`` value for ``model``: a string as it is, an importable class or function
    as ``module:NAME``, any other object registered for this process under
    ``python:<name>`` (every rank runs the same script, so every rank does)."""
    if isinstance(model, str):
        return model
    module = getattr(model, "__module__", "") or ""
    if ((inspect.isclass(model) or inspect.isfunction(model)) and module not in ("__main__", "")
            and not module.startswith("mpilb_user_") and "<locals>" not in model.__qualname__):
        return f"{module}:{model.__qualname__}"   # importable: checkpoints can name it
    name = getattr(model, "__qualname__", None) or type(model).__qualname__
    key = f"python:{name}"
    _OBJECTS[key] = model
    return key


def is_user_spec(spec) -> bool:
    return isinstance(spec, str) and (":" in spec)


def parse_model_args(items, flag: str = "--model-arg") -> dict:
    """``["width=64", "act=relu"]`` -> ``{"width": 64, "act": "relu"}`` (TOML values);
    ``flag`` names the option in errors."""
    out = {}
    for item in items or []:
        key, sep, text = str(item).partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UsageError(f"{flag} {item!r}: expected KEY=VALUE with KEY a Python name, e.g. width=64")
        try:
            out[key] = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = text.strip()   # a bare word: a string
    return out


def _load_file(spec: str, path: Path):
    if not path.is_file():
        raise UsageError(f"--model {spec}: file {path} not found")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    name = f"mpilb_user_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module   # dataclasses and pickling look their module up here
    # As for a script, the file's directory is importable (`from mymodels import Linear`
    # next to it): first on sys.path while the file runs, last afterwards, so that imports
    # made later (in the constructor, in the evaluation process, which gets rank 0's path)
    # still find it without its files shadowing installed packages.
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        module_spec.loader.exec_module(module)
    except ModuleNotFoundError as exc:
        del sys.modules[name]
        if exc.name == "torch":
            raise UsageError(f"--model {spec}: {path} imports torch; {TORCH_HINT}") from None
        raise UsageError(f"--model {spec}: {path} raised ModuleNotFoundError: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module, reported in one line
        del sys.modules[name]
        raise UsageError(f"--model {spec}: {path} raised {type(exc).__name__}: {exc}") from None
    finally:
        if folder in sys.path:
            sys.path.remove(folder)   # (the first occurrence: the one inserted above)
        if folder not in sys.path:
            sys.path.append(folder)
    return module


def load_object(spec: str):
    """The object NAME names in ``FILE.py:NAME`` or ``package.module:NAME``."""
    if spec.startswith("python:"):
        if spec not in _OBJECTS:
            raise UsageError(f"--model {spec}: not a model handed to mpilb.train in this process")
        return _OBJECTS[spec], "mpilb.train(model=...)"
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise UsageError(f"--model {spec!r}: expected FILE.py:NAME or package.module:NAME")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        module, origin = _load_file(spec, path), str(path)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name == "torch":
                raise UsageError(f"--model {spec}: module {where} imports torch; {TORCH_HINT}") from None
            raise UsageError(f"--model {spec}: cannot import module {where!r} ({exc}); is it on "
                             "PYTHONPATH, or did you mean a file (FILE.py:NAME)?") from None
        except Exception as exc:  # noqa: BLE001
            raise UsageError(f"--model {spec}: importing {where} raised {type(exc).__name__}: {exc}") from None
        origin = getattr(module, "__file__", where) or where
    if not hasattr(module, attr):
        names = sorted(n for n, v in vars(module).items()
                       if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v))
                       and getattr(v, "__module__", None) == module.__name__)
        raise UsageError(f"--model {spec}: {origin} has no {attr!r} (it defines: "
                         f"{', '.join(names) or 'no classes or functions'})")
    return getattr(module, attr), f"{origin}:{attr}"


def _torch_adapter():
    """The adapter module, only if the user's code has imported torch already."""
    if "torch" not in sys.modules:
        return None
    import mpilb.models.torch_adapter as torch_adapter   # imports torch

    return torch_adapter


def _call_kwargs(fn, spec: str, where: str, offered: dict, model_args: dict) -> dict:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return dict(model_args)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if var_kw or k in params}
    for key, value in model_args.items():
        if not var_kw and key not in params:
            takes = [n for n, p in params.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            raise UsageError(f"--model-arg {key}: {where}() takes no argument {key!r} "
                             f"(it takes: {', '.join(takes) or 'none'})")
        kwargs[key] = value
    return kwargs


def _seed_everything(seed: int, adapter) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    if adapter is not None:
        adapter.seed(seed)


def build_user_model(spec, input_shape, num_classes: int, target_shape=(), model_args=None,
                     seed: int = 0) -> Model:
    """Build the user's model for a dataset of ``input_shape`` samples.

    Args:
        spec: ``FILE.py:NAME``, ``package.module:NAME`` or ``python:KEY`` (an object
            registered by :func:`mpilb.train`).
        num_classes: classes of the labels, 0 for float targets of ``target_shape``.
        model_args: extra keyword arguments (``--model-arg``).
        seed: seeds Python's, NumPy's and torch's generators before the model is built.

    Returns:
        An :class:`mpilb.Model` (torch modules come wrapped in the adapter).
    """
    model_args = dict(model_args or {})
    obj, where = load_object(spec)
    num_targets = num_classes if num_classes else int(np.prod(target_shape, dtype=np.int64))
    offered = {"input_shape": tuple(input_shape), "num_classes": int(num_classes),
               "num_targets": num_targets}
    adapter = _torch_adapter()
    instance = obj
    if not isinstance(obj, Model) and not (adapter and adapter.is_module(obj)):
        if not callable(obj):
            raise UsageError(f"--model {spec}: {where} is a {type(obj).__name__}, not an mpilb.Model "
                             "subclass, a torch.nn.Module subclass or a callable returning one")
        kwargs = _call_kwargs(obj, spec, where, offered, model_args)
        model_args = {}
        _seed_everything(seed, adapter)
        try:
            instance = obj(**kwargs)
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's constructor, one line
            raise UsageError(f"--model {spec}: {where}() raised {type(exc).__name__}: {exc}") from None
        adapter = _torch_adapter()
    if model_args:
        raise UsageError(f"--model-arg {next(iter(model_args))}: {where} is an instance already "
                         "built; --model-arg only applies to a class or a factory")
    if adapter is not None and adapter.is_module(instance):
        return adapter.TorchModel(instance, num_classes=num_classes, target_shape=target_shape,
                                  input_shape=input_shape, where=f"{spec}")
    if not isinstance(instance, Model):
        raise UsageError(f"--model {spec}: {where} returned a {type(instance).__name__}, not an "
                         "mpilb.Model or a torch.nn.Module")
    n = getattr(instance, "num_params", None)
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise UsageError(f"--model {spec}: {where} has num_params {n!r}; a model needs at least one parameter")
    return instance


def initial_params(model: Model, seed: int, spec) -> np.ndarray:
    """``model.init_params(seed)``, checked: a flat vector of ``model.num_params`` values.

    Raises:
        UsageError: naming the model (``--model SPEC``) when ``init_params`` raises or
            returns the wrong number of values, instead of a shape error deep in the server.
    """
    label = type(model).__qualname__
    try:
        params = model.init_params(seed)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code, one line
        raise UsageError(f"--model {spec}: {label}.init_params({seed}) raised "
                         f"{type(exc).__name__}: {exc}") from None
    shape = getattr(params, "shape", None)
    if shape is None:
        params = np.asarray(params, dtype=np.float32)
        shape = params.shape
    n = int(model.num_params)
    size = int(np.prod(shape, dtype=np.int64))
    if size != n:
        raise UsageError(f"--model {spec}: {label}.init_params({seed}) returned {size} values "
                         f"but num_params is {n}; they must agree")
    if tuple(shape) != (n,):
        raise UsageError(f"--model {spec}: {label}.init_params({seed}) returned an array of "
                         f"shape {tuple(shape)}; expected a flat vector of num_params = {n} values")
    return params
