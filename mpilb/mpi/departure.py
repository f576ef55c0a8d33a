"""Ranks that end before the job does (a worker let go: `mpilb leave`, SIGUSR2), and the
job's end without them.

MPI_Finalize is collective on MPI_COMM_WORLD in MPICH: a rank that finalises early waits in
it for every other rank's MPI_Finalize (measured with MPICH 5.0.2: a 3-rank script whose
rank 2 finalised first left it there until the others finalised 5 s later), and a rank that
exits without finalising makes Hydra end the whole job. MPICH's control variable
MPIR_CVAR_NO_COLLECTIVE_FINALIZE makes MPI_Finalize local; it is set through MPI_T at run
time (:func:`finalize_alone`), so that nothing changes for a job where no rank leaves. With
it set on the leaver, its process ends within ~0.05 s and Hydra lets the others run on; the
others set it too at the end (a collective finalize would wait for the rank that left).
Where the MPI has no such variable (Open MPI), a leaver cannot end before the job: it stays,
idle and asleep, until the job's end (:func:`leaves_alone` says which).

The job's end is a barrier of point-to-point messages over the ranks still there
(:func:`end_together`), not MPI_Ibarrier over the world, which a rank that left never joins.
"""

from __future__ import annotations

import ctypes
import time
from typing import Callable, Optional

import numpy as np

from mpilb.mpi.comm import library_file, wait
from mpilb.mpi.wire import TAG_END

_CVAR = b"MPIR_CVAR_NO_COLLECTIVE_FINALIZE"
_MPI_T_SUCCESS = 0


def _mpi_t(write: bool) -> bool:
    """Find (and with `write`, set to 1) the MPICH variable that makes MPI_Finalize local."""
    try:
        lib = ctypes.CDLL(library_file() or None)
        init, get_index = lib.MPI_T_init_thread, lib.MPI_T_cvar_get_index
    except (OSError, AttributeError):
        return False
    provided = ctypes.c_int()
    if init(ctypes.c_int(0), ctypes.byref(provided)) != _MPI_T_SUCCESS:
        return False
    try:
        index = ctypes.c_int()
        if get_index(_CVAR, ctypes.byref(index)) != _MPI_T_SUCCESS:
            return False
        if not write:
            return True
        handle, count = ctypes.c_void_p(), ctypes.c_int()
        if lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) != _MPI_T_SUCCESS:
            return False
        try:
            one = ctypes.c_int(1)
            return lib.MPI_T_cvar_write(handle, ctypes.byref(one)) == _MPI_T_SUCCESS
        finally:
            lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
    finally:
        lib.MPI_T_finalize()


_ALONE: Optional[bool] = None


def leaves_alone() -> bool:
    """Can a rank of this MPI finalise (and end) before the others? (MPICH: yes.)"""
    global _ALONE
    if _ALONE is None:
        _ALONE = _mpi_t(write=False)
    return _ALONE


def finalize_alone() -> bool:
    """Make this process's MPI_Finalize local (no wait for the other ranks). Returns
    whether the MPI took it."""
    return _mpi_t(write=True)


def end_together(comm, rank: int, skip=(), timeout: Optional[float] = 30.0,
                 on_poll: Optional[Callable[[], None]] = None) -> tuple[bool, bool]:
    """The job's last meeting: every rank tells rank 0 it is done, rank 0 answers each once
    all of them are (the ranks in `skip`, which left the job, are not waited for). Returns
    (everyone met within `timeout`, some rank left: finalise alone then).

    The answers are synchronous sends: rank 0 knows each rank received it before it
    finalises itself (where finalising is local, an eager message still on its way when
    its sender ended could be lost)."""
    size = comm.Get_size()
    deadline = None if timeout is None else time.monotonic() + timeout
    if rank == 0:
        others = [r for r in range(1, size) if r not in set(skip)]
        bufs = [np.zeros(1, dtype=np.int64) for _ in others]
        if not _wait_all([comm.Irecv(b, source=r, tag=TAG_END) for b, r in zip(bufs, others)],
                         deadline, on_poll):
            return False, bool(skip)
        go = np.array([1 if skip else 0], dtype=np.int64)
        return _wait_all([comm.Issend(go, dest=r, tag=TAG_END) for r in others], deadline, on_poll), bool(skip)
    done, go = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    reqs = [comm.Isend(done, dest=0, tag=TAG_END), comm.Irecv(go, source=0, tag=TAG_END)]
    if not _wait_all(reqs, deadline, on_poll):
        return False, False
    return True, bool(go[0])


def _wait_all(reqs: list, deadline: Optional[float], on_poll) -> bool:
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    return wait(reqs, timeout=timeout, on_poll=on_poll)
