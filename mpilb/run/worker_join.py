"""A worker that joins a running job (`mpiexec -n 1 mpilb join RUN.h5`, cli/membership.py):
the run's configuration from its log, a connection to rank 0 (mpi/joining.py), then the
same worker loop as every other worker, on that connection. At the end it meets rank 0
once more (mpi/departure.py) and disconnects, so that both launches end with exit 0."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

from mpilb.errors import MpilbError, UsageError
from mpilb.runfiles.requests import answer_of

CONNECT_TIMEOUT_S = 60.0   # rank 0 accepts or drops a joiner well within this (server/admission.py)


@dataclass
class Prepared:
    """What a joiner has ready before it asks to join: its configuration (the run's), its
    data, and what rank 0 compares with its own (the shards' sizes, the model's size)."""

    cfg: object
    dataset: object
    num_params: int

    def signature(self) -> str:
        """The lines after "HOST PID" in the request (server/admission.py reads them)."""
        return json.dumps({"shards": list(map(int, self.dataset.shard_sizes)),
                           "params": int(self.num_params)})


def prepare(values: dict) -> Prepared:
    """Everything but MPI, done before the joiner says it connects: then it connects at
    once, and rank 0's MPI_Comm_accept waits only for that (server/admission.py)."""
    from mpilb.config.sections import Config
    from mpilb.data.dataset import open_dataset
    from mpilb.run.components import config_model, hold_out_validation
    from mpilb.worker import loop  # noqa: F401  (imported now, not between connect and run)

    # --inject names ranks of the job, not of this launch (whose world is 1 rank, or 2 once
    # merged): it stays the job's (a joiner with it failed its check at once: "rank 2 is
    # not in this job of 2 rank(s)")
    cfg = Config.from_values(dict(values, inject=[]))
    cfg.store_ranks = (0,)   # (joins are taken with one store only: server/admission.py)
    dataset = hold_out_validation(cfg.inputs, open_dataset(values["data"], check_files=False))
    return Prepared(cfg, dataset, config_model(cfg, dataset).num_params)


def run_joined(ready: Prepared, port: str, request: str, log: str = "") -> int:
    """Join the run at MPI port `port` with what `ready` holds; returns the exit code."""
    from mpilb.mpi import joining

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
    return work(ready, comm, answer)


def work(ready: Prepared, comm, answer) -> int:
    """Be a worker of the run on `comm` (rank 0 of the run is its rank 0) until the run ends
    (`answer`: rank 0's word, "joined as worker N" or "refused: ..."); the exit code. A
    joiner's and a replacement's (run/replacement.py) alike."""
    from mpilb.cli.launch import _install_signal_handlers
    from mpilb.mpi import departure, joining
    from mpilb.worker.loop import Worker

    cfg, dataset = ready.cfg, ready.dataset
    _install_signal_handlers(comm.Get_size())   # a worker's: its SIGTERM is told to rank 0
    try:
        worker = Worker(cfg, dataset, comm, comm.Get_rank())
        worker.run()   # (turned away as the run ended: STOP at once)
    except Exception as exc:   # told to rank 0, which ends the run as for any worker's
        return _failed(comm, exc, answer)
    departure.end_together(comm, comm.Get_rank(), timeout=None)
    joining.disconnect(comm)
    return 2 if answer is not None and answer.startswith("refused") else 0


def _failed(comm, exc: BaseException, answer) -> int:
    """This joiner failed: rank 0 is told (its one line names the worker), this launch ends
    with the error's exit code without the job's end (rank 0 ends the run)."""
    from mpilb.cli.launch import describe, exit_code
    from mpilb.mpi import comm as C
    from mpilb.mpi import departure

    worker = answer.removeprefix("joined as ") if answer else "a joiner"
    text = describe(exc, 1).removeprefix("rank 1: ")
    C.send_error(comm, text, exit_code(exc))
    departure.finalize_alone()   # (MPI_Finalize would wait for rank 0, which ends the run)
    print(f"mpilb: error: {worker}: {text}", file=sys.stderr, flush=True)
    return exit_code(exc)
