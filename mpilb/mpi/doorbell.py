"""Doorbells: a rank waiting for a message from rank 0 (or rank 0 waiting for pushes) sleeps in
the kernel until the sender says it has sent one.

MPI offers no blocking wait that does not spin a core (MPICH's spin), so mpilb's waits poll
with sleeps (:class:`waiting.Backoff`). On a virtual machine a sleep costs ~25 µs of CPU and
wakes no sooner than ~80 µs after it was asked to, and a push's round trip paid that several
times: rank 0 noticing the push, the worker noticing the reply. A doorbell is a datagram on a
Unix socket that the sender writes right after posting its MPI send; the receiver's sleeps
(``select`` on its socket) end as soon as one comes, ~10 µs after it was written, and cost no
CPU in between.

Only ranks on one node can ring each other (the sockets' names are in Linux's abstract
namespace, which is per node and per network namespace). At start-up rank 0 and every other
rank test-ring each other; a pair whose rings did not arrive both ways (other nodes,
containers with their own network) keeps polling as before, and so does every rank off Linux
or with ``MPILB_DOORBELL=0``. A ring is only ever a hint to look now: every wait still checks
MPI itself and is bounded by its own schedule, so a lost ring costs latency, never a message.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import sys
import time
from typing import Optional

from mpilb.mpi.waiting import Backoff

OWED_S = 2e-3       # after a ring, poll finely this long for the message it announced
OWED_NAP_S = 5e-3   # then wake at least this often until it comes (see Doorbell.rest)
POKE_PROGRESS_S = 0.5e-3   # a poke has rank 0 progress its sends this long (server/loop.py)
RING = struct.Struct("<ii")   # (sender's rank, the number of its message to this rank)


class Doorbell:
    """This rank's socket and the ranks it exchanges rings with (`peers`)."""

    def __init__(self, sock: Optional[socket.socket] = None, rank: int = 0, prefix: str = "",
                 peers=()):
        self.sock = sock
        self.rank = rank
        self.prefix = prefix
        self.peers = set(peers)
        # Rings are numbered per (sender, receiver): ring k announces the sender's k-th
        # message, so a ring whose message was already taken (seen by MPI before the ring
        # was read) is recognised as stale and costs no polling.
        self.sent: dict[int, int] = {}
        self.heard: dict[int, int] = {}
        self.taken: dict[int, int] = {}
        self.owed: set[int] = set()   # senders with a rung message not taken yet
        self.owed_until = 0.0
        self.owed_nap = 0.0
        self.owed_polls = 0           # polls left before the first sleep (Backoff.FREE_POLLS)
        self.poked = False            # a peer asked for this rank's MPI progress (poke)

    @property
    def enabled(self) -> bool:
        return self.sock is not None and bool(self.peers)

    def rings_with(self, rank: int) -> bool:
        return self.sock is not None and rank in self.peers

    def ring(self, rank: int, wake: bool = True) -> None:
        """Tell `rank` that a message to it was just posted (after the MPI send call);
        `wake=False`: only count the message (the receiver is known to be polling), so that
        the numbering of later rings stays that of the messages."""
        if not self.rings_with(rank):
            return
        seq = self.sent[rank] = self.sent.get(rank, 0) + 1
        if wake:
            self._send(rank, seq)

    def poke(self, rank: int) -> None:
        """Ask `rank` to progress its sends to this rank for a while (a ring announcing no
        message): this rank is receiving one now, and a message copied through shared
        memory in pieces moves only while its sender calls MPI."""
        if self.rings_with(rank):
            self._send(rank, 0)

    def _send(self, rank: int, seq: int) -> None:
        try:
            self.sock.sendto(RING.pack(self.rank, seq), self.prefix + str(rank))
        except OSError:   # its queue is full (it has rings to read anyway) or it has exited
            pass

    def take_poke(self) -> bool:
        poked, self.poked = self.poked, False
        return poked

    def wait(self, timeout: float) -> int:
        """Sleep until rung or for `timeout` seconds; returns how many rings came."""
        if self.sock is None:
            time.sleep(max(0.0, timeout))
            return 0
        ready, _, _ = select.select((self.sock,), (), (), max(0.0, timeout))
        if not ready:
            return 0
        rings = self._drain()
        for sender, seq in rings:
            if seq == 0:
                self.poked = True
            elif seq > self.heard.get(sender, 0):
                self.heard[sender] = seq
                if seq > self.taken.get(sender, 0):
                    self.owed.add(sender)
                    self.owed_until = time.monotonic() + OWED_S
                    self.owed_nap = 0.25e-3
                    self.owed_polls = Backoff.FREE_POLLS
        return len(rings)

    def took(self, sender: int) -> None:
        """A message from `sender` (one that rings) was received."""
        n = self.taken[sender] = self.taken.get(sender, 0) + 1
        if n >= self.heard.get(sender, 0):
            self.owed.discard(sender)

    def rest(self, longest: float) -> None:
        """Wait for a message whose sender rings: while a rung message has not been taken
        (it is on its way, not yet visible to MPI) poll, at once for the first
        `Backoff.FREE_POLLS` calls after its ring, finely for `OWED_S`, then with naps
        growing to `OWED_NAP_S`; else sleep until the next ring, `longest` seconds at most.

        A rung message that is late is not given up on: it was sent, and a transfer that
        needs its sender's MPI progress is late exactly when the sender lost its core for a
        while. (Giving up once counted it as taken; when it then came, the count ran one
        ahead of the sender's rings, every later ring looked stale, and rank 0 slept through
        each push whose transfer was still under way: one worker's epoch took 14.6 s
        instead of 1.6.) :meth:`forget` ends the wait for a sender that is gone."""
        if self.owed:
            if self.owed_polls:   # the message may be a progress call away: no sleep yet
                self.owed_polls -= 1
                return
            if time.monotonic() < self.owed_until:
                Backoff.short()
                return
            self.wait(min(longest, self.owed_nap))
            self.owed_nap = min(OWED_NAP_S, 2 * self.owed_nap)
            return
        self.wait(longest)

    def forget(self, sender: int) -> None:
        """`sender` is gone (lost): what it rang will not come."""
        if sender in self.heard:
            self.taken[sender] = max(self.taken.get(sender, 0), self.heard[sender])
        self.owed.discard(sender)

    def _drain(self) -> list[tuple[int, int]]:
        got = []
        while True:
            try:
                data = self.sock.recv(16)
            except (BlockingIOError, InterruptedError):
                return got
            if len(data) == RING.size:
                got.append(RING.unpack(data))

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.peers = set()


_current = Doorbell()


def current() -> Doorbell:
    """The bell opened for this process's job (a silent one when none was opened)."""
    return _current


def wanted() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("MPILB_DOORBELL", "1") != "0"


def open_job(comm, rank: int, size: int) -> Doorbell:
    """Collective: give every rank a doorbell shared with rank 0 where rings arrive both ways.

    Uses only lowercase (pickled) collectives, once at start-up."""
    global _current
    _current.close()
    _current = Doorbell()
    if size < 2 or not all(comm.allgather(wanted())):
        return _current
    token = comm.bcast(secrets.token_hex(8) if rank == 0 else None, root=0)
    prefix = f"\0mpilb-{token}-"
    sock = None
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(prefix + str(rank))
        sock.setblocking(False)
    except OSError:
        if sock is not None:
            sock.close()
        sock = None
    bell = Doorbell(sock, rank, prefix, range(1, size) if rank == 0 else (0,))
    comm.barrier()   # every socket is bound
    for peer in sorted(bell.peers):
        bell.ring(peer)
    comm.barrier()   # every test ring was delivered (Unix datagrams arrive at send)
    heard = {sender for sender, _ in bell._drain()} if sock is not None else set()
    bell.sent.clear()   # the test rings announced no message
    everyone = comm.allgather(sorted(heard))
    if rank == 0:
        bell.peers = {r for r in range(1, size) if r in everyone[0] and 0 in everyone[r]}
    else:
        bell.peers = {0} if rank in everyone[0] and 0 in everyone[rank] else set()
    if not bell.peers:
        bell.close()
    _current = bell
    return bell
