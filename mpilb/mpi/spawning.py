"""Replacement workers (--respawn): rank 0 starts one process with MPI_Comm_spawn, and the
process finds rank 0 through its parent communicator (docs/membership.md).

Spawning blocks rank 0 until the new process's MPI_Init has connected back (the child
imports only this module before that: mpi4py initialises MPI on import). Rank 0 runs MPI at
the thread level `funneled` (mpi/comm.py), so the spawn cannot go to a thread of its own:
it is one call among the chores between pushes, one per lost worker. Both sides then merge
the intercommunicator as a joiner's are merged (mpi/joining.py): rank 0 is rank 0 of the
result, the replacement rank 1. The replacement then prepares its data and model and says
it is ready (:func:`say_ready`); rank 0 admits it only then, so that its preparation is
never timed as a worker's silence, and never waited for. Its doorbell (mpi/doorbell.py) is
a joiner's: rank 0's invitation comes with its arguments, its "ready" carries where rank 0
rings it back, and rank 0's answer to it (:func:`tell_id`) the id its rings name.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Mapping, Optional

from mpilb.mpi.comm import MPI
from mpilb.mpi.joining import merge
from mpilb.mpi.waiting import Backoff
from mpilb.mpi.wire import TAG_READY

CHILD_MODULE = "mpilb.run.replacement"


class SpawnRefused(Exception):
    """The MPI or its launcher did not start the process (the text says what it said)."""


def unsupported(env: Optional[Mapping[str, str]] = None) -> str:
    """Why replacements cannot be spawned under this launcher ("" where they may be).

    Under Slurm's srun the process manager is Slurm's, whose PMI plugins are not known to
    start processes for MPI_Comm_spawn (not tested), and a spawn that waited would stop rank
    0: it is not tried. Elsewhere the spawn is tried at the first loss, and an MPI that
    cannot spawn says so there (:class:`SpawnRefused`).
    """
    env = os.environ if env is None else env
    if "SLURM_STEP_ID" in env:
        return "a job started by srun cannot spawn processes (Slurm's process manager)"
    if "PMI_SIZE" not in env and "OMPI_COMM_WORLD_SIZE" not in env and "PMIX_RANK" not in env:
        return "no MPI launcher started this job"
    return ""


def spawn(args: list[str], host: str = "") -> object:
    """Start ``python ARGS`` as one new MPI process (on `host` where given, in this working
    directory) and return the communicator merged with it (it is rank 1 there).

    Raises:
        SpawnRefused: the MPI or its launcher did not start it.
    """
    info = MPI.Info.Create()
    info.Set("wdir", os.getcwd())
    if host:
        info.Set("host", host)   # MPICH's key, also Open MPI's
    try:
        inter = MPI.COMM_SELF.Spawn(sys.executable, args, 1, info, 0)
    except MPI.Exception as exc:
        raise SpawnRefused(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None
    finally:
        info.Free()
    return merge(inter, high=False)


def arg(value) -> str:
    """`value` (JSON) as one argument of the spawned command: hex, because the launcher's
    handling of arguments drops backslashes (measured, MPICH's Hydra: a doorbell's name
    "\\u0000mpilb-..." arrived as "u0000mpilb-...")."""
    return json.dumps(value).encode().hex()


def from_arg(text: str):
    """The value :func:`arg` wrote."""
    return json.loads(bytes.fromhex(text).decode())


def parent() -> Optional[object]:
    """In a spawned replacement: the communicator merged with rank 0 (this process is rank
    1 there), or None where this process was not spawned."""
    inter = MPI.Comm.Get_parent()
    if inter == MPI.COMM_NULL:
        return None
    return merge(inter, high=True)


ID_WAIT_S = 10.0   # a replacement's wait for its id after its "ready" (rank 0 admits at once)


def say_ready(comm, ringback: Optional[dict] = None) -> Optional[int]:
    """The replacement has its data and model: rank 0 may admit it. `ringback`: where rank 0
    rings its doorbell (doorbell.join_job). Returns the id rank 0 admitted it as, None where
    no answer came within :data:`ID_WAIT_S` (not admitted: the run ends, or it came too late
    and the job's end ends it; it then works unrung until then)."""
    comm.send(ringback or {}, dest=0, tag=TAG_READY)
    req = comm.irecv(source=0, tag=TAG_READY)
    backoff, deadline = Backoff(), time.monotonic() + ID_WAIT_S
    backoff.reset()
    while True:
        done, rank = req.test()   # (the message with it: Test() would drop it)
        if done:
            return int(rank)
        if time.monotonic() > deadline:
            req.Cancel()
            return None
        backoff.sleep()


def await_ready(comm):
    """Rank 0: the request that completes when the replacement on `comm` is ready (with its
    doorbell's ringback, a dict)."""
    return comm.irecv(source=1, tag=TAG_READY)


def tell_id(comm, rank: int) -> None:
    """Rank 0: the replacement on `comm` was admitted as worker `rank`."""
    comm.send(int(rank), dest=1, tag=TAG_READY)
