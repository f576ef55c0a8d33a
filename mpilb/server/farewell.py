"""Workers that joined and are let go (`mpilb leave`, SIGUSR2: roster.py), on rank 0.

A joiner is connected to rank 0 on a communicator of its own (admission.py), and both
sides must call MPI_Comm_disconnect on it before the joiner's process can end: the call is
collective over the connection and waits for what is pending on it. Rank 0 must not block
in it while the joiner may still be finishing its step, so the end is a short exchange, each
step tested among the chores: the joiner, told LEAVE, takes the rows still on their way to
it and says it is done (mpi/departure.py's message); rank 0 answers, with a synchronous
send, once every row it relays to the joiner is sent (relay.py); when the answer has been
received the joiner is in MPI_Comm_disconnect, and rank 0 calls it too (it returns at once).
A joiner whose process ends before it says it is done is not disconnected (as a lost one).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from mpilb.mpi.wire import TAG_END

END_TIMEOUT_S = 30.0


class Farewells:
    """Joiners let go whose connection is being closed (rank 0).

    Args:
        server: the :class:`~mpilb.server.loop.ParameterServer` (its peers).
        relay: gives the server's :class:`~mpilb.server.relay.RowRelay`, or None.
    """

    def __init__(self, server, relay: Callable):
        self.server = server
        self.relay = relay
        self.ends: dict[int, list] = {}   # joiner -> [its "done" receive, rank 0's answer, buffer]
        self.closed: set[int] = set()     # joiners let go whose connection is closed

    def begin(self, w) -> None:
        """Joiner `w` was just told LEAVE: wait, without blocking, for it to say it is done."""
        done = np.zeros(1, dtype=np.int64)
        self.ends[w.rank] = [w.link.comm.Irecv(done, source=w.link.dest, tag=TAG_END), None, done]

    def poll(self) -> None:
        """Among the chores: a joiner that said it is done is answered (once the rows
        relayed to it are sent); once it has the answer, both disconnect."""
        relay = self.relay()
        for rank, ends in list(self.ends.items()):
            said, answered, _ = ends
            if answered is None:
                if not said.Test() or (relay is not None and relay.pending_for(rank)):
                    continue
                link = self.server.peers[rank].link
                go = np.ones(1, dtype=np.int64)
                ends[1:] = [link.comm.Issend(go, dest=link.dest, tag=TAG_END), go]
            elif answered.Test():
                self.disconnect(rank)

    def disconnect(self, rank: int) -> None:
        """Close the connection of joiner `rank`: what rank 0 still had posted for it (the
        receive of a push that will not come, when it was let go idle) is cancelled first."""
        from mpilb.mpi import comm as C
        from mpilb.mpi import joining

        self.ends.pop(rank, None)
        link = self.server.peers[rank].link
        for req in (link.recv_req, *link.pending(C.finished)):
            if req is not None and not req.Test():
                if req is link.recv_req:
                    req.Cancel()
                C.wait(req, timeout=5.0)
        joining.disconnect(link.comm)
        self.closed.add(rank)
        relay = self.relay()
        if relay is not None:
            relay.closed.add(rank)

    def finish(self, timeout: float = END_TIMEOUT_S) -> None:
        """The job's end: joiners let go and not yet disconnected are waited for, at most
        `timeout` s (one whose process ended without saying it is done is left)."""
        deadline = time.monotonic() + timeout
        while self.ends and time.monotonic() < deadline:
            relay = self.relay()
            if relay is not None:
                relay.progress()
            self.poll()
            time.sleep(0.005)
