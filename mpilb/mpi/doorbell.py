"""Doorbells: a rank waiting for a message from rank 0 (or rank 0 waiting for pushes) sleeps in
the kernel until the sender says it has sent one.

MPI offers no blocking wait that does not spin a core (MPICH's spin), so mpilb's waits poll
with sleeps (:class:`waiting.Backoff`). On a virtual machine a sleep costs ~25 µs of CPU and
wakes no sooner than ~80 µs after it was asked to, and a push's round trip paid that several
times: rank 0 noticing the push, the worker noticing the reply. A doorbell is a datagram that
the sender writes right after posting its MPI send; the receiver's sleeps (``select`` on its
sockets) end as soon as one comes, ~10 µs after it was written on one node, and cost no CPU
in between.

Two ways to ring, chosen per pair at start-up:

- *local*: a Unix datagram socket whose name is in Linux's abstract namespace (per node and
  per network namespace, so only ranks on one node reach each other this way);
- *network*: a UDP socket bound to the address of the interface this rank reaches rank 0 by
  (rank 0's host address, and on every other rank the address the kernel routes to it
  from), for ranks on other nodes.

At start-up rank 0 and every other rank test-ring each other both ways; a pair rings
locally where that arrived both ways, else over the network where that did, else (a
firewall, no IPv4 route, another network namespace) it keeps polling as before, and so does
every rank off Linux or with ``MPILB_DOORBELL=0``. A ring is only ever a hint to look now:
every wait still checks MPI itself and is bounded by its own schedule, so a lost ring (UDP
may lose one) costs latency, never a message. Each datagram carries a per-job key (from
``secrets``; not the socket names' token, which ``/proc/net/unix`` shows), and one that
comes over the network must also come from the address its rank announced: anything else
read from the sockets is dropped, so a stranger's datagram costs at most one extra poll.
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
TEST_RING_S = 1.0   # at start-up, how long a test ring over the network may take to arrive
# (sender's rank, the number of its message to this rank: 0 a poke, -1 a test ring, the job's key)
RING = struct.Struct("<ii8s")
POKE, TEST = 0, -1
LOCAL, NETWORK = "local", "network"


class Doorbell:
    """This rank's sockets and the ranks it exchanges rings with (`peers`), each through
    the socket and address of its route (:meth:`route`)."""

    def __init__(self, sock: Optional[socket.socket] = None, rank: int = 0, prefix: str = "",
                 peers=(), key: bytes = bytes(8), net: Optional[socket.socket] = None,
                 addrs: Optional[dict] = None):
        self.sock = sock     # the Unix socket (local rings)
        self.net = net       # the UDP socket (rings over the network)
        self.rank = rank
        self.prefix = prefix
        self.key = key
        self.addrs = dict(addrs or {})   # rank -> (ip, port) its UDP socket is bound to
        self.routes: dict[int, tuple] = {}   # rank -> (socket, address) its rings go to
        self.listening: tuple = ()           # the sockets some route uses (wait selects on them)
        for peer in peers:
            self.route(peer, LOCAL)
        # Rings are numbered per (sender, receiver): ring k announces the sender's k-th
        # message, so a ring whose message was already taken (seen by MPI before the ring
        # was read) is recognised as stale and costs no polling.
        self.sent: dict[int, int] = {}
        self.heard: dict[int, int] = {}
        self.taken: dict[int, int] = {}
        self.rung: dict[int, int] = {}   # rings read from each sender (the run log's `doorbells`)
        self.owed: set[int] = set()   # senders with a rung message not taken yet
        self.owed_until = 0.0
        self.owed_nap = 0.0
        self.owed_polls = 0           # polls left before the first sleep (Backoff.FREE_POLLS)
        self.poked = False            # a peer asked for this rank's MPI progress (poke)

    def route(self, rank: int, via: Optional[str]) -> None:
        """Ring `rank` locally, over the network, or (None) not at all."""
        self.routes.pop(rank, None)
        if via == LOCAL and self.sock is not None:
            self.routes[rank] = (self.sock, self.prefix + str(rank))
        elif via == NETWORK and self.net is not None and self.addrs.get(rank) is not None:
            self.routes[rank] = (self.net, self.addrs[rank])
        self._listen()

    def _listen(self) -> None:
        used = {id(sock) for sock, _ in self.routes.values()}
        self.listening = tuple(s for s in (self.sock, self.net) if s is not None and id(s) in used)

    def add_peer(self, rank: int, local: Optional[str] = None, net=None) -> Optional[str]:
        """A rank that joined the job (mpi/joining.py): ring it at its local socket `local`
        where that is reachable from here, else over the network at `net` (ip, port);
        returns the route taken (None: it is polled for, as without doorbells)."""
        self.routes.pop(rank, None)
        if local and self.sock is not None and _reaches(self.sock, local, self.rank, self.key):
            self.routes[rank] = (self.sock, local)
        elif net and self.net is not None:
            self.addrs[rank] = (str(net[0]), int(net[1]))
            self.routes[rank] = (self.net, self.addrs[rank])
        self._listen()
        return self.via(rank)

    def invitation(self) -> Optional[dict]:
        """What a joiner needs to ring rank 0 (for the owner-only file beside its port)."""
        if self.sock is None and self.net is None:
            return None
        return {"prefix": self.prefix, "key": self.key.hex(),
                "net": list(self.net.getsockname()) if self.net is not None else None}

    def via(self, rank: int) -> Optional[str]:
        sock = self.routes.get(rank, (None,))[0]
        return None if sock is None else LOCAL if sock is self.sock else NETWORK

    @property
    def peers(self) -> set:
        return set(self.routes)

    @property
    def enabled(self) -> bool:
        return bool(self.routes)

    def rings_with(self, rank: int) -> bool:
        return rank in self.routes

    def ring(self, rank: int, wake: bool = True) -> None:
        """Tell `rank` that a message to it was just posted (after the MPI send call);
        `wake=False`: only count the message (the receiver is known to be polling), so that
        the numbering of later rings stays that of the messages."""
        if rank not in self.routes:
            return
        seq = self.sent[rank] = self.sent.get(rank, 0) + 1
        if wake:
            self._send(rank, seq)

    def poke(self, rank: int) -> None:
        """Ask `rank` to progress its sends to this rank for a while (a ring announcing no
        message): this rank is receiving one now, and a message copied through shared
        memory in pieces moves only while its sender calls MPI."""
        if rank in self.routes:
            self._send(rank, POKE)

    def _send(self, rank: int, seq: int) -> None:
        sock, address = self.routes[rank]
        try:
            sock.sendto(RING.pack(self.rank, seq, self.key), address)
        except OSError:   # its queue is full (it has rings to read anyway), it has exited, no route
            pass

    def take_poke(self) -> bool:
        poked, self.poked = self.poked, False
        return poked

    def wait(self, timeout: float) -> int:
        """Sleep until rung or for `timeout` seconds; returns how many rings came."""
        if not self.listening:
            time.sleep(max(0.0, timeout))
            return 0
        ready, _, _ = select.select(self.listening, (), (), max(0.0, timeout))
        if not ready:
            return 0
        rings: list = []
        for sock in ready:
            self._drain(sock, rings)
        for sender, seq in rings:
            if seq == POKE:
                self.poked = True
            elif seq > self.heard.get(sender, 0):
                self.heard[sender] = seq
                if seq > self.taken.get(sender, 0):
                    self.owed.add(sender)
                    self.owed_until = time.monotonic() + OWED_S
                    self.owed_nap = 0.25e-3
                    self.owed_polls = Backoff.FREE_POLLS
            if seq > 0:
                self.rung[sender] = self.rung.get(sender, 0) + 1
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

    def _drain(self, sock: socket.socket, got: list) -> list[tuple[int, int]]:
        """Append to `got` the (sender, number) of every ring waiting on `sock`, dropping
        what is not one of this job's: the wrong size or key, or over the network from
        another address than the one its sender's socket is bound to."""
        from_net = sock is self.net
        while True:
            try:
                data, address = sock.recvfrom(64)
            except (BlockingIOError, InterruptedError):
                return got
            except OSError:   # (an ICMP error a UDP socket may report)
                return got
            if len(data) != RING.size:
                continue
            sender, seq, key = RING.unpack(data)
            if key != self.key or (from_net and self.addrs.get(sender) != address):
                continue
            got.append((sender, seq))

    def report(self) -> dict:
        """For the run log: how each peer rings this rank and how many rings came from it."""
        return {str(r): {"via": self.via(r), "rings": self.rung.get(r, 0)} for r in sorted(self.routes)}

    def close(self) -> None:
        for sock in (self.sock, self.net):
            if sock is not None:
                sock.close()
        self.sock = self.net = None
        self.routes = {}
        self.listening = ()


_current = Doorbell()


def current() -> Doorbell:
    """The bell opened for this process's job (a silent one when none was opened)."""
    return _current


def wanted() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("MPILB_DOORBELL", "1") != "0"


# ------------------------------------------------------------ addresses (rings over the network)
SIOCGIFADDR = 0x8915   # Linux: an interface's IPv4 address


def _interface_address(name: str) -> Optional[str]:
    import fcntl   # (Unix only; doorbells are Linux only)

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:   # no IPv4 address
            return None
    return socket.inet_ntoa(packed[20:24])


def host_addresses() -> list[str]:
    """This host's IPv4 addresses that another host may reach it by, the likeliest first:
    that of the interface hydra's control connections use (``HYDRA_IFACE``), then those its
    hostname resolves to, then every other interface's; loopback ones left out."""
    try:
        interfaces = [name for _, name in socket.if_nameindex()]
    except OSError:
        return []
    mine = {name: _interface_address(name) for name in interfaces}
    found = [mine.get(os.environ.get("HYDRA_IFACE", ""))]
    try:
        found += [a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    found += list(mine.values())
    out: list[str] = []
    for a in found:   # (a hostname may resolve to another host's address, or to 127.0.1.1)
        if a and a in mine.values() and not a.startswith("127.") and a not in out:
            out.append(a)
    return out


def route_source(address: str) -> Optional[str]:
    """The local address the kernel sends from to `address` (a UDP connect sends nothing),
    or None where there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))
            return s.getsockname()[0]
        except OSError:
            return None


def _open_net(rank: int, rank0_address: Optional[str]) -> Optional[socket.socket]:
    """This rank's UDP socket, bound to the address it reaches rank 0 by (rank 0: its own)."""
    if rank0_address is None:
        return None
    source = rank0_address if rank == 0 else route_source(rank0_address)
    if source is None:
        return None
    return _bound(socket.AF_INET, (source, 0))


def _open_local(name: str) -> Optional[socket.socket]:
    return _bound(socket.AF_UNIX, name)


def _bound(family, address) -> Optional[socket.socket]:
    """A nonblocking datagram socket of `family` bound to `address`, or None where that fails."""
    sock = None
    try:
        sock = socket.socket(family, socket.SOCK_DGRAM)
        sock.bind(address)
        sock.setblocking(False)
        return sock
    except OSError:
        if sock is not None:
            sock.close()
        return None


def open_job(comm, rank: int, size: int) -> Doorbell:
    """Collective: give every rank a doorbell shared with rank 0 where rings arrive both
    ways: locally where they do so, else over the network.

    Uses only lowercase (pickled) collectives, once at start-up."""
    global _current
    _current.close()
    _current = Doorbell()
    if size < 2 or not all(comm.allgather(wanted())):
        return _current
    token, key, rank0_address = comm.bcast(
        (secrets.token_hex(8), secrets.token_bytes(8),
         next(iter(host_addresses()), None)) if rank == 0 else None, root=0)
    prefix = f"\0mpilb-{token}-"
    sock = _open_local(prefix + str(rank))
    net = _open_net(rank, rank0_address)
    addrs = comm.allgather(net.getsockname() if net is not None else None)
    bell = Doorbell(sock, rank, prefix, key=key, net=net,
                    addrs={r: a for r, a in enumerate(addrs) if a is not None})
    others = range(1, size) if rank == 0 else (0,)
    comm.barrier()   # every socket is bound
    for peer in others:   # test rings, both ways
        for via in (LOCAL, NETWORK):
            bell.route(peer, via)
            if bell.rings_with(peer):
                bell._send(peer, TEST)
    comm.barrier()   # every local test ring was delivered (Unix datagrams arrive at send)
    heard = {LOCAL: _senders(bell, sock), NETWORK: set()}
    # rings over the network arrive when they do: wait for those still to come a moment
    awaited = {p for p in others if p in bell.addrs and p not in heard[LOCAL]} if net else set()
    deadline = time.monotonic() + TEST_RING_S
    while awaited - heard[NETWORK] and time.monotonic() < deadline:
        if select.select((net,), (), (), max(0.0, deadline - time.monotonic()))[0]:
            heard[NETWORK] |= _senders(bell, net)
    everyone = comm.allgather({via: sorted(s) for via, s in heard.items()})
    for peer in others:
        a, b = (peer, 0) if rank == 0 else (rank, peer)   # (the worker, rank 0)
        both = [via for via in (LOCAL, NETWORK) if b in everyone[a][via] and a in everyone[b][via]]
        bell.route(peer, both[0] if both else None)
    for via, s in ((LOCAL, sock), (NETWORK, net)):   # sockets no route uses: closed
        if s is not None and s not in bell.listening:
            s.close()
            if via == LOCAL:
                bell.sock = None
            else:
                bell.net = None
    if not bell.enabled:
        bell.close()
    _current = bell
    return bell


def install(bell: Doorbell) -> None:
    """Make `bell` (a joiner's: :func:`join_job`) this process's :func:`current`."""
    global _current
    if _current is not bell:
        _current.close()
    _current = bell


def join_job(invitation: Optional[dict]) -> tuple[Doorbell, dict]:
    """A joiner's doorbell with rank 0 (from its :meth:`Doorbell.invitation`) and what rank
    0 needs to ring it back (:meth:`Doorbell.add_peer`): local where rank 0's socket is
    reachable, else over the network, else none (a silent bell, ``{}``). Its rank (the
    sender its rings name) is set once the job gives it an id."""
    if not invitation or not wanted():
        return Doorbell(), {}
    prefix, key = invitation["prefix"], bytes.fromhex(invitation["key"])
    rank0_net = tuple(invitation["net"]) if invitation.get("net") else None
    name = f"{prefix}j{os.getpid()}"
    sock = _open_local(name)
    if sock is not None and not _reaches(sock, prefix + "0", -1, key):
        sock.close()
        sock = None
    net = None if sock is not None or rank0_net is None else _open_net(1, rank0_net[0])
    bell = Doorbell(sock, -1, prefix, key=key, net=net,
                    addrs={0: (rank0_net[0], int(rank0_net[1]))} if rank0_net else {})
    bell.route(0, LOCAL if sock is not None else NETWORK)
    if not bell.enabled:
        bell.close()
        return bell, {}
    return bell, ({"local": name} if sock is not None else {"net": list(net.getsockname())})


def _reaches(sock: socket.socket, name: str, rank: int, key: bytes) -> bool:
    """Is a local socket of that name there? (A datagram to a name none holds fails.) A
    socket whose queue is full is there: its rings wait to be read (a Unix datagram socket
    queues a few; rank 0 busy with the others' pushes has that many unread, and a joiner
    that took EAGAIN for "not there" went without a doorbell: measured, half the runs of
    test_one_launch_of_two_joiners_rings_and_does_its_share on a fast 2-core VM)."""
    try:
        sock.sendto(RING.pack(rank, TEST, key), name)
        return True
    except BlockingIOError:
        return True
    except OSError:
        return False


def _senders(bell: Doorbell, sock: Optional[socket.socket]) -> set[int]:
    """Who test-rang this rank through `sock`."""
    if sock is None:
        return set()
    return {sender for sender, seq in bell._drain(sock, []) if seq == TEST}
