"""Stop signals: SIGTERM and SIGUSR1 (preemption) and SIGINT (Ctrl-C) ask a run to
checkpoint and stop (exit 0, status `preempted`, resumable). A second Ctrl-C interrupts
at once, as Ctrl-C does elsewhere (Hydra's mpiexec forwards the first to every rank and
aborts the job on the second).

Standard library only, so that `mpilb train` can catch a signal from its very first
moments: one that arrives while a rank is still importing is remembered (:data:`EARLY`)
and honoured once training runs, instead of killing the rank (exit 15, no checkpoint).
"""

from __future__ import annotations

import signal

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

# signals received before the training loop installed its handlers
EARLY: list[int] = []
# the stop signals this process received, in order (what the stop line names)
RECEIVED: list[int] = []


def stop_text() -> str:
    """What the line announcing a stop says: a user's Ctrl-C is no preemption."""
    if signal.SIGINT in RECEIVED:
        return "interrupted (Ctrl-C)"
    return "preemption signal"


def catch_early() -> None:
    """Remember preemption signals until :func:`install` takes over."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, _early)


def _early(signum, frame) -> None:
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

    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, handler)
    for signum in EARLY:
        handler(signum, None)
    EARLY.clear()


def ignore() -> None:
    """The run is complete: ignore them at the C level (holds during MPI finalisation)."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
