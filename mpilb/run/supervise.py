"""`--survive-signals`: a rank killed by a signal (kill -9, the OOM killer) must not take the
job with it where the launcher lets the other ranks run on.

Hydra's proxy SIGKILLs every rank it started once one of its children's wait status says
"killed by a signal", `-disable-auto-cleanup` or not; a child that *exits* with a status only
closes its PMI socket, and then the others get SIGUSR1 and run on (docs/faults.md). So with
this setting the process the launcher starts stays a small supervisor: before MPI starts it
forks the real rank (which inherits the PMI environment and descriptors and calls MPI_Init
itself), passes every stop signal on, and when the rank dies by signal N exits with status
128 + N, which the launcher sees as an ordinary failed exit.

Open MPI 4's mpirun keeps the others after any death under `--mca
orte_abort_on_non_zero_status 0`, but its exit code is that of the first rank *killed by a
signal* (128 + N), while it passes over ranks that exit with a status: a killed worker
made the job exit 137 where the run ended degraded (MPI_Abort(3)). The same 137 as a status
leaves the job's code to rank 0. A killed rank 0 is the opposite case, since no one else
reports the run's end (the workers end themselves with status 1, passed over as well,
and mpirun would exit 0): there the supervisor dies by the rank's signal itself, and the
first of the others to give up on rank 0 ends the job with MPI_Abort (mpi/watchdog.py).

Standard library only: it runs before numpy and mpi4py are imported.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

from mpilb.mpi.launcher import open_mpi

# What a launcher or a user sends a rank; the rank runs in a process group of its own (so a
# signal to the supervisor's group reaches it once, through here), so each is passed on.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
             signal.SIGCONT, signal.SIGTSTP)
_PR_SET_PDEATHSIG = 1


def exit_status(wait_status: int) -> tuple[int, int | None]:
    """(the supervisor's exit code, the killing signal or None) for the rank's wait status:
    its own exit code, or 128 + N for a death by signal N (as a shell reports it)."""
    code = os.waitstatus_to_exitcode(wait_status)
    if code < 0:
        return 128 - code, -code
    return code, None


def supervise(rank: int) -> None:
    """Fork; return in the child (the rank), never return in the parent (the supervisor)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        _die_with_parent()
        return
    try:
        os.setpgid(pid, pid)   # also here: no window in which a group signal reaches both
    except OSError:
        pass   # the child did it first (or is gone already)
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: _forward(pid, signum))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            os._exit(1)
    code, killed_by = exit_status(status)
    if killed_by is None:
        os._exit(code)
    name = signal.Signals(killed_by).name
    if open_mpi() and rank == 0:
        print(f"mpilb: rank 0 (pid {pid}) was killed by {name}; its supervisor ends by "
              f"{name} too, so that mpirun reports it (--survive-signals)",
              file=sys.stderr, flush=True)
        _die_by(killed_by)
    why = ("mpirun's exit code stays the run's (under --mca orte_abort_on_non_zero_status 0 "
           "mpirun passes over exit statuses)" if open_mpi()
           else "the launcher keeps the other ranks")
    print(f"mpilb: rank {rank} (pid {pid}) was killed by {name}; its supervisor exits "
          f"{code} so that {why} (--survive-signals)", file=sys.stderr, flush=True)
    os._exit(code)


def _die_by(signum: int) -> None:
    """End this process by `signum` as its rank ended (no core file)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if signum not in (signal.SIGKILL, signal.SIGSTOP):   # these two have no handler to reset
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)   # a signal whose default action is not to end the process


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _die_with_parent() -> None:
    """The rank gets SIGKILL when its supervisor dies (the launcher's SIGKILL of the job
    reaches only the supervisor's process group)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return   # not Linux: a killed supervisor leaves its rank to the watchdog on rank 0
    if os.getppid() == 1:   # the supervisor died before prctl took effect
        os._exit(1)
