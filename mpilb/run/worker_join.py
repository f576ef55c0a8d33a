"""A worker that joins a running job (`mpiexec -n 1 mpilb join RUN.h5`, cli/membership.py):
the run's configuration from its log, a connection to rank 0 (mpi/joining.py), then the
same worker loop as every other worker, on that connection. At the end it meets rank 0
once more (mpi/departure.py) and disconnects, so that both launches end with exit 0."""

from __future__ import annotations

import os
import sys
import time

from mpilb.errors import MpilbError, UsageError
from mpilb.runfiles.requests import answer_of

CONNECT_TIMEOUT_S = 60.0   # rank 0 accepts or drops a joiner well within this (server/admission.py)


def run_joined(values: dict, port: str, request: str, log: str = "") -> int:
    """Join the run whose configuration is `values` at MPI port `port`; returns the exit code."""
    from mpilb.config.sections import Config
    from mpilb.data.dataset import open_dataset
    from mpilb.mpi import departure, joining
    from mpilb.run.components import hold_out_validation
    from mpilb.worker.loop import Worker

    cfg = Config.from_values(values)
    cfg.store_ranks = (0,)   # (joins are taken with one store only: server/admission.py)
    dataset = hold_out_validation(cfg.inputs, open_dataset(values["data"], check_files=False))
    comm = joining.connect(port, CONNECT_TIMEOUT_S)
    if comm is None:
        answer = answer_of(request)
        for stale in (request + ".connecting", request + ".answer"):
            try:
                os.unlink(stale)   # (rank 0 must not accept it now: mpi/joining.py)
            except OSError:
                pass
        if answer is not None and answer.startswith("refused"):
            raise UsageError(f"{log}: {answer}")
        raise MpilbError(f"{log}: rank 0 did not accept this joiner within {CONNECT_TIMEOUT_S:g} s "
                         f"(is it stopped?)")
    deadline = time.monotonic() + 10.0
    while (answer := answer_of(request)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if answer is not None:
        print(f"mpilb: {'error: ' if answer.startswith('refused') else ''}{answer}", file=sys.stderr, flush=True)
        try:
            os.unlink(request + ".answer")
        except OSError:
            pass
    worker = Worker(cfg, dataset, comm, comm.Get_rank())
    worker.run()   # (turned away as the run ended: STOP at once)
    departure.end_together(comm, comm.Get_rank(), timeout=None)
    joining.disconnect(comm)
    return 2 if answer is not None and answer.startswith("refused") else 0
