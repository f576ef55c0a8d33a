"""The wire protocol (mpilb.mpi.wire): slot numbers, byte-identical encoding, round trips.

The reference encoders below are the hand-written header code that the server, the worker
and the benchmark used before wire.py existed; the encoding must not change under a running
job's feet (a worker and a server of different versions must still agree).
"""

import numpy as np
import pytest

from mpilb.mpi import wire
from mpilb.mpi.wire import Cmd, Push, Reply


def test_slots_tags_and_sizes_are_pinned():
    assert wire.HEADER_FIELDS == 48 and wire.HEADER_BYTES == 384
    assert (wire.TAG_PUSH, wire.TAG_REPLY, wire.TAG_ERROR, wire.TAG_PREEMPT) == (11, 12, 13, 15)
    assert (wire.TAG_SHARD_BASE, wire.SHARD_TAGS) == (1000, 10000)
    assert [int(p) for p in Push] == list(range(21))
    assert [p.name for p in Push] == ["KIND", "STEP", "VERSION", "EPOCH", "SHARD", "LO", "HI", "BATCH",
                                      "LOSS", "COMPUTE_S", "IO_S", "COMM_S", "IDLE_S", "NEXT_SHARD",
                                      "NEXT_LO", "NEXT_HI", "NEXT_EPOCH", "NONFINITE", "T", "PRED_F",
                                      "PRED_FROM"]
    assert {r.name: int(r) for r in Reply} == {
        "CMD": 0, "VERSION": 1, "BATCH": 2, "HELD_S": 3, "RETRY": 4, "N_ASSIGN": 5, "ASSIGN": 6,
        "N_ORDER": 18, "ORDER": 19, "CUT_EPOCH": 31, "CUT_SHARD": 32, "CUT_END": 33, "DROP": 34,
        "HAS_CUT": 35, "STREAMED": 36}
    assert (int(Cmd.PARAMS), int(Cmd.STOP), int(Cmd.ORDERS)) == (1, 2, 3)
    assert (wire.TASK_FIELDS, wire.MAX_ASSIGN, wire.MAX_ORDER) == (6, 2, 2)
    # the task and order rows fit between their count and the next field
    assert Reply.ASSIGN + wire.TASK_FIELDS * wire.MAX_ASSIGN <= Reply.N_ORDER
    assert Reply.ORDER + wire.TASK_FIELDS * wire.MAX_ORDER <= Reply.CUT_EPOCH
    assert Reply.STREAMED < wire.HEADER_FIELDS


def test_message_views_share_one_buffer():
    buf, hdr, payload = wire.new_message(5)
    assert buf.nbytes == 384 + 20 and hdr.dtype == np.float64 and payload.dtype == np.float32
    hdr[Push.BATCH] = 7
    payload[:] = 1.5
    assert np.frombuffer(buf[:384].tobytes(), np.float64)[7] == 7
    assert np.all(np.frombuffer(buf[384:].tobytes(), np.float32) == 1.5)


# ---------------------------------------------------------------- reference encoders
def old_push(hdr, step, version, epoch, shard, lo, hi, batch, loss, compute_s, io_s, comm_s, idle_s,
             nonfinite, t, next_range):
    hdr[:] = 0
    hdr[0] = 1               # KIND = GRAD
    hdr[1] = step
    hdr[2] = version
    hdr[3] = epoch
    hdr[4] = shard
    hdr[5] = lo
    hdr[6] = hi
    hdr[7] = batch
    hdr[8] = loss
    hdr[9] = compute_s
    hdr[10] = io_s
    hdr[11] = comm_s
    hdr[12] = idle_s
    hdr[17] = 1 if nonfinite else 0
    hdr[13] = -1
    if next_range is not None:
        hdr[16], hdr[13], hdr[14], hdr[15] = next_range
    hdr[18] = t


def old_reply(hdr, cmd, version, batch, held_s, retry, drop, assigns, orders, trunc):
    hdr[:] = 0
    hdr[0] = cmd
    hdr[1] = version
    hdr[2] = batch
    hdr[3] = held_s
    hdr[4] = 1 if retry else 0
    hdr[34] = 1 if drop else 0
    if cmd != 2:
        hdr[5] = len(assigns)
        for i, task in enumerate(assigns):
            hdr[6 + 6 * i: 6 + 6 * (i + 1)] = task
        hdr[18] = len(orders)
        for i, order in enumerate(orders):
            hdr[19 + 6 * i: 19 + 6 * (i + 1)] = order
        if trunc is not None:
            hdr[31], hdr[32], hdr[33] = trunc
            hdr[35] = 1   # (added: a cut at position 0 of shard 0 read as none before)


PUSHES = [
    dict(step=0, version=0, epoch=0, shard=3, lo=0, hi=32, batch=32, loss=71.25, compute_s=0.0125,
         io_s=0.5, comm_s=1e-4, idle_s=0.0, nonfinite=False, t=0.75, next_range=None),
    dict(step=12345, version=99999, epoch=7, shard=11, lo=4064, hi=4096, batch=32, loss=float("nan"),
         compute_s=1.0, io_s=0.0, comm_s=0.25, idle_s=3.5, nonfinite=True, t=1e5,
         next_range=(7, 12, 0, 64)),
]


@pytest.mark.parametrize("fields", PUSHES)
def test_push_encoding_is_byte_identical_and_round_trips(fields):
    new, old = wire.new_header(), wire.new_header()
    new[:] = 9.0   # encoding clears what was there before
    wire.encode_push(new, **fields)
    old_push(old, **fields)
    assert new.tobytes() == old.tobytes()
    msg = wire.decode_push(new)
    for key in ("step", "version", "epoch", "shard", "lo", "hi", "batch", "compute_s", "io_s",
                "comm_s", "idle_s", "nonfinite", "t"):
        assert getattr(msg, key) == fields[key], key
    assert msg.loss == fields["loss"] or (np.isnan(msg.loss) and np.isnan(fields["loss"]))
    assert msg.predicted == (0.0, -1)   # not predicted: the bytes of before
    wire.encode_push(new, **fields, predicted=(0.75, 4))
    assert (new[Push.PRED_F], new[Push.PRED_FROM]) == (0.75, 5)
    assert wire.decode_push(new)[:7] == msg[:7]
    assert wire.decode_push(new).predicted == (0.75, 4)
    if fields["next_range"] is None:
        assert msg.next_shard == -1
    else:
        assert (msg.next_epoch, msg.next_shard, msg.next_lo, msg.next_hi) == fields["next_range"]
    assert isinstance(msg.shard, int) and isinstance(msg.nonfinite, bool)


REPLIES = [
    dict(cmd=Cmd.PARAMS, version=5, batch=32, held_s=0.0, retry=False, drop=False, assigns=[],
         orders=[], trunc=None),
    dict(cmd=Cmd.PARAMS, version=123, batch=17, held_s=0.25, retry=True, drop=True,
         assigns=[(2, 5, 0, 100, -1, 0), (2, 9, 40, 100, 3, 1002)],
         orders=[(2, 4, 10, 20, 1, 1004), (2, 6, 0, 100, 2, 1006)], trunc=(2, 5, 64)),
    dict(cmd=Cmd.STOP, version=7, batch=32, held_s=0.5, retry=False, drop=True,
         assigns=[(0, 1, 0, 10, -1, 0)], orders=[], trunc=(0, 1, 5)),
    # a whole untouched task given away: the cut is at its first position, 0, of shard 0
    dict(cmd=Cmd.PARAMS, version=9, batch=32, held_s=0.0, retry=False, drop=False, assigns=[],
         orders=[(0, 0, 0, 800, 3, 1002)], trunc=(0, 0, 0)),
]


@pytest.mark.parametrize("fields", REPLIES)
def test_reply_encoding_is_byte_identical_and_round_trips(fields):
    new, old = wire.new_header(), wire.new_header()
    new[:] = -3.0
    f = dict(fields)
    wire.encode_reply(new, f.pop("cmd"), cut=f.pop("trunc"), **f)
    old_reply(old, **fields)
    assert new.tobytes() == old.tobytes()
    msg = wire.decode_reply(new)
    assert msg.cmd == fields["cmd"] and isinstance(msg.cmd, Cmd)
    assert (msg.version, msg.batch, msg.held_s, msg.retry, msg.drop) == (
        fields["version"], fields["batch"], fields["held_s"], fields["retry"], fields["drop"])
    if fields["cmd"] == Cmd.STOP:   # a STOP carries no tasks
        assert msg.assigns == [] and msg.orders == [] and msg.cut is None
        return
    assert [tuple(t) for t in msg.assigns] == fields["assigns"]
    assert [tuple(o) for o in msg.orders] == fields["orders"]
    assert (None if msg.cut is None else tuple(msg.cut)) == fields["trunc"]
    if msg.assigns:   # six named fields per task (bench.py once read three)
        assert msg.assigns[1].src == 3 and msg.assigns[1].tag == 1002 and msg.assigns[1].end == 100


def test_orders_message_is_byte_identical_and_decodes():
    orders = [(1, 2, 3, 4, 5, 1010)]
    new, old = wire.new_header(), wire.new_header()
    wire.encode_orders(new, orders)
    old[:] = 0
    old[0] = 3
    old[18] = 1
    old[19:25] = orders[0]
    assert new.tobytes() == old.tobytes()
    assert wire.command(new) == Cmd.ORDERS
    assert [tuple(o) for o in wire.decode_orders(new)] == orders
    assert wire.decode_orders(new)[0].dst == 5


def test_too_many_rows_for_one_header_is_refused():
    hdr = wire.new_header()
    with pytest.raises(ValueError):
        wire.encode_reply(hdr, Cmd.PARAMS, version=0, batch=1, assigns=[(0, 0, 0, 1, -1, 0)] * 3)
    with pytest.raises(ValueError):
        wire.encode_orders(hdr, [(0, 0, 0, 1, 1, 0)] * 3)


def test_store_messages_are_pinned():
    """--servers K: the tags and the CTRL encoding between rank 0, the stores and workers."""
    assert (wire.TAG_PARAMS, wire.TAG_GRAD, wire.TAG_CTRL, wire.TAG_GATHER, wire.TAG_STATS) == (14, 16, 17, 18, 19)
    assert {o.name: int(o) for o in wire.Op} == {
        "APPLY": 1, "ADD": 2, "DISCARD": 3, "ROUND": 4, "REPLY": 5, "LOSE": 6, "GATHER": 7,
        "STATS": 8, "END": 9, "LOAD": 10, "ACCEPT": 11, "STREAM": 12}
    assert [int(c) for c in wire.Ctrl] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert (wire.CTRL_FIELDS, wire.STATS_FIELDS) == (8, 6)
    buf = np.zeros(wire.CTRL_FIELDS)
    wire.encode_ctrl(buf, wire.Op.REPLY, rank=3)
    assert buf.tobytes() == np.array([5, 3, 0, 0, 0, 0, 0, 0], np.float64).tobytes()
    # the schedule's factor rides in slot LR as factor - 1 (no schedule: the bytes above)
    wire.encode_ctrl(buf, wire.Op.APPLY, rank=2, batch=32, staleness=1, version=7, lr=0.25)
    assert buf.tobytes() == np.array([1, 2, 32, 1, 7, -0.75, 0, 0], np.float64).tobytes()
    assert wire.decode_ctrl(buf) == (wire.Op.APPLY, 2, 32, 1, 7, 0.25, (0.0, -1))
    # a push's weight prediction (--correction gap): its factor, and the version it came from + 1
    wire.encode_ctrl(buf, wire.Op.APPLY, rank=2, batch=32, staleness=1, version=7, predicted=(0.5, 3))
    assert buf.tobytes() == np.array([1, 2, 32, 1, 7, 0, 0.5, 4], np.float64).tobytes()
    assert wire.decode_ctrl(buf) == (wire.Op.APPLY, 2, 32, 1, 7, 1.0, (0.5, 3))


def test_message_buffers_are_named_and_still_tuples():
    """Worker and bench read a message's parts by name; the server's positional uses
    (`recv[0]`, `recv[1]`) keep working on the same tuple."""
    msg = wire.new_message(3)
    assert isinstance(msg, wire.MessageBuffer) and isinstance(msg, tuple)
    assert msg[0] is msg.buf and msg[1] is msg.header and msg[2] is msg.payload
    assert msg.buf.nbytes == wire.HEADER_BYTES + 12 and msg.header.size == wire.HEADER_FIELDS
    again = wire.message_of(msg.payload)
    assert isinstance(again, wire.MessageBuffer) and again.buf is msg.buf
