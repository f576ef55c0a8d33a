"""A worker's state as the server sees it (the live server's peers and the simulator's workers).

Two parts, changed only by named methods of the objects that hold them
(:class:`mpilb.server.peers.Peer`, :class:`mpilb.simulate.engine.SimWorker`):

- waiting: COMPUTING (it has work and parameters; a push is to come), IDLE (told it has
  nothing to do; it waits for a message), HELD (it pushed; the reply is held by ssp or sync);
- membership: ACTIVE, BENCHED (sits sync rounds out), STOPPED (told to stop), LOST (silent
  past --worker-timeout).

    IDLE --wake--> COMPUTING --hold--> HELD --release--> COMPUTING --go_idle--> IDLE
    ACTIVE --bench--> BENCHED --unbench--> ACTIVE;  any --stop--> STOPPED;  any --lose--> LOST
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
