"""A replacement worker (--respawn): the process rank 0 starts with MPI_Comm_spawn when a
worker is lost (server/respawn.py), as ``python -m mpilb.run.replacement LOST CONFIG``
(the lost worker's id, the run's options and rank 0's doorbell invitation, each JSON in hex:
mpi/spawning.py's `arg`).

MPI starts first (rank 0 waits in its spawn until this process's MPI_Init connects back),
then the replacement prepares its data and model as a joiner does, says it is ready, and
is the same worker as a joiner from there on (run/worker_join.py).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from mpilb.mpi.launcher import one_blas_thread

    one_blas_thread()   # before numpy: the node's cores are the job's ranks'
    from mpilb.mpi import spawning   # MPI_Init: rank 0's spawn returns

    comm = spawning.parent()
    if comm is None:
        print("mpilb: error: mpilb.run.replacement is started by rank 0 of a run with "
              "--respawn (MPI_Comm_spawn), not by hand", file=sys.stderr, flush=True)
        return 2
    from mpilb.run.worker_join import _failed, prepare, work

    answer = f"joined as the replacement of rank {argv[0]}"
    try:
        ready = prepare(spawning.from_arg(argv[1]))
    except Exception as exc:   # its data or model on this host: rank 0 is told, the run goes on
        return _failed(comm, exc, answer)
    from mpilb.mpi import doorbell

    invitation = spawning.from_arg(argv[2]) if len(argv) > 2 else None
    bell, ringback = doorbell.join_job(invitation or None)
    rank = spawning.say_ready(comm, ringback)
    if rank is not None:
        bell.rank = rank   # its rings name it by its id in the job, as a joiner's do
        doorbell.install(bell)
    else:
        bell.close()
    return work(ready, comm, answer)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
