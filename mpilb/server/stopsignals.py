"""Stop signals on rank 0: the workers' reports and rank 0's own, and their votes (vote.py).

A signal a worker reports (or rank 0 receives) starts a vote over the workers present, or
counts as a report in the one under way; the vote decides whether it was a preemption or a
launcher's word that a rank died (see :mod:`mpilb.server.vote`).
"""

from __future__ import annotations

import signal
import sys
import time
from typing import Optional

from mpilb.mpi import comm as C
from mpilb.run import signals
from mpilb.run.signals import PREEMPTED, USR1_NOTICE
from mpilb.server.vote import SignalVote

# a SIGUSR1 this soon after MPI reported a rank's end is the launcher's notice of it (the
# vote of StopSignals.report cannot tell: the dead rank is no longer among those it awaits)
DEATH_NOTICE_S = 5.0
# ... and this soon after a worker left (roster.py): Hydra under -disable-auto-cleanup sends
# the survivors SIGUSR1 when the leaver's process ends, also after its MPI_Finalize (measured,
# MPICH 5.0.2), and reaps it up to seconds after its exit
LEFT_NOTICE_S = 30.0


class StopSignals:
    """The stop signals of a run and the vote under way.

    Args:
        comm: the world communicator (the workers' notices).
        roster: the workers (:class:`~mpilb.server.peers.Roster`).
        clock: the run's clock (``now()``, for the messages).
        on_leave: called with (rank, how) when a worker reports SIGUSR2 (a wish to leave).
    """

    def __init__(self, comm, roster, clock, on_leave=None):
        self.comm = comm
        self.on_leave = on_leave   # a worker's SIGUSR2: it asks to leave (server/roster.py)
        self.roster = roster
        self.clock = clock
        self.vote: Optional[SignalVote] = None   # see vote.py
        self.own_signals = 0                     # of signals.RECEIVED, those already counted
        self.stop_signal: Optional[int] = None   # the signal that stops the run (its line names it)
        self.died: Optional[tuple] = None        # (when, rank, said) of the last death MPI reported

    def poll(self) -> None:
        """Take the workers' notices and rank 0's own signals."""
        while (notice := C.poll_preempt(self.comm)) is not None:
            self.notice(*notice)
        USR1_NOTICE.clear()   # rank 0's own signals, SIGUSR1 included, are in RECEIVED
        while self.own_signals < len(signals.RECEIVED):
            self.own_signals += 1
            self.report(0, signals.RECEIVED[self.own_signals - 1])

    def notice(self, src: int, signum: int) -> None:
        """Worker `src` reports signal `signum` (a worker that joined: server/admission.py)."""
        if signum == signals.LEAVE_SIGNAL:
            if self.on_leave is not None:
                self.on_leave(src, "SIGUSR2")
            return
        if signum != signal.SIGUSR1:
            PREEMPTED.set()   # a stop whatever the vote says (its checkpoint comes first)
        self.report(src, signum)

    def report(self, rank: int, signum: int) -> None:
        """Stop signal `signum` reached `rank` (0: this one): it starts a vote over the
        workers present, or counts as a report in the one under way (vote.py). A SIGTERM
        during a SIGUSR1 vote starts its own: the run stops now."""
        if signum == signal.SIGINT:
            return   # Ctrl-C: the user's own stop, no launcher's notice
        died = self.died
        if (signum == signal.SIGUSR1 and died is not None
                and time.monotonic() - died[0] < DEATH_NOTICE_S):
            if not died[2]:   # the notice reaches every rank: said once
                self.died = (*died[:2], True)
                print(f"mpilb: the SIGUSR1 of {self.clock.now():.1f} s came after rank {died[1]} ended: "
                      f"taken as the launcher's notice of it (MPICH -disable-auto-cleanup), not as "
                      f"a preemption", file=sys.stderr, flush=True)
            return
        if signum == signal.SIGTERM:
            self.stop_signal = self.stop_signal or signum
        vote = self.vote
        if vote is None or (signum == signal.SIGTERM and vote.signum != signum):
            vote = self.vote = SignalVote.start(signum, self.clock.now(), time.monotonic(),
                                                self.roster.present(), C.launcher_kill_grace())
        vote.report(rank)   # any stop signal a worker reports shows it alive

    def note_departure(self, rank: int) -> None:
        """Worker `rank` left the run: a SIGUSR1 in the next LEFT_NOTICE_S is the launcher's
        notice of its end, as after a death (report)."""
        self.died = (time.monotonic() + LEFT_NOTICE_S - DEATH_NOTICE_S, rank, False)

    def judge(self, preempted: bool) -> Optional[int]:
        """Decide the vote under way: a SIGUSR1 that passed is a preemption (PREEMPTED is
        set); returns the rank a SIGTERM's vote takes as ended, if any (to be declared lost)."""
        vote = self.vote
        if vote is None:
            return None
        peers = self.roster.peers
        vote.update(peers)
        if vote.signum == signal.SIGUSR1:
            if vote.passed and not preempted:
                self.vote = None
                self.stop_signal = self.stop_signal or signal.SIGUSR1
                PREEMPTED.set()
            return None
        return vote.ended(peers, time.monotonic())

    def on_loss(self, rank: int, why: str) -> tuple[Optional[str], Optional[str]]:
        """Worker `rank` is declared lost (`why`): (why the run fails for it, or None; the
        line to print after the loss's, or None). A loss that came with a launcher's
        SIGTERM fails the run; one that came with a SIGUSR1 ends that vote."""
        vote = self.vote
        came_with_loss = vote is not None and vote.came_with_loss(rank)
        fails = came_with_loss and vote.signum != signal.SIGUSR1
        note = None
        if came_with_loss and not fails:
            self.vote = None
            note = vote.loss_text(rank)
        if why.startswith("ended"):   # MPI saw it die: Hydra's SIGUSR1 may follow (report)
            self.died = (time.monotonic(), rank, False)
        return (vote.loss_text(rank) if fails else None), note
