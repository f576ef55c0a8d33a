"""What the task ledger holds (pure): a task, a worker's holding of tasks and the messages it
is owed, and the shard events the ledger reports. Apart from the ledger
(:mod:`mpilb.core.tasks`) so that the cuts it asks for (:mod:`mpilb.core.cuts`) can name them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Optional


@dataclass
class Task:
    """Positions [pos, end) of a shard's permuted order still to be applied by one worker."""

    epoch: int
    shard: int
    pos: int        # samples before `pos` are applied (or belong to another task)
    end: int
    src: int = -1   # rank sending the rows (node-local store), -1: read from storage
    start: int = -1
    tag: int = field(default=0, compare=False)   # the transfer's tag when `src` sends rows

    def __post_init__(self):
        if self.start < 0:
            self.start = self.pos

    @property
    def remaining(self) -> int:
        return self.end - self.pos


class ShardEvent(NamedTuple):
    """A row for the run log's `shards/` group (without its time)."""

    epoch: int
    shard: int
    src: int
    dst: int
    event: str
    bytes: int = 0


@dataclass
class Holding:
    """One worker's side of the ledger."""

    rank: int
    tasks: deque = field(default_factory=deque)
    assigns: list = field(default_factory=list)   # TaskMsg not yet sent
    orders: list = field(default_factory=list)    # OrderMsg not yet sent
    cut: Optional[tuple] = None                   # (epoch, shard, end) not yet sent
    batch_sent: int = 0     # the batch size its in-flight work uses
    next_shard: int = -1    # pipeline: the batch it computes now
    next_hi: int = 0

    @property
    def remaining(self) -> int:
        return sum(t.remaining for t in self.tasks)

    @property
    def owed(self) -> bool:
        """True while it has tasks or assignments it has not been told about."""
        return bool(self.tasks or self.assigns)
