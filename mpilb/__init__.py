"""mpilb: load-balanced asynchronous data-parallel training for MPI clusters.

The public surface is the ``mpilb`` command (see :mod:`mpilb.cli`); the modules are:
``server`` (rank 0 parameter server), ``worker``, ``balancer`` (pure policies),
``dataset``/``shards`` (HDF5 shard data), ``runlog``/``report``, ``comm`` (the only MPI
module) and ``backend`` (the only CuPy module).
"""

__version__ = "0.1.0"

from .errors import DataError, MpilbError, UsageError  # noqa: E402

__all__ = ["DataError", "MpilbError", "UsageError", "__version__"]
