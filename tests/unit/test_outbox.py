"""Outbox: rank 0 never waits for a send to a worker. A worker that died (or hangs) right
after its push never receives the reply sent to it; the next message to it (a wake at an
epoch's start, STOP, orders) used to wait for that reply's send, and blocked rank 0 for good
(Open MPI: a crashed worker under --mca orte_abort_on_non_zero_status 0)."""

from __future__ import annotations

import numpy as np

from mpilb.mpi import wire
from mpilb.mpi.wire import Cmd
from mpilb.server.outbox import Outbox
from mpilb.server.peers import Link, Peer


class Request:
    """An MPI request the test finishes by hand; Wait on an unfinished one is a hang."""

    def __init__(self, buf):
        self.buf = np.array(buf, copy=True)   # what was sent, as it was when sent
        self.done = False

    def Test(self):
        return self.done

    def Wait(self):
        raise AssertionError("rank 0 waited for a send to a worker")


class Comm:
    def __init__(self):
        self.sent: list = []

    def Isend(self, buf, dest, tag):
        req = Request(buf)
        self.sent.append((dest, tag, req))
        return req


class Ring:
    version = 7
    params = np.arange(4, dtype=np.float32)
    bytes_out = 0

    def __init__(self):
        self.reqs = []

    def sending(self, req, rank=None):
        self.reqs.append(req)

    def sent_version(self, rank):
        pass


class Ledger:
    def take_reply(self, rank, batch):
        return [], [], None

    def take_orders(self, rank):
        return []

    def has_orders(self, rank):
        return False


class Bell:
    def ring(self, rank, wake=True):
        pass


class Remote:
    def reply(self, rank):
        pass


def outbox():
    comm = Comm()
    return comm, Outbox(comm, Ledger(), Remote(), Bell())


def peer(pipelined=False):
    return Peer(rank=2, link=Link.allocate(4, pipelined), batch=8)


def headers(comm, tag=wire.TAG_REPLY):
    return [wire.header_view(req.buf) for _, t, req in comm.sent if t == tag]


def test_a_reply_to_a_worker_that_never_received_the_last_goes_out_unwaited():
    comm, box = outbox()
    w, ring = peer(), Ring()
    box.reply(w, ring)                  # the idle reply to its last push: never received
    box.reply(w, ring)                  # the wake at the next epoch's start
    box.reply(w, ring, Cmd.STOP)        # and the run's end
    sent = headers(comm)
    assert [wire.decode_reply(h).cmd for h in sent] == [Cmd.PARAMS, Cmd.PARAMS, Cmd.STOP]
    # three buffers: none written while a send read it
    assert len(w.link.replies) == 3
    assert len({id(r) for r in w.link.replies.reqs}) == 3
    assert len(w.link.pending(lambda r: r.Test())) == 5   # 3 headers, 2 parameter messages


def test_a_finished_reply_frees_its_buffer_for_the_next():
    comm, box = outbox()
    w, ring = peer(pipelined=True), Ring()
    for _ in range(10):
        box.reply(w, ring)
        for _, _, req in comm.sent:
            req.done = True            # the worker received it
    assert len(w.link.replies) == 2
    assert w.link.pending(lambda r: r.Test()) == []
    assert not box.in_flight()


def test_orders_and_keep_alives_to_a_silent_worker_do_not_wait():
    comm, box = outbox()
    w = peer()
    box.orders(w)
    box.orders(w)                      # the first is still in flight: another buffer
    assert len(w.link.orders_msg) == 2
    box.keep_alive(w)                  # skipped while orders are on their way
    assert len(headers(comm)) == 2
    for _, _, req in comm.sent:
        req.done = True
    box.keep_alive(w)
    assert len(headers(comm)) == 3 and len(w.link.orders_msg) == 2
