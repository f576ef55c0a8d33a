"""How rank 0's run ends: the exit code and the last lines for each way a run can end
(finished, degraded, preempted, a lost store, a run log that cannot be written, a
worker's error)."""

from __future__ import annotations

import os
import sys

from mpilb.mpi import comm as C
from mpilb.errors import LogWriteError
from mpilb.run.session import files_line, format_final
from mpilb.run.signals import PREEMPTED
from mpilb.server.liveness import WorkerFailed
from mpilb.server.loop import ParameterServer
from mpilb.server.remote import StoreLost


def serve(server: ParameterServer) -> int:
    """Run the server; returns the exit code (0 finished, 3 degraded)."""
    try:
        status = server.run()
    except StoreLost as exc:
        # its slice is gone: end the job (a stop asked for meanwhile ends it as one, exit 0,
        # with the last checkpoint, which a store that keeps silent cannot add to)
        server.lifecycle.train_s, server.lifecycle.store_lost = server.now(), True
        code = 0 if PREEMPTED.is_set() else 1
        print(f"mpilb: error: {exc}" if code else
              f"mpilb: stopped: {exc}; the checkpoint {server.cfg.output.checkpoint} is the last one "
              f"written before", file=sys.stderr, flush=True)
        try:
            server.finish("preempted" if code == 0 else "failed")
        finally:
            C.abort(code)
            os._exit(code)
    except LogWriteError as exc:
        _log_failed(server, exc)
    except WorkerFailed as exc:
        server.lifecycle.train_s = server.now()
        # the line first: a launcher's SIGKILL may follow within a second (vote.py)
        print(f"mpilb: error: {exc}", file=sys.stderr, flush=True)
        try:
            server.finish("failed")
        finally:
            C.abort(exc.code)
            os._exit(exc.code)
    except BaseException:
        try:
            server.finish("failed")
        except Exception:  # noqa: BLE001 - the original error matters more
            pass
        raise
    try:
        summary = server.finish(status)
    except LogWriteError as exc:
        _log_failed(server, exc)
    print(format_final(summary), flush=True)
    print(files_line(server.cfg.output), flush=True)
    if server.lost:
        # A lost (hung) rank never exits by itself and would keep the job alive. A preempted
        # run stopped as asked (checkpoint written): exit 0, so that a requeue follows.
        code = 0 if status == "preempted" else 3
        sys.stdout.flush()
        if server.members.admissions is not None:
            # workers that joined or replaced a lost one end with the job first: MPI_Abort
            # does not reach a joiner's launch (it waited for its end forever)
            server.members.admissions.finish()
        launcher = C.open_mpi_launcher()
        if launcher is not None and launcher["recovery"]:
            C.tell_leave(server.comm, code, skip=server.lost + server.members.left)   # MPI_Abort ends rank 0 alone
        C.abort(code)
        os._exit(code)
    return 0


def _log_failed(server: ParameterServer, exc: LogWriteError) -> None:
    """The run log cannot be written (a full disk): the weights into the checkpoint, one
    line, and the job ends."""
    print(f"mpilb: error: {exc}; {server.checkpoints.rescue_checkpoint()}", file=sys.stderr, flush=True)
    C.abort(1)
    os._exit(1)
