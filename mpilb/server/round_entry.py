"""A worker that joins a `--mode sync` run enters at a round boundary (docs/membership.md).

A sync round waits for every busy worker (modes.Synchronous.round_complete). A joiner
admitted while a round is open would become one of the workers that round waits for, though
the round began without it; so a joiner accepted then waits, connected but not yet admitted
(no id in the ledger or the balancer, no reply), until the round closes, and is admitted
right after the round's members were released (loop.ParameterServer._close_round): it gets
the parameters of the new version, as they do, and the rounds wait for it from the next one
on. Its answer ("joined as worker N") is written then. With no round open (every worker
idle, or between a round's close and its next push) it is admitted at once.

Nothing is counted twice: the joiner's first push belongs to the round it was woken for,
and the open round's members pushed before it had any work. A run that ends while a joiner
waits here turns it away as one still in MPI_Comm_connect is (admission.turn_away).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional


class Entry(NamedTuple):
    """A joiner accepted while a round was open: its communicator, offer, doorbell address
    and (--servers K > 1) the id the stores accepted it as."""

    comm: object
    offer: object
    ringback: dict
    reserved: Optional[int]


class RoundEntry:
    """Joiners waiting for the open sync round to close (rank 0).

    Args:
        rule: () -> the update rule (modes.py): only one with rounds defers anyone.
    """

    def __init__(self, rule: Callable[[], object]):
        self.rule = rule
        self.waiting: list[Entry] = []

    def round_open(self) -> bool:
        """Is a sync round open (a member has pushed into it)?"""
        rule = self.rule()
        return bool(getattr(rule, "rounds", False) and getattr(rule, "members", None))

    def defer(self, entry: Entry) -> bool:
        """Keep `entry` until the open round closes; False (admit it now) where none is open."""
        if not self.round_open():
            return False
        self.waiting.append(entry)
        return True

    def closed(self, admit: Callable[[Entry], None]) -> None:
        """The round closed (its members released): `admit` each joiner that waited."""
        waiting, self.waiting = self.waiting, []
        for entry in waiting:
            admit(entry)

    def take_all(self) -> list[Entry]:
        """The run ends: the joiners that waited, to be turned away."""
        waiting, self.waiting = self.waiting, []
        return waiting
