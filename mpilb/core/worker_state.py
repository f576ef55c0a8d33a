"""A worker's state as the server sees it (the live server's peers and the simulator's workers).

Two parts, changed only by named methods of the objects that hold them
(:class:`mpilb.server.peers.Peer`, :class:`mpilb.simulate.engine.SimWorker`):

- waiting: COMPUTING (it has work and parameters; a push is to come), IDLE (told it has
  nothing to do; it waits for a message), HELD (it pushed; the reply is held by ssp or sync);
- membership: ACTIVE, BENCHED (sits sync rounds out), STOPPED (told to stop), LOST (silent
  past --worker-timeout), LEFT (let go while the run goes on: `mpilb leave`, SIGUSR2).

    IDLE --wake--> COMPUTING --hold--> HELD --release--> COMPUTING --go_idle--> IDLE
    ACTIVE --bench--> BENCHED --unbench--> ACTIVE;  any --stop--> STOPPED;  any --lose--> LOST;  any --leave--> LEFT
"""

from __future__ import annotations

from enum import Enum


class Waiting(Enum):
    COMPUTING = "computing"
    IDLE = "idle"
    HELD = "held"


class Membership(Enum):
    ACTIVE = "active"
    BENCHED = "benched"
    STOPPED = "stopped"
    LOST = "lost"
    LEFT = "left"


class WorkerState:
    """Reading and changing a worker's two-part state (``waiting``, ``membership``): the
    common base of the server's :class:`~mpilb.server.peers.Peer` and the simulator's
    :class:`~mpilb.simulate.workers.SimWorker`, which hold the two attributes."""

    __slots__ = ()
    waiting: Waiting
    membership: Membership

    @property
    def idle(self) -> bool:
        return self.waiting is Waiting.IDLE

    @property
    def held(self) -> bool:
        return self.waiting is Waiting.HELD

    @property
    def waits_for_message(self) -> bool:
        """Idle or held: it reads only what the server sends (orders must go out now)."""
        return self.waiting is not Waiting.COMPUTING

    @property
    def benched(self) -> bool:
        return self.membership is Membership.BENCHED

    @property
    def stopped(self) -> bool:
        return self.membership is Membership.STOPPED

    @property
    def lost(self) -> bool:
        return self.membership is Membership.LOST

    @property
    def left(self) -> bool:
        return self.membership is Membership.LEFT

    def go_idle(self) -> None:
        """Told it has nothing to do: it waits for the server's next message."""
        self.waiting = Waiting.IDLE

    def stop(self) -> None:
        self.membership = Membership.STOPPED

    def lose(self) -> None:
        self.membership = Membership.LOST

    def leave(self) -> None:
        self.membership = Membership.LEFT
