"""Was a stop signal a preemption, or a launcher's word that a rank ended? (rank 0)

A scheduler's preemption (Slurm's `--signal`, `scancel`, SIGTERM to `mpiexec`) signals every
rank. A launcher that reacts to the death of a rank signals the survivors only: MPICH's Hydra
under `-disable-auto-cleanup` sends them SIGUSR1 and lets the job go on; Open MPI's `mpirun`
(by default) sends SIGTERM and, 1 s later, SIGKILL (Slurm's step termination is SIGTERM,
then SIGKILL too). Both look like a preemption from inside a rank. The vote tells them apart: the
workers present at the signal are expected to be heard from again (each reports the signal
it received; for SIGUSR1 two pushes count too), and a worker that is lost first, without
having reported it, means a rank died: the signal came with that death.

What follows differs by signal. SIGUSR1 stops nothing until the vote passes: a preemption
once every worker was heard, else the run goes on without the dead rank. SIGTERM stops the
run at once (checkpoint first) whatever the vote says, since the job is ending either way;
the vote only names the ending: `preempted`, or `failed` where a worker never answered a
SIGTERM that reached the others. Where the launcher kills soon after its SIGTERM (Open MPI's
`mpirun`: 1 s, `odls_base_sigkill_timeout`), waiting `--worker-timeout` for the silent
worker would leave the run log `running`; there a worker not heard from for `kill_grace` s
after the signal is taken as ended.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SignalVote:
    """One stop signal's vote over the workers present when it arrived."""

    signum: int
    t: float                 # run time of the signal (for the messages)
    mono: float              # time.monotonic() of the signal
    steps: dict              # rank -> its push count at the signal
    reported: set = field(default_factory=set)   # workers that reported the signal
    heard: set = field(default_factory=set)      # ... or pushed twice since (SIGUSR1)
    kill_grace: Optional[float] = None   # s from the launcher's SIGTERM to its SIGKILL

    @classmethod
    def start(cls, signum: int, t: float, mono: float, present,
              kill_grace: Optional[float] = None) -> "SignalVote":
        return cls(signum, t, mono, {w.rank: w.step for w in present}, kill_grace=kill_grace)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def expect(self) -> set:
        return set(self.steps)

    def report(self, rank: int) -> None:
        """`rank` received the signal too (0: rank 0 itself). A SIGTERM's report also counts
        from a worker that had already stopped when the vote began: rank 0 may act on its
        own copy of the launcher's SIGTERM (and STOP the workers pushing meanwhile) before
        their reports arrive, and those reports are what shows the signal reached the
        others (without them, the silent dead rank was never taken as ended, and the
        launcher's SIGKILL left the run log `running`)."""
        if rank in self.steps:
            self.reported.add(rank)
            self.heard.add(rank)
        elif rank != 0 and self.signum == signal.SIGTERM:
            self.reported.add(rank)

    def update(self, peers) -> None:
        """Count a worker as heard from once it pushed twice since the signal. One push is
        not enough: a worker that died right after pushing has that push still on its way
        (a worker has one unanswered push at most), and counting it made Hydra's notice of
        the death a preemption (exit 0, `preempted`, in 1 of 5 runs of the survival
        command in docs/faults.md). Under SIGTERM a worker's next push is answered with
        STOP: only its report counts there."""
        if self.signum != signal.SIGUSR1:
            return
        for r in self.expect - self.heard:
            if peers[r].step > self.steps[r] + 1:
                self.heard.add(r)

    @property
    def passed(self) -> bool:
        """Every worker present at the signal was heard from: no rank died."""
        return self.heard >= self.expect

    def came_with_loss(self, rank: int) -> bool:
        """`rank` is declared lost: does that decide the vote against a preemption? For
        SIGUSR1, a loss of any worker expected to answer. For SIGTERM, only where some
        worker reported it: a SIGTERM that no worker received went to rank 0 alone (a user's
        `kill`), and is a preemption whatever happens to the workers meanwhile."""
        if rank not in self.expect or rank in self.heard:
            return False
        return self.signum == signal.SIGUSR1 or bool(self.reported - {0})

    def ended(self, peers, mono: float) -> Optional[int]:
        """A worker taken as ended: with the launcher's SIGKILL due `kill_grace` s after its
        SIGTERM, the one that other workers' reports show missing and that nothing came
        from since the signal, half of that grace after it. None otherwise."""
        kill_grace = self.kill_grace
        if (kill_grace is None or self.signum != signal.SIGTERM
                or not (self.reported - {0}) or mono - self.mono < kill_grace / 2):
            return None
        for r in sorted(self.expect - self.heard):
            w = peers[r]
            if not w.lost and not w.stopped and w.last_seen < self.mono:
                return r
        return None

    def loss_text(self, rank: int) -> str:
        """The line saying what the signal was, now that `rank` is lost."""
        if self.signum == signal.SIGUSR1:
            return (f"the SIGUSR1 of {self.t:.1f} s came with the loss of rank {rank}: taken as "
                    f"the launcher's notice of a failed rank (MPICH -disable-auto-cleanup), not "
                    f"as a preemption")
        others = ", ".join(str(r) for r in sorted(self.reported - {0}))
        return (f"ended: it never answered the SIGTERM of {self.t:.1f} s that reached rank(s) "
                f"{others}; that SIGTERM was the launcher ending the job after rank {rank} "
                f"ended (as Open MPI's mpirun does), not a preemption")
