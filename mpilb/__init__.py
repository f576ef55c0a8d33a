"""mpilb: load-balanced asynchronous data-parallel training for MPI clusters.

Public surface: the ``mpilb`` command (:mod:`mpilb.cli.main`) and, in Python,

- :class:`Model`: the model protocol (built-ins and user models follow it),
- :func:`train`: the same run as ``mpilb train``, from a script under ``mpiexec``,
- :func:`load`: a trained model back from a checkpoint,
- :func:`r2_score`, :func:`get_array_module`: helpers for writing models,
- the errors :class:`UsageError`, :class:`DataError`, :class:`MpilbError`.

The machinery lives in modules a reader finds by name: ``server`` (rank 0 parameter server),
``worker``, ``balancer`` (pure policies), ``dataset``/``prepare``/``ingest``/``shards`` (HDF5
shard data), ``models`` (protocol, built-ins, user models, torch adapter), ``runlog``/
``report``, ``comm`` (the only MPI module) and ``backend`` (the only CuPy module).
"""

__version__ = "0.1.0"

from mpilb.errors import DataError, MpilbError, UsageError  # noqa: E402

# Imported on first use, by name (so that no module importing the package reaches MPI, the
# CLI or numpy through it): `import mpilb` and the `mpilb` command must not import numpy
# before the command has set the BLAS thread count for a multi-rank job.
_LAZY = {"Model": "models.base", "r2_score": "models.base", "get_array_module": "backend",
         "train": "api", "load": "api"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DataError", "Model", "MpilbError", "UsageError", "__version__", "get_array_module",
           "load", "r2_score", "train"]
