"""Doorbells over the network (mpilb/mpi/doorbell.py, UDP): a ring wakes its receiver, a
datagram that is not the job's is dropped, routes choose the socket, and a wait whose bell
announced a message polls for it."""

from __future__ import annotations

import secrets
import socket
import sys
import time

import pytest

from mpilb.mpi import doorbell
from mpilb.mpi.doorbell import LOCAL, NETWORK, RING, Doorbell
from mpilb.mpi.waiting import Backoff

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="doorbells are Linux only")


def udp() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.setblocking(False)
    return s


@pytest.fixture
def pair():
    """Rank 0 and rank 1 ringing each other over UDP on the loopback interface."""
    key = secrets.token_bytes(8)
    socks = [udp(), udp()]
    addrs = {r: s.getsockname() for r, s in enumerate(socks)}
    bells = [Doorbell(rank=r, key=key, net=socks[r], addrs=addrs) for r in (0, 1)]
    bells[0].route(1, NETWORK)
    bells[1].route(0, NETWORK)
    yield bells
    for b in bells:
        b.close()


def test_a_ring_over_udp_wakes_and_is_counted(pair):
    server, worker = pair
    assert server.via(1) == NETWORK and server.listening == (server.net,)
    worker.ring(0)
    t = time.monotonic()
    assert server.wait(5.0) == 1
    assert time.monotonic() - t < 1.0          # woken by the ring, not the timeout
    assert server.owed == {1} and server.heard == {1: 1}
    worker.poke(0)                             # a poke is no ring of a message
    assert server.wait(5.0) == 1 and server.take_poke()
    assert server.report() == {"1": {"via": NETWORK, "rings": 1}}


def test_datagrams_that_are_not_the_jobs_are_dropped(pair):
    server, worker = pair
    target = server.addrs[0]
    stranger = udp()
    try:
        stranger.sendto(RING.pack(1, 1, worker.key), target)     # the key, another address
        worker.net.sendto(RING.pack(1, 1, bytes(8)), target)    # its address, another key
        worker.net.sendto(b"ring", target)                       # another size
        time.sleep(0.05)
        assert server.wait(0.5) == 0                             # (woken, nothing taken)
        assert server.heard == {} and server.owed == set() and not server.poked
        worker.ring(0)                                           # the worker's own still counts
        assert server.wait(5.0) == 1 and server.heard == {1: 1}
    finally:
        stranger.close()


def test_routes_choose_the_socket_and_a_bell_listens_only_where_it_rings():
    local = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    net = udp()
    bell = Doorbell(local, 0, "\0mpilb-test-", key=bytes(8), net=net, addrs={2: ("127.0.0.1", 9)})
    try:
        bell.route(1, LOCAL)
        assert bell.via(1) == LOCAL and bell.listening == (local,)
        bell.route(2, NETWORK)
        assert bell.via(2) == NETWORK and set(bell.listening) == {local, net}
        bell.route(3, NETWORK)                 # no address known: it does not ring
        bell.route(1, None)
        assert bell.peers == {2} and bell.listening == (net,)
    finally:
        bell.close()
    assert not bell.enabled and bell.listening == ()


def test_a_wait_whose_bell_announced_a_message_polls_for_it(pair, monkeypatch):
    """Over the network a ring may come before MPI shows its message: the wait polls for
    it (Doorbell.rest) instead of sleeping on to the next step of its schedule (up to 10 ms
    when the message was expected later)."""
    server, worker = pair
    b = Backoff(bell=worker)
    b.reset(due=time.monotonic() + 1.0)
    for _ in range(Backoff.FREE_POLLS):
        b.sleep()
    rests, naps = [], []
    monkeypatch.setattr(worker, "rest", lambda longest: rests.append(longest))
    monkeypatch.setattr(b, "nap", lambda s: naps.append(s))
    b.sleep()
    assert naps and not rests                  # nothing announced: the schedule's sleep
    server.ring(1)
    assert worker.wait(5.0) == 1 and worker.owed == {0}
    b.sleep()
    assert rests == [b.far] and len(naps) == 1
    worker.took(0)                             # it came
    b.sleep()
    assert len(rests) == 1 and len(naps) == 2


def test_addresses_leave_loopback_out_and_routes_are_found():
    assert not any(a.startswith("127.") for a in doorbell.host_addresses())
    assert doorbell.route_source("127.0.0.1") == "127.0.0.1"
