"""The worker's parts without MPI: its per-push time accounting, its replies and parameters,
its row exchange (which shards a rank holds, who may send a task's rows, sends kept until
complete) and its compute step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mpirun import config_stub

from mpilb.worker.row_exchange import RowExchange, held_shards
from mpilb.data.shards import placement
from mpilb.mpi.watchdog import Rank0Watch, limit
from mpilb.mpi.wire import TAG_SHARD_BASE, resource_tag
from mpilb.worker.messages import DeviceMessages
from mpilb.worker.pushes import TimeSincePush


def test_time_since_push_splits_a_reply_wait_into_hold_and_comm():
    t = TimeSincePush()
    t.waited(0.5, held=0.0, counts_as_idle=True)          # nothing pushed: all idle
    t.waited(0.3, held=0.2, counts_as_idle=False)         # 0.2 held by the server, 0.1 transfer
    t.comm_s += 0.05                                       # the push itself
    first = t.report(io_total=2.0)
    assert first == pytest.approx(dict(io_s=2.0, comm_s=0.15, idle_s=0.7))
    t.waited(0.1, held=0.4, counts_as_idle=False)          # woke late: never more idle than waited
    assert t.report(io_total=2.5) == pytest.approx(dict(io_s=0.5, comm_s=0.0, idle_s=0.1))
    assert t.reply_window(counts_as_idle=True) == (None, 0.0)
    due, _ = t.reply_window(counts_as_idle=False)         # learnt from the holds: a due time
    assert due is not None


class FakeRequest:
    def __init__(self, log, kind, **kw):
        self.kind, self.kw, self.done = kind, kw, False
        log.append(self)

    def Test(self):
        return self.done

    def Cancel(self):
        self.done = True


class FakeComm:
    """Records Isend/Irecv; nothing completes until a test says so."""

    def __init__(self, size):
        self.size, self.log = size, []

    def Get_size(self):
        return self.size

    def Irecv(self, buf, source, tag):
        return FakeRequest(self.log, "recv", source=source, tag=tag, buf=buf)

    def Isend(self, buf, dest, tag):
        return FakeRequest(self.log, "send", dest=dest, tag=tag, buf=buf)


class FakeFeed:
    def rows(self, epoch, shard, start, end):
        return np.zeros((end - start, 3), np.float32), np.zeros(end - start, np.int64)


def exchange(rank=2, size=5, replicas=3, servers=1):
    cfg = config_stub(servers=servers, replicas=replicas)
    dataset = SimpleNamespace(shard_sizes=[100] * 8, sample_shape=(3,), label_dtype="int64",
                              target_shape=())
    comm = FakeComm(size)
    return comm, RowExchange(comm, rank, cfg, dataset, FakeFeed(), backoff=None, on_poll=None)


def test_held_shards_follow_the_placement():
    ranks = [1, 2, 3, 4]
    p = placement(8, ranks, 2)
    for r in ranks:
        assert held_shards(8, r, ranks, replicas=2) == {s for s, hs in p.items() if r in hs}


def test_expect_posts_receives_from_the_sender_then_the_other_holders():
    comm, ex = exchange(rank=2, replicas=3)
    tag = TAG_SHARD_BASE + 6
    remote = ex.expect(shard=3, rows=10, src=4, tag=tag)
    recvs = [(q.kw["source"], q.kw["tag"]) for q in comm.log]
    # shard 3 lives on workers 4, 1, 2 (placement): the ordered sender first with its tag,
    # then the other holder (not this rank) on the re-source tag; x on tag, y on tag + 1
    alt = resource_tag(tag)
    assert recvs == [(4, tag), (4, tag + 1), (1, alt), (1, alt + 1)]
    assert comm.log[0].kw["buf"].shape == (10, 3) and comm.log[1].kw["buf"].dtype == np.int64
    assert ex.remotes == [remote]
    _, single = exchange(rank=2, replicas=1)
    assert len(single.expect(shard=3, rows=10, src=4, tag=tag).copies) == 1


def test_sends_are_kept_until_complete(monkeypatch):
    from mpilb.worker import row_exchange
    testall = SimpleNamespace(Testall=lambda reqs: all(r.Test() for r in reqs))
    monkeypatch.setattr(row_exchange, "C", SimpleNamespace(Request=testall))
    comm, ex = exchange()
    ex.serve([(0, 1, 10, 20, 3, TAG_SHARD_BASE), (0, 2, 0, 5, 4, TAG_SHARD_BASE + 2)])
    assert [(q.kw["dest"], q.kw["tag"]) for q in comm.log] == [
        (3, TAG_SHARD_BASE), (3, TAG_SHARD_BASE + 1), (4, TAG_SHARD_BASE + 2), (4, TAG_SHARD_BASE + 3)]
    ex.progress()
    assert len(ex.outgoing) == 2
    comm.log[0].done = comm.log[1].done = True
    ex.progress()
    assert len(ex.outgoing) == 1 and ex.outgoing[0][0][0].kw["dest"] == 4


def _replies(comm=None, rows=None, bell=None, backoff=None, pipelined=False):
    from mpilb.worker.replies import Replies

    return Replies(comm or SimpleNamespace(), 1, DeviceMessages(SimpleNamespace(name="cpu"), False),
                   4, [0], [0, 4], bell or SimpleNamespace(took=lambda rank: None),
                   backoff or SimpleNamespace(reset=lambda: None, sleep=lambda: None),
                   Rank0Watch(60.0, 1), rows or SimpleNamespace(progress=lambda: None),
                   pipelined=pipelined)


def test_parameters_still_arriving_keep_poking_rank_0(monkeypatch):
    # Rank 0 progresses its sends only for a moment after a poke; a reply whose parameters
    # are still arriving must poke it again, or the transfer waits for rank 0's next push
    # (with a single worker: its whole nap).
    from mpilb.worker import replies as R

    clock = {"t": 0.0}
    monkeypatch.setattr(R.time, "monotonic", lambda: clock["t"])
    polls = {"n": 0}

    def testall(reqs):
        polls["n"] += 1
        return polls["n"] > 20   # complete at the 21st test: ~2 ms of 0.1 ms naps

    monkeypatch.setattr(R, "C", SimpleNamespace(Request=SimpleNamespace(Testall=testall)))
    pokes = []
    r = _replies(bell=SimpleNamespace(poke=lambda rank: pokes.append((rank, clock["t"]))),
                 backoff=SimpleNamespace(reset=lambda: None,
                                         sleep=lambda: clock.__setitem__("t", clock["t"] + 1e-4)))
    r.pulls = ["a pull"]
    r.finish_pulls()
    assert r.pulls is None
    assert [r for r, _ in pokes] == [0] * len(pokes)
    gaps = np.diff([t for _, t in pokes])
    assert len(pokes) >= 4 and gaps.max() <= R.POKE_EVERY_S + 1e-4 + 1e-9   # poked all along
    assert gaps.min() >= R.POKE_EVERY_S - 1e-9                             # but not at every poll


class FakeMessage:
    """A matched probe whose receive copies a prepared header into the buffer."""

    def __init__(self, header):
        self.header = header

    def Irecv(self, buf):
        buf[:self.header.nbytes] = self.header.view(np.uint8)
        return SimpleNamespace(Test=lambda: True)


def test_a_pipelined_worker_blocked_for_rows_serves_the_orders_behind_its_reply(monkeypatch):
    """With --pipeline 1 the reply to the push in flight can reach a worker that waits for
    rows (to compute its next batch). It used to read nothing then, so send orders queued
    behind the reply went unserved: two re-sourced workers waiting for each other's rows
    stalled until one was declared lost (3 of 4 runs of quality.py's case (d) pipelined)."""
    from mpilb.mpi import wire
    from mpilb.worker import loop as W
    from mpilb.worker import replies as R
    from mpilb.worker.assignments import Assignments

    reply = wire.new_header()
    wire.encode_reply(reply, wire.Cmd.PARAMS, version=7, batch=32, assigns=[(0, 5, 0, 64, -1, 0)])
    orders = wire.new_header()
    wire.encode_orders(orders, [(0, 3, 0, 100, 2, TAG_SHARD_BASE + 3)])
    served = []
    messages = [FakeMessage(reply), FakeMessage(orders)]
    rows = SimpleNamespace(progress=lambda: None, serve=lambda orders: served.extend(orders))
    comm = SimpleNamespace(improbe=lambda source, tag: messages.pop(0) if messages else None)
    r = _replies(comm=comm, rows=rows, pipelined=True)
    assert r.params is r.spare.payload
    r.read_while_blocked()                 # the reply: kept for receive
    assert served == [] and r.early_reply is not None
    r.read_while_blocked()                 # the orders behind it: served now
    assert [(o.shard, o.dst) for o in served] == [(3, 2)]

    # the worker's wait then takes the kept reply without receiving it again
    assigned = []
    monkeypatch.setattr(R, "C", SimpleNamespace(Request=SimpleNamespace(Testall=lambda reqs: True),
                                                complete=lambda req, on_poll=None: None))
    comm.improbe = lambda source, tag: pytest.fail("received twice")
    w = object.__new__(W.Worker)
    w.replies, w.times, w.pushes = r, W.TimeSincePush(), SimpleNamespace(settle=lambda: None)
    feed = SimpleNamespace(assign=lambda *a: assigned.append(a), drop=lambda: None)
    w.assignments = Assignments(feed, rows, None)
    r.pulls = ["a pull"]
    before = r.recv
    w._wait_reply(counts_as_idle=False)
    assert w.version == 7 and w.batch == 32 and assigned == [(0, 5, 0, 64, None)]
    assert r.early_reply is None and r.params is before.payload   # the buffers swapped

    # a second reply while blocked cannot be (one push in flight at most)
    comm.improbe = lambda source, tag: FakeMessage(reply)
    r.read_while_blocked()
    with pytest.raises(RuntimeError, match="while waiting for shard rows"):
        r.read_while_blocked()


def test_the_gradients_scaling_and_check_count_as_compute(monkeypatch):
    """The mean division and the finiteness check of a pushed gradient are the worker's
    compute: they used to fall in no bucket of its timings (~2 % of a run)."""
    from mpilb.mpi import wire, wire_format
    from mpilb.worker import loop as W

    ticks = {"t": 0.0}

    def perf_counter():
        ticks["t"] += 1e-3
        return ticks["t"]

    monkeypatch.setattr(W.time, "perf_counter", perf_counter)
    w = object.__new__(W.Worker)
    w.n, w.version = 4, 3
    w.messages = SimpleNamespace(device_payload=True)
    w.wire = wire_format.Float32()
    w.injector = SimpleNamespace(fault=lambda now: None)
    w.rows = SimpleNamespace(progress=lambda: None)
    w.signals_sent, w.preempt_reqs = set(), []
    w.rank0 = Rank0Watch(60.0, 1)
    w.cfg = config_stub(mode="async", clip_norm=None)
    w.model = SimpleNamespace(num_state=0)
    w.backend = SimpleNamespace(xp=np, synchronize=lambda: None)
    w.replies = SimpleNamespace(params=np.zeros(4, np.float32))
    w.step_fn = lambda params, batch, out: (2.0, np.ones(4, np.float32), 0.0)   # model: 0 s
    done = w._compute(SimpleNamespace(size=2), wire.MessageBuffer(None, None, np.zeros(4, np.float32)))
    assert done.compute_s >= 1e-3 and not done.nonfinite


def test_a_push_goes_to_each_store_by_name(monkeypatch):
    """A push is [header | slice 0] to rank 0 and each other slice to its store, from the
    named parts of the message buffer; the step counts pushes."""
    from mpilb.mpi import wire
    from mpilb.worker import pushes as P
    from mpilb.worker.pushes import Computed, Pushes

    monkeypatch.setattr(P, "C", SimpleNamespace(Request=SimpleNamespace(Testall=lambda reqs: False),
                                                complete=lambda req, on_poll=None: None))
    sent, rung = [], []
    comm = SimpleNamespace(Isend=lambda buf, dest, tag: sent.append((buf.nbytes, dest, tag))
                           or SimpleNamespace(Test=lambda: True))
    pushes = Pushes(comm, DeviceMessages(SimpleNamespace(name="cpu"), False), 6, 0, [0, 2],
                    [0, 4, 6], SimpleNamespace(ring=rung.append), pipelined=True)
    assert len(pushes.bufs) == 2 and all(isinstance(m, wire.MessageBuffer) for m in pushes.bufs)
    msg = pushes.bufs[0]
    batch = SimpleNamespace(epoch=0, shard=1, lo=0, hi=8, size=8)
    took = pushes.send(msg, Computed(batch, 1.0, 0.1, False, 3), None, t=2.0,
                       timings=dict(io_s=0.0, comm_s=0.0, idle_s=0.0))
    assert took >= 0 and pushes.step == 1 and rung == [0]
    assert sent == [(2 * 4, 2, wire.TAG_GRAD), (wire.HEADER_BYTES + 4 * 4, 0, wire.TAG_PUSH)]
    assert wire.decode_push(msg.header).hi == 8


def test_the_watch_on_rank_0_counts_only_waiting_time():
    """A rank that waits for rank 0 gives up after --worker-timeout + max(10 s, itself) of
    silence; its own compute is no silence of rank 0, and any message restarts the count."""
    clock = {"t": 100.0}
    watch = Rank0Watch(5.0, 3, clock=lambda: clock["t"])
    assert watch.limit == limit(5.0) == 15.0 and limit(60.0) == 120.0
    clock["t"] += 14.0
    assert not watch.expired()
    watch.heard()                      # a keep-alive
    clock["t"] += 14.0
    assert not watch.expired()
    clock["t"] += 2.0
    assert watch.expired()
    watch.waiting()                    # its own step just ended: the silence starts now
    assert not watch.expired() and watch.silent_for() == 0.0
    clock["t"] += 15.5
    assert watch.expired()
