"""The server's pure parts without MPI: the task ledger, the update rules, peer states, sit-out.

Fake workers are plain :class:`Peer` objects (no link); the balancer is the real one.
"""

import numpy as np
import pytest

from mpilb.core.balancer import BalancerConfig, build_balancer
from mpilb.core.corrections import build_correction
from mpilb.errors import UsageError
from mpilb.core.optimizers import build_optimizer
from mpilb.server.modes import RULES, ParamRing, Update, build_rule
from mpilb.server.peers import Membership, Peer, Waiting
from mpilb.core.sitout import PROBE_S, SitOut
from mpilb.core.holdings import Task
from mpilb.core.tasks import COMMITTED, TaskLedger
from mpilb.mpi.wire import OrderMsg, TaskMsg


def ledger_for(sizes, ranks=(1, 2), policy="static", holders=None, **kw):
    bal = build_balancer(policy, list(ranks), sizes, BalancerConfig(batch=32), holders)
    bal.plan_epoch(0, list(range(len(sizes))))
    return TaskLedger(bal, sizes, ranks, holders=holders, **kw), bal


def spans(ledger, rank):
    return [(t.shard, t.pos, t.end) for t in ledger.tasks(rank)]


# ---------------------------------------------------------------- task ledger
def test_top_up_hands_out_committed_shards_and_the_reply_carries_them():
    ledger, bal = ledger_for([100] * 4)
    ledger.top_up(1, 32)
    assert len(ledger.tasks(1)) == COMMITTED == 2
    assert [e.event for e in ledger.take_events()] == ["assign", "assign"]
    assigns, orders, cut = ledger.take_reply(1, 32)
    assert assigns == [TaskMsg(0, s, 0, 100, -1, 0) for s in bal.queued(1) or [0, 1]][:2]
    assert orders == [] and cut is None and ledger.of[1].batch_sent == 32
    assert ledger.take_reply(1, 32)[0] == []   # told once
    # done with the first: the next reply carries nothing new (its queue is empty)
    assert not ledger.advance(1, 50) and ledger.advance(1, 100)
    assert [e.event for e in ledger.take_events()] == ["start", "done"]
    ledger.top_up(1, 32)
    assert len(ledger.tasks(1)) == 1


def test_part_way_move_cuts_so_both_finish_together():
    ledger, bal = ledger_for([1000, 100])
    for r in (1, 2):
        ledger.top_up(r, 32)
        ledger.take_reply(r, 32)
    ledger.take_events()
    assert ledger.advance(2, 100)   # rank 2 is done with its only shard
    ledger.top_up(2, 32)            # nothing queued: it takes the tail of rank 1's shard
    # equal rates: rank 1 may reach 32 (the batch it computes), the rest is split in half
    assert spans(ledger, 1) == [(0, 0, 500)] and spans(ledger, 2) == [(0, 500, 1000)]
    move = [e for e in ledger.take_events() if e.event == "move"]
    assert [(e.shard, e.src, e.dst) for e in move] == [(0, 1, 2)]
    assert ledger.take_reply(1, 32)[2] == (0, 0, 500)            # the donor learns the cut
    assert ledger.take_reply(2, 32)[0] == [TaskMsg(0, 0, 500, 1000, -1, 0)]


def test_cut_rule_respects_rates_pipelining_and_small_tails():
    ledger, bal = ledger_for([4000, 100], pipeline=True)
    for t in np.arange(0.05, 2.0, 0.05):   # rank 1 three times faster than rank 2
        bal.observe(1, t, 300, 0.05)
        bal.observe(2, t, 100, 0.05)
    assert bal.effective_rate(1) > 2.5 * bal.effective_rate(2)
    for r in (1, 2):
        ledger.top_up(r, 32)
        ledger.take_reply(r, 32)
    ledger.note_next(1, 0, 64)        # pipelined: it computes [32, 64) while its push travels
    ledger.advance(1, 32)
    ledger.advance(2, 100)
    ledger.top_up(2, 32)
    (_, _, cut), = spans(ledger, 1)
    assert cut >= 64 + 32             # past the batch it computes, plus one (core/cuts.first_cut)
    r1, r2 = bal.effective_rate(1), bal.effective_rate(2)
    assert abs((cut - 32) / r1 - (4000 - cut) / r2) < 64 / r2   # they finish together
    # a tail shorter than two of the donor's batches is not worth a move
    ledger2, _ = ledger_for([90, 10])
    for r in (1, 2):
        ledger2.top_up(r, 32)
        ledger2.take_reply(r, 32)
    ledger2.advance(2, 10)
    ledger2.top_up(2, 32)
    assert spans(ledger2, 2) == [] and spans(ledger2, 1) == [(0, 0, 90)]
    # the fixed plans never split
    ledger3, _ = ledger_for([1000, 10], split=False)
    for r in (1, 2):
        ledger3.top_up(r, 32)
    ledger3.advance(2, 10)
    assert ledger3.split_for(2, 32) is None


def test_take_back_requeues_what_is_left_for_the_next_taker():
    ledger, bal = ledger_for([1000, 100])
    for r in (1, 2):
        ledger.top_up(r, 32)
        ledger.take_reply(r, 32)
    ledger.advance(1, 200)
    ledger.take_events()
    bal.remove_worker(1)
    assert ledger.take_back(1, lost=True) == [0]
    assert [(e.shard, e.src, e.event) for e in ledger.take_events()] == [(0, 1, "reassign")]
    assert ledger.pending_ranges == {0: [(200, 1000)]}
    ledger.advance(2, 100)
    ledger.top_up(2, 32)
    assert spans(ledger, 2) == [(0, 200, 1000)]      # only what was not applied
    assert ledger.split_for(1, 32) is None           # a lost worker takes nothing


def test_benched_take_back_forgets_what_it_was_not_told_yet():
    ledger, _ = ledger_for([100] * 4)
    ledger.top_up(1, 32)
    assert ledger.of[1].assigns
    ledger.take_back(1)
    assert ledger.of[1].assigns == [] and not ledger.of[1].owed and 1 not in ledger.gone


def test_local_store_move_orders_the_holder_to_send_rows():
    holders = {0: [1], 1: [2]}
    ledger, _ = ledger_for([100, 100], holders=holders, row_nbytes=256)
    ledger.assign(2, 0, 0, 100)        # rank 2 holds no copy of shard 0
    (order,) = ledger.of[1].orders
    assert order == OrderMsg(0, 0, 0, 100, 2, order.tag) and order.tag >= 1000
    assert ledger.take_ordered() == [1]
    assert ledger.tasks(2)[-1] == Task(0, 0, 0, 100, src=1)
    (event,) = ledger.take_events()
    assert (event.src, event.dst, event.event, event.bytes) == (1, 2, "move", 100 * 256)
    assert not ledger.can_take_back(1) and not ledger.can_take_back(2)   # rows in flight
    assert [(r, t.shard) for r, t in ledger.expects_rows_from(1)] == [(2, 0)]
    assert ledger.take_orders(1) == [order] and not ledger.has_orders(1)


def test_a_worker_waiting_for_rows_is_known_to_wait_on_their_sender():
    """While a worker's current task waits for rows (no push of it yet) the server knows
    whom it waits on: it is sent orders at once (it pushes nothing a reply could carry
    them on) and is not judged silent before that sender."""
    holders = {0: [1], 1: [2], 2: [3]}
    ledger, _ = ledger_for([100, 100, 100], ranks=(1, 2, 3), holders=holders)
    ledger.assign(3, 0, 0, 100)                    # rows from rank 1
    ledger.assign(3, 2, 0, 100)                    # its own copy, after that
    assert ledger.awaits_rows(3) == 1 and ledger.awaits_rows(1) is None
    assert not ledger.advance(3, 32)               # the rows came: it computes
    assert ledger.awaits_rows(3) is None


def test_a_push_counts_only_as_the_next_part_of_its_task():
    ledger, _ = ledger_for([100, 100])
    ledger.top_up(1, 32)
    assert ledger.matches(1, 0, 0, 0, 32) and ledger.matches(1, 0, 0)
    assert not ledger.matches(1, 0, 1, 0, 32)            # another shard
    ledger.tasks(1)[0].end = 50                           # cut: the rest went elsewhere
    assert not ledger.advance(1, 32)
    assert not ledger.matches(1, 0, 0, 0, 32)             # done already: never twice
    assert not ledger.matches(1, 0, 0, 32, 64)            # past the cut: never applied
    assert ledger.matches(1, 0, 0, 32, 50)


def test_a_failed_probe_leaves_the_global_batch_to_the_others():
    """Benched again after a probe, the others share the global batch at once (they were
    sized while the prober was in; the rounds must not shrink until the next rebalance)."""
    sizes = [1000, 1000, 1000]
    cfg = BalancerConfig(batch=32, batch_policy="proportional", sit_out=True, min_batch=4)
    bal = build_balancer("load", [1, 2, 3], sizes, cfg, None)
    bal.plan_epoch(0, [0, 1, 2])
    ledger = TaskLedger(bal, sizes, (1, 2, 3))
    sit = SitOut(bal, ledger, batch=32, min_batch=4, max_batch=4096, rebalance_interval=0.1)
    peers = [Peer(r, batch=b) for r, b in ((1, 40), (2, 40), (3, 16))]   # 3 was probing
    assert sit.bench(peers[2], peers, now=20.0)
    assert peers[2].batch == 0 and peers[0].batch + peers[1].batch == 3 * 32


# ---------------------------------------------------------------- update rules
def store(n=4, batch=32, correction="none"):
    return ParamRing(np.zeros(n, np.float32), build_optimizer("sgd", n, lr=0.5),
                      build_correction(correction), batch)


def busy(rank, **fields):
    """A worker with work in hand (a new Peer starts idle, as at the start of a run)."""
    p = Peer(rank, **fields)
    p.wake()
    return p


def update(rank, batch=32, staleness=0):
    return Update(rank, 0, 0, 0, batch, batch, 1.0, staleness)


def test_registry_and_unknown_mode():
    assert set(RULES) == {"async", "ssp", "sync"}
    with pytest.raises(UsageError, match="--mode"):
        build_rule("bsp", store(), lambda r: True)


def test_async_applies_each_gradient_scaled_by_its_batch():
    rule = build_rule("async", store(), lambda r: True)
    p = Peer(1)
    (applied, lr_scale) = rule.push(p, update(1, batch=16), np.ones(4, np.float32))
    assert lr_scale == 0.5 and rule.ring.version == 1
    assert np.allclose(rule.ring.params, -0.25)
    assert not rule.holds(p, [p]) and list(rule.releasable([p])) == []


class _Pending:
    """A send that never completes: the buffer it reads stays busy."""

    def Test(self):
        return False


def test_a_step_into_another_buffer_counts_the_next_version():
    # a reply still reads the current buffer: the step writes another one, which must
    # hold version + 1 (not that buffer's own old number + 1), whole or in chunks
    ring = store(n=8)
    ring.finished = lambda req: req.Test()
    for k in range(1, 5):
        ring.sending(_Pending())
        if k % 2:
            ring.apply(np.ones(8, np.float32), 32, 0)
        else:
            ring.apply_chunks(np.ones(8, np.float32), 32, 0, [(0, 4), (4, 8)],
                              lambda i: None, lambda i, new: [])
        assert ring.version == k and len(ring.ring) == k + 1
        assert ring.params_of(k) is ring.params and ring.params_of(k - 1) is not None


def test_inverse_correction_scales_by_staleness():
    rule = build_rule("async", store(correction="inverse"), lambda r: True)
    _, lr_scale = rule.push(Peer(1), update(1, staleness=4), np.ones(4, np.float32))
    assert lr_scale == pytest.approx(0.25)


def test_ssp_holds_the_fastest_and_releases_it_when_the_slowest_catches_up():
    working = {1: True, 2: True, 3: True}
    rule = build_rule("ssp", store(), lambda r: working[r], staleness_bound=2)
    p1, p2, p3 = busy(1, step=5), busy(2, step=2), busy(3, step=4)
    peers = [p1, p2, p3]
    assert rule.holds(p1, peers) and not rule.holds(p3, peers)
    p1.hold(10.0)
    assert list(rule.releasable(peers)) == []
    p2.step = 3
    assert list(rule.releasable(peers)) == [p1]
    # an idle worker, or one with no work, does not hold the others back
    p2.step = 0
    p2.go_idle()
    assert list(rule.releasable(peers)) == [p1]
    p2.wake()
    working[2] = False
    assert list(rule.releasable(peers)) == [p1]


def test_sync_round_weights_by_batch_and_applies_once():
    rule = build_rule("sync", store(), lambda r: True)
    p1, p2 = busy(1), busy(2)
    peers = [p1, p2]
    g1, g2 = np.full(4, 1.0, np.float32), np.full(4, 3.0, np.float32)   # mean gradients
    assert rule.push(p1, update(1, batch=10), g1) is None
    assert not rule.round_complete(peers) and rule.ring.version == 0
    assert rule.push(p2, update(2, batch=30), g2) is None
    assert rule.round_complete(peers)
    updates, lr_scale, members = rule.close_round()
    assert members == [1, 2] and [u.rank for u in updates] == [1, 2]
    assert lr_scale == pytest.approx(40 / 32) and rule.ring.version == 1
    mean = (10 * 1.0 + 30 * 3.0) / 40
    assert np.allclose(rule.ring.params, -0.5 * lr_scale * mean)
    assert not rule.round_complete(peers) and rule.batch == 0 and not rule.grad.any()


def test_sync_a_lost_member_completes_the_round_and_idle_ones_do_not_count():
    rule = build_rule("sync", store(), lambda r: True)
    p1, p2, p3, p4 = busy(1), busy(2), busy(3), busy(4)
    p4.go_idle()
    rule.push(p1, update(1), np.ones(4, np.float32))
    rule.push(p2, update(2), np.ones(4, np.float32))
    peers = [p1, p2, p3, p4]
    assert not rule.round_complete(peers)
    p3.lose()
    assert rule.round_complete([p for p in peers if p.present])


# ---------------------------------------------------------------- peers
def test_peer_state_changes_only_through_named_transitions():
    p = Peer(3, batch=32)
    assert (p.waiting, p.membership) == (Waiting.IDLE, Membership.ACTIVE) and p.idle
    p.wake()
    p.hold(1.0)
    assert p.held and p.waits_for_message
    assert p.release(3.5) == 2.5 and p.waiting is Waiting.COMPUTING
    assert p.release(4.0) == 0.0
    p.bench(5.0)
    assert p.benched and p.present and p.batch == 0 and p.drop
    p.unbench(16)
    assert p.membership is Membership.ACTIVE and p.probing == 2 and p.batch == 16
    p.lose()
    assert p.lost and not p.present
    p.samples, p.compute_s = 10, 1.5
    assert p.take_row()["samples"] == 10 and p.samples == 0 and p.compute_s == 0.0


# ---------------------------------------------------------------- sit-out
def test_sitout_benches_hands_back_and_probes_again():
    ledger, bal = ledger_for([1000, 1000, 1000], ranks=(1, 2, 3))
    for r in (1, 2, 3):
        ledger.top_up(r, 32)
        ledger.take_reply(r, 32)
    ledger.advance(3, 100)
    sit = SitOut(bal, ledger, batch=32, min_batch=4, max_batch=64, rebalance_interval=0.1)
    peers = [Peer(r, batch=32) for r in (1, 2, 3)]
    assert sit.bench(peers[2], peers, now=10.0)
    assert peers[2].benched and 3 in bal.benched and not ledger.tasks(3)
    assert ledger.pending_ranges == {2: [(100, 1000)]}
    sit.start_probes(peers, now=10.0 + PROBE_S / 2)
    assert peers[2].benched                       # not yet
    sit.start_probes(peers, now=10.0 + PROBE_S)
    assert not peers[2].benched and peers[2].batch == sit.probe_batch() == 16
    # the last worker in the rounds is never benched
    solo = [Peer(1)]
    assert not sit.bench(solo[0], solo, now=0.0)


def test_a_shard_with_no_copy_left_says_what_became_of_its_copies():
    """With --replicas 2 the advice "use --replicas 2 or more" was untrue: the line says
    that all its copies were on lost ranks; with one copy the advice stays."""
    holders = {0: [1, 2], 1: [2, 3], 2: [3]}
    ledger, _ = ledger_for([10, 10, 10], ranks=(1, 2, 3), policy="static", holders=holders)
    ledger.gone |= {1, 2}
    with pytest.raises(RuntimeError) as two:
        ledger.holder_for(0, 5)
    assert str(two.value) == ("shard 0: all 2 of its copies (--replicas 2) were on ranks that "
                              "were lost: 1, 2")
    ledger.gone = {3}
    with pytest.raises(RuntimeError, match=r"shard 2: its only copy was on rank 3, which was "
                                           r"lost \(use --replicas 2 or more"):
        ledger.holder_for(2, 5)
