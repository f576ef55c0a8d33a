"""Stop signals: SIGTERM and SIGUSR1 (preemption) and SIGINT (Ctrl-C) ask a run to
checkpoint and stop (exit 0, status `preempted`, resumable). A second Ctrl-C interrupts
at once, as Ctrl-C does elsewhere (Hydra's mpiexec forwards the first to every rank and
aborts the job on the second). SIGUSR2 to a worker's process asks that worker to leave the
run, which goes on without it (docs/membership.md): no stop.

Standard library only, so that `mpilb train` can catch a signal from its very first
moments: one that arrives while a rank is still importing is remembered (:data:`EARLY`)
and honoured once training runs, instead of killing the rank (exit 15, no checkpoint).
"""

from __future__ import annotations

import signal
import threading

# Set by the SIGTERM handler (any rank; SIGUSR1 too in a one-rank run): checkpoint and stop.
PREEMPTED = threading.Event()
# Set by SIGUSR1 on a rank of a multi-rank job. Slurm's `--signal=USR1` means preemption, but
# MPICH's Hydra under `-disable-auto-cleanup` sends the same signal to the survivors when a
# rank dies; rank 0 tells them apart (server/chores.py): a preemption only when every worker
# present at the signal reports it too, none of them dying first.
USR1_NOTICE = threading.Event()

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Set by SIGUSR2: this worker is asked to leave the run (rank 0 lets it go at its next push).
LEAVE_SIGNAL = signal.SIGUSR2
LEAVE_ASKED = threading.Event()

# signals received before the training loop installed its handlers
EARLY: list[int] = []
# the stop signals this process received, in order (what the stop line names)
RECEIVED: list[int] = []
# called after each handled signal (see listen)
_LISTENERS: list = []


def stop_text(signum=None) -> str:
    """What the line announcing a stop says. A user's Ctrl-C is no preemption, and in a
    multi-rank job a SIGTERM may be the launcher ending the job after a rank died (see
    server/vote.py): the line names the signal, not what it is taken for. `signum`: the
    signal rank 0 stops for (None: a one-rank run, where a signal can only be a stop)."""
    if signal.SIGINT in RECEIVED or signum == signal.SIGINT:
        return "interrupted (Ctrl-C)"
    if signum == signal.SIGTERM:
        return "SIGTERM"
    if signum == signal.SIGUSR1:
        return "preemption signal (SIGUSR1; every worker answered it, no rank died)"
    return "preemption signal"


def catch_early() -> None:
    """Remember preemption signals until :func:`install` takes over."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, _early)
    signal.signal(LEAVE_SIGNAL, _early)   # (its default action would end the process)


def _early(signum, frame) -> None:
    if signum == LEAVE_SIGNAL:
        LEAVE_ASKED.set()   # remembered: the worker asks to leave once it has joined the run
        return
    if signum == signal.SIGINT and signum in EARLY:
        raise KeyboardInterrupt   # a second Ctrl-C before training started
    EARLY.append(signum)


def install(on_signal) -> None:
    """Call `on_signal(signum)` for each preemption signal, including early ones."""
    def handler(signum, frame):
        RECEIVED.append(signum)
        if signum == signal.SIGINT:   # the next Ctrl-C interrupts
            signal.signal(signal.SIGINT, signal.default_int_handler)
        on_signal(signum)
        for listener in _LISTENERS:
            try:
                listener()
            except Exception:  # noqa: BLE001 - a handler must not raise into the code it interrupts
                pass

    def leave(signum, frame):
        LEAVE_ASKED.set()
        for listener in _LISTENERS:
            try:
                listener()
            except Exception:  # noqa: BLE001 - as above
                pass

    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, handler)
    signal.signal(LEAVE_SIGNAL, leave)
    for signum in EARLY:
        handler(signum, None)
    EARLY.clear()


def listen(callback) -> None:
    """Call `callback()` after each stop signal (and SIGUSR2), in the handler. A worker reports the signal
    to rank 0 at once from there, also while its loop is stuck (a hung step in Python, a
    long wait): rank 0 counts the workers that answer a signal to tell a preemption from a
    launcher's notice of a dead rank (server/vote.py)."""
    _LISTENERS.append(callback)


def unlisten(callback) -> None:
    """Stop calling `callback` (a worker whose run is over: rank 0 may be finalising, and a
    notice sent then would be a message no one receives)."""
    if callback in _LISTENERS:
        _LISTENERS.remove(callback)


def ignore() -> None:
    """The run is complete: ignore them at the C level (holds during MPI finalisation)."""
    for sig in (*PREEMPTION_SIGNALS, LEAVE_SIGNAL):
        signal.signal(sig, signal.SIG_IGN)
