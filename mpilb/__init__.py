"""mpilb: load-balanced asynchronous data-parallel training for MPI clusters.

Public surface: the ``mpilb`` command (:mod:`mpilb.cli.main`) and, in Python,

- :class:`Model`: the model protocol (built-ins and user models follow it),
- :func:`train`: the same run as ``mpilb train``, from a script under ``mpiexec``,
- :func:`load`: a trained model back from a checkpoint,
- :func:`r2_score`, :func:`get_array_module`: helpers for writing models,
- :func:`read_log` (every log group as a pandas DataFrame) and :func:`read_columns` (NumPy
  arrays): a run log read back,
- the errors :class:`UsageError`, :class:`DataError`, :class:`MpilbError`.

The machinery lives in packages a reader finds by name (docs/architecture.md, "Where things
live"): ``cli`` (the command), ``server`` (rank 0), ``worker``, ``run`` (what the server and
the serial trainer share), ``core`` (the pure decisions), ``mpi`` (the only mpi4py user),
``data`` (HDF5 shards), ``runfiles`` (log, checkpoint, report, export), ``config``, ``models``,
``simulate``, ``clusterbox``; ``backend`` is the only CuPy module.
"""

__version__ = "0.1.0"

from mpilb.errors import DataError, MpilbError, UsageError  # noqa: E402

# Imported on first use, by name (so that no module importing the package reaches MPI, the
# CLI or numpy through it): `import mpilb` and the `mpilb` command must not import numpy
# before the command has set the BLAS thread count for a multi-rank job.
# (the run log's readers keep these names whatever module holds them: docs/logs.md)
_LAZY = {"Model": "models.base", "r2_score": "models.base", "get_array_module": "backend",
         "train": "api", "load": "api", "read_log": ("runfiles.runlog", "read"),
         "read_columns": "runfiles.runlog"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        where, attr = _LAZY[name] if isinstance(_LAZY[name], tuple) else (_LAZY[name], name)
        return getattr(importlib.import_module(f"{__name__}.{where}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DataError", "Model", "MpilbError", "UsageError", "__version__", "get_array_module",
           "load", "r2_score", "read_columns", "read_log", "train"]
