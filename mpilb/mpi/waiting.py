"""Waiting without spinning a shared core: a backoff schedule and an estimate of recurring
waits (pure).

MPICH's blocking waits spin a core. On an oversubscribed node a spinning rank steals the CPU
the workers need, so every wait polls with :class:`Backoff` instead (comm.py uses it). A
rank with a CPU to itself (cores.py, through :meth:`Backoff.poll_first`) polls without
sleeping for the first :attr:`Backoff.spin_s` seconds of each wait, where a reply usually
comes, and sleeps after.
"""

from __future__ import annotations

import time
from typing import Optional


class Backoff:
    """Sleep between polls, growing from `start` to `cap` seconds; reset on progress.

    A short first sleep keeps latency low when messages come fast; the cap bounds the
    wake-ups per second (and so the CPU) when a rank waits a long time.

    When the caller knows about when the awaited message is due (``reset(due, grace)``, a
    ``time.monotonic()`` value), the sleeps are long until just before it (up to `far`
    seconds each, so a rank that waits 50 ms wakes a few times, not fifty), then every
    polls every `poll` seconds until `grace` seconds after it, and only then grow again. A
    rank that waits for a round's reply or for the next push thus notices it within ~`poll`
    seconds without polling all the time in between. A wrong estimate costs little: too
    early and the rank polls for a while, too late and it sleeps through at most `poll` (the
    first sleep never goes past ``due - poll``).

    The poll interval is `share` of the wait it ends (``reset(..., span=)``, else the time
    to `due`), between `fine` and `fine_max`: a wait of 2 ms is polled every 50 us, one of
    50 ms every 250 us. Each wake-up costs tens of µs of CPU on a virtual machine, so polling
    a long wait as finely as a short one cost a server whose workers take 50 ms a step ~3 %
    of a core, for a notice 0.5 % sooner.
    """

    # Seconds a wait polls without sleeping, from reset(): one choice for the whole process,
    # made through poll_first() once it is known to have a CPU to itself (cores.start_waits);
    # 0 (sleep between polls) otherwise.
    spin_s = 0.0
    # Polls after reset() that do not sleep. MPICH's progress moves a message through
    # stages, about one per call (the envelope, then the shared-memory read and its
    # acknowledgement): a reply sent milliseconds earlier was seen on the 2nd or 3rd probe
    # (1 or 2 misses, ~4 us). Sleeping after such a miss cost, where ranks share CPUs, a
    # turn of the scheduler: the median wait for a reply already there went from 0.03 ms
    # to 0.24, its 90th percentile from 0.04 to 3.9 ms.
    FREE_POLLS = 3

    def __init__(self, start: float = 20e-6, cap: float = 1e-3, fine: float = 50e-6,
                 far: float = 10e-3, fine_max: float = 250e-6, share: float = 0.005,
                 bell=None):
        # a doorbell.Doorbell: its rings end a sleep early (see doorbell.py)
        self.bell = bell if bell is not None and bell.enabled else None
        self.nap = time.sleep if self.bell is None else self.bell.wait
        self.start = start
        self.cap = cap
        self.fine = fine
        self.fine_max = fine_max
        self.share = share
        self.far = far
        self.delay = start
        self.due: Optional[float] = None
        self.grace = 0.0
        self.poll = fine
        self.spin_until = 0.0
        self.free = self.FREE_POLLS

    @classmethod
    def poll_first(cls, seconds: float) -> None:
        """Make every wait of this process poll for `seconds` after reset() before it
        sleeps (0: sleep between polls from the first miss on)."""
        cls.spin_s = seconds

    def reset(self, due: Optional[float] = None, grace: float = 0.0,
              span: Optional[float] = None) -> None:
        """`due`: when the message is expected (``time.monotonic()``), with `grace` seconds
        of fine polling after it; `span`: how long that wait is in all (sets the polling
        interval; default: from now to `due`)."""
        self.delay = self.start
        self.free = self.FREE_POLLS
        self.due = due
        self.grace = grace
        self.poll = self.fine
        if self.spin_s:
            self.spin_until = time.monotonic() + self.spin_s
        if due is not None:
            span = due - time.monotonic() if span is None else span
            self.poll = min(self.fine_max, max(self.fine, span * self.share))

    def sleep(self) -> None:
        if self.free:
            self.free -= 1
            return   # the message may be a progress call away (FREE_POLLS)
        if self.spin_s and time.monotonic() < self.spin_until:
            return   # a CPU of its own: poll on
        if self.bell is not None and self.bell.owed:
            # A ring announced a message MPI does not show yet (over the network the ring
            # may come first): poll for it as rank 0 does, not a sleep of the schedule's.
            self.bell.rest(self.far)
            return
        if self.due is not None:
            ahead = self.due - time.monotonic()
            if ahead > self.poll:
                self.nap(min(ahead - self.poll, self.far))
                return
            if ahead > -self.grace:
                if self.poll > self.fine:   # (the kernel adds ~`fine` to every sleep)
                    self.nap(self.poll - self.fine)
                else:
                    self.nap(1e-6)   # the shortest sleep (see short)
                return
            self.due = None           # overdue: back off from the polling interval on
            self.delay = max(self.delay, self.poll)
        self.nap(self.delay)
        self.delay = min(self.cap, self.delay * 2)

    @staticmethod
    def short() -> None:
        """The shortest sleep (the kernel's timer slack, ~50 us): a transfer is under way
        and needs MPI progress soon, but another process may need this core."""
        time.sleep(1e-6)


class WaitEstimate:
    """How long a recurring wait lasts when it is short: a low quantile, tracked by an
    asymmetric EWMA that follows shorter waits quickly and longer ones slowly. As a
    ``(due, grace)`` for :meth:`Backoff.reset`, fine polling starts a little before it.

    The fine-polling window is bounded in absolute time: it starts ``min((1 - early) x
    wait, lead)`` before the estimate and lasts ``min(2 x wait, grace)`` + ``lead`` after
    it. Fine polls cost a wake-up and a system call each (tens of µs on a virtual machine);
    with windows in proportion to the wait, a server whose workers take 50 ms a step
    spent ~10% of a core polling (0.2 x 50 ms before every push, up to 100 ms after).
    """

    def __init__(self, down: float = 0.5, up: float = 0.05, early: float = 0.8,
                 lead: float = 0.5e-3, grace: float = 2e-3):
        self.down = down
        self.up = up
        self.early = early
        self.lead = lead
        self.grace = grace
        self.value: Optional[float] = None

    def update(self, seconds: float) -> None:
        if self.value is None:
            self.value = seconds
        else:
            self.value += (self.down if seconds < self.value else self.up) * (seconds - self.value)

    def window(self, start: float) -> tuple[Optional[float], float]:
        """(due, grace) for a wait that began at ``start`` (``time.monotonic()``); the wait's
        whole length is :attr:`value` (a `span` for :meth:`Backoff.reset`)."""
        if self.value is None:
            return None, 0.0
        lead = min((1.0 - self.early) * self.value, self.lead)
        return start + self.value - lead, min(2.0 * self.value, self.grace) + self.lead
