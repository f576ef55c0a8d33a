"""`--survive-signals`: a rank killed by a signal (kill -9, the OOM killer) must not take the
job with it where the launcher lets the other ranks run on.

Hydra's proxy SIGKILLs every rank it started once one of its children's wait status says
"killed by a signal", `-disable-auto-cleanup` or not; a child that *exits* with a status only
closes its PMI socket, and then the others get SIGUSR1 and run on (docs/faults.md). So with
this setting the process the launcher starts stays a small supervisor: before MPI starts it
forks the real rank (which inherits the PMI environment and descriptors and calls MPI_Init
itself), passes every stop signal on, and when the rank dies by signal N exits with status
128 + N, which the launcher sees as an ordinary failed exit.

Standard library only: it runs before numpy and mpi4py are imported.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

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
    if killed_by is not None:
        name = signal.Signals(killed_by).name
        print(f"mpilb: rank {rank} (pid {pid}) was killed by {name}; its supervisor exits "
              f"{code} so that the launcher keeps the other ranks (--survive-signals)",
              file=sys.stderr, flush=True)
    os._exit(code)


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
