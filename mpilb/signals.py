"""Preemption signals: SIGTERM and SIGUSR1 ask a run to checkpoint and stop (exit 0).

Standard library only, so that `mpilb train` can catch a signal from its very first
moments: one that arrives while a rank is still importing is remembered (:data:`EARLY`)
and honoured once training runs, instead of killing the rank (exit 15, no checkpoint).
"""

from __future__ import annotations

import signal

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

# signals received before the training loop installed its handlers
EARLY: list[int] = []


def catch_early() -> None:
    """Remember preemption signals until :func:`install` takes over."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, lambda signum, frame: EARLY.append(signum))


def install(on_signal) -> None:
    """Call `on_signal(signum)` for each preemption signal, including early ones."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, lambda signum, frame: on_signal(signum))
    for signum in EARLY:
        on_signal(signum)
    EARLY.clear()


def ignore() -> None:
    """The run is complete: ignore them at the C level (holds during MPI finalisation)."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
