"""The Python API: ``mpilb.train`` and ``mpilb.load``.

``mpilb.train(model=..., data=..., **options)`` runs exactly what ``mpilb train`` runs (same
options, checks, engine and run log) from a user's script launched as
``mpiexec -n P python script.py``; it returns the summary dict on rank 0 and None on the
other ranks, and raises :class:`~mpilb.errors.UsageError` (and friends) where the command
would print one line and exit.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from mpilb.config.build import OPTION_BY_NAME, closest
from mpilb.errors import MpilbError, UsageError
from mpilb.mpi.launcher import one_blas_thread_per_rank

# The rest is imported inside the functions: numpy must wait until train() has set the BLAS
# threads (one per rank, as the command does), and mpi4py starts MPI when imported.


def train(model=None, data=None, **options) -> Optional[dict]:
    """Train a model over MPI (or in-process with one rank), as ``mpilb train`` does.

    Args:
        model: a built-in name ("mlp"), a ``FILE.py:NAME`` / ``package.module:NAME`` string,
            an :class:`mpilb.Model` (class or instance), a ``torch.nn.Module`` class or
            instance, or a callable returning one of those.
        data: the dataset directory (``mpilb prepare``).
        **options: any ``mpilb train`` option with underscores (``epochs=20``,
            ``lr_schedule="cosine"``, ``inject=["3:compute=4"]``); ``model_args={...}``
            gives the model's keyword arguments (as ``--model-arg``).

    Returns:
        The run's summary (docs/logs.md, "Summary keys": the object ``mpilb report --json`` prints) on rank 0;
        None on the other ranks.

    Raises:
        UsageError: a bad option, dataset or model (the same one line the command prints).
        MpilbError: the run failed.
    """
    one_blas_thread_per_rank()   # before numpy (if the script has not imported it yet)
    from mpilb.models.user import model_spec

    for key in options:   # named as the caller wrote them, not as command-line options
        if key not in OPTION_BY_NAME and key != "model_args":
            raise UsageError(f"mpilb.train: unknown keyword {key!r}{closest(key, OPTION_BY_NAME)}")
    values: dict[str, Any] = dict(options)
    model_args = values.pop("model_args", None)
    if model_args:
        if not isinstance(model_args, dict):
            raise UsageError("model_args must be a dict of keyword arguments, e.g. {'width': 64}")
        values["model_arg"] = list(values.get("model_arg", [])) + [
            f"{k}={json.dumps(v)}" for k, v in model_args.items()]
    if model is not None:
        values["model"] = model_spec(model)
    if data is not None:
        values["data"] = os.fspath(data)
    for key in ("inject", "model_arg", "optimizer_arg"):
        if isinstance(values.get(key), str):
            values[key] = [values[key]]
    from mpilb.mpi import comm as C
    from mpilb.cli.launch import train as launch_train

    result: dict = {}
    code = launch_train(None, values, raise_errors=True, result=result)
    if code not in (0, 3):
        raise MpilbError(f"training failed (exit code {code}); see the messages above and the run log")
    _, rank, _ = C.world()
    if rank != 0:
        return None
    from mpilb.runfiles.summary import summarize_log

    return summarize_log(result["cfg"].output.log)


def load(checkpoint, model=None):
    """The trained model in a checkpoint.

    Args:
        checkpoint: a checkpoint file (``--checkpoint``, by default beside the run log).
        model: the model the run trained, when the checkpoint cannot name an importable one
            (a model handed to :func:`train` as an object, or defined in a script): a class,
            factory or instance, as for :func:`train`.

    Returns:
        A ``torch.nn.Module`` with the trained parameters and buffers (in eval mode) for a
        torch model; otherwise the :class:`mpilb.Model`, with the trained flat vector in its
        ``params`` attribute (``model.evaluate(model.params, x, y)``).
    """
    from mpilb.runfiles.export import build_from_checkpoint, read_checkpoint

    ckpt = read_checkpoint(checkpoint)
    built = build_from_checkpoint(ckpt, model)
    if hasattr(built, "module"):          # the torch adapter
        built.state_dict(ckpt.params, ckpt.state)   # binds parameters and buffers
        built.module.eval()
        return built.module
    built.params = ckpt.params
    if ckpt.state is not None:
        built.set_state(ckpt.state)
    return built
