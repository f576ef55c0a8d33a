"""A rank that waits for rank 0 ends itself when rank 0 has said nothing for too long.

Rank 0 is not replicated: when it is gone (killed, its node partitioned away, stopped) the
others can only wait, and under `-disable-auto-cleanup`, `--survive-signals` or a partition
nobody kills them: they would outlive the job. Rank 0 therefore tells every worker it has
sent nothing for :data:`KEEP_ALIVE_S` that it is there (an empty ORDERS header, which a
waiting worker reads and keeps waiting; server/outbox.py), and rank 0 asks each parameter
store for its counters every fraction of a second. So a rank that has waited :func:`limit`
seconds without a word from rank 0 knows rank 0 is gone or unreachable: it says so in one
line and exits 1. Under Open MPI's mpirun it ends the job with MPI_Abort(1) instead: under
`--mca orte_abort_on_non_zero_status 0` mpirun passes over exit statuses, so the job would
exit 0 (rank 0's supervisor exited with a status) or never end (rank 0 was killed by a
signal, after which that mpirun waits for an abort that no one sends).

Only time spent waiting counts (from the start of a wait, or the end of this rank's own
compute, whichever is later): a long step of its own is no silence of rank 0. Rank 0's
own long pauses are the cost: a checkpoint or an in-process evaluation that takes longer
than :func:`limit` (rank 0 sends nothing meanwhile) ends the workers; raise
--worker-timeout for such models.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

from mpilb.mpi.launcher import open_mpi

KEEP_ALIVE_S = 1.0   # rank 0 sends each worker something at least this often


def limit(worker_timeout: float) -> float:
    """Seconds of silence of rank 0 after which a waiting rank gives up: --worker-timeout
    plus as much again, at least 10 s (rank 0 itself gives up on a store or a worker after
    --worker-timeout, so a rank 0 still running has spoken by then)."""
    return worker_timeout + max(10.0, worker_timeout)


class Rank0Watch:
    """When this rank last heard from rank 0, and whether it has waited too long since."""

    def __init__(self, worker_timeout: float, rank: int,
                 clock: Callable[[], float] = time.monotonic):
        self.limit = limit(worker_timeout)
        self.worker_timeout = worker_timeout
        self.rank = rank
        self.clock = clock
        self.since = clock()

    def heard(self) -> None:
        """A message from rank 0 came."""
        self.since = self.clock()

    def waiting(self) -> None:
        """A wait for rank 0 begins (or this rank's own work just ended): the silence counts
        from now at the earliest."""
        self.since = max(self.since, self.clock())

    def silent_for(self) -> float:
        return self.clock() - self.since

    def expired(self) -> bool:
        return self.silent_for() > self.limit

    def check(self) -> None:
        """End this process (exit 1, one line) if rank 0 has been silent too long."""
        if not self.expired():
            return
        print(f"mpilb: error: rank {self.rank}: nothing from rank 0 for {self.silent_for():.0f} s "
              f"(the limit is --worker-timeout {self.worker_timeout:g} s + "
              f"{self.limit - self.worker_timeout:g} s): rank 0 is gone or unreachable, so "
              f"this rank ends itself", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if open_mpi():
            from mpilb.mpi.comm import abort

            threading.Timer(5.0, os._exit, (1,)).start()   # should MPI_Abort hang (no orted)
            abort(1)
        os._exit(1)
