"""Balancer policies: plans, moves, steals, batches, state, and a coverage property."""

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mpilb.core.balancer import BALANCERS, BalancerConfig, Move, build_balancer
from mpilb.errors import UsageError

WORKERS = [1, 2, 3]


def _bal(name, sizes=None, workers=WORKERS, **cfg):
    sizes = sizes if sizes is not None else [100] * 10
    return build_balancer(name, list(workers), sizes, BalancerConfig(**cfg))


def _teach(bal, rates, reports=10, t=1.0):
    for _ in range(reports):
        for w, r in rates.items():
            bal.observe(w, t, int(r * 10), 10.0)


def test_registry_and_unknown_name():
    assert set(BALANCERS) == {"static", "round-robin", "demand", "load", "predictive"}
    with pytest.raises(UsageError, match="unknown balancer 'fastest'.*static.*predictive"):
        build_balancer("fastest", WORKERS, [1], BalancerConfig())
    with pytest.raises(UsageError, match="unknown batch policy 'huge'"):
        build_balancer("load", WORKERS, [1], BalancerConfig(batch_policy="huge"))


def test_static_contiguous_split():
    order = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    plan = _bal("static").plan_epoch(0, order)
    assert plan == {1: [9, 8, 7, 6], 2: [5, 4, 3], 3: [2, 1, 0]}


def test_round_robin_deals_in_turn():
    bal = _bal("round-robin")
    plan = bal.plan_epoch(0, [9, 8, 7, 6, 5, 4, 3, 2, 1, 0])
    assert plan == {1: [9, 6, 3, 0], 2: [8, 5, 2], 3: [7, 4, 1]}
    assert [bal.next_shard(2) for _ in range(4)] == [8, 5, 2, None]
    assert bal.rebalance(1.0, {}) == [] and bal.take_moves() == []


def test_demand_central_queue_in_order():
    bal = _bal("demand", sizes=[10] * 5)
    plan = bal.plan_epoch(0, [3, 1, 4, 0, 2])
    assert plan == {1: [], 2: [], 3: []} and bal.queued(1) == []
    assert [bal.next_shard(w) for w in (2, 2, 1, 3)] == [3, 1, 4, 0]
    bal.requeue([1])
    assert bal.next_shard(3) == 1          # requeued work goes first
    assert bal.next_shard(1) == 2 and bal.next_shard(2) is None


def test_load_plan_follows_rates():
    bal = _bal("load", sizes=[100] * 90)
    _teach(bal, {1: 100.0, 2: 100.0, 3: 25.0})
    plan = bal.plan_epoch(0, list(range(90)))
    slow_share = len(plan[3]) / 90
    assert abs(slow_share - 1 / 9) < 0.02
    assert sorted(sum(plan.values(), [])) == list(range(90))


def test_load_plan_equal_without_rates():
    plan = _bal("load", sizes=[100] * 9).plan_epoch(0, list(range(9)))
    assert [len(q) for q in plan.values()] == [3, 3, 3]


def test_no_moves_when_rates_are_equal():
    bal = _bal("load", sizes=[100] * 30)
    _teach(bal, {1: 100.0, 2: 98.0, 3: 102.0})
    bal.plan_epoch(0, list(range(30)))
    assert bal.rebalance(2.0, {1: 150, 2: 120, 3: 180}) == []
    assert bal.take_moves() == []


@pytest.mark.parametrize("hysteresis, moved", [(0.05, False), (0.0, True)])
def test_small_gains_are_undone_by_hysteresis(hysteresis, moved):
    bal = _bal("load", sizes=[100] * 30, hysteresis=hysteresis)
    plan = bal.plan_epoch(0, list(range(30)))               # 10 each, before any rate
    _teach(bal, {1: 100.0, 2: 100.0, 3: 90.0})              # rank 3 ends ~1% late
    moves = bal.rebalance(1.0, {1: 0, 2: 0, 3: 0})
    assert bool(moves) == moved
    if not moved:
        assert {w: bal.queued(w) for w in WORKERS} == plan


def test_moves_when_a_worker_slows_mid_epoch():
    bal = _bal("load", sizes=[100] * 30)
    _teach(bal, {1: 100.0, 2: 100.0, 3: 100.0})
    plan = bal.plan_epoch(0, list(range(30)))
    _teach(bal, {3: 25.0}, reports=5, t=3.0)            # rank 3 becomes 4x slower
    moves = bal.rebalance(3.0, {1: 100, 2: 100, 3: 100})
    assert moves and all(m.src == 3 and m.dst in (1, 2) and m.reason == "rebalance" for m in moves)
    assert all(m.shard in plan[3] for m in moves)
    assert bal.take_moves() == moves and bal.take_moves() == []
    # Balanced afterwards: rank 3 keeps about a ninth of what is left.
    left = {w: len(bal.queued(w)) for w in WORKERS}
    assert left[3] <= 3 and sum(left.values()) == 30


def test_steal_on_empty_queue():
    bal = _bal("load", sizes=[100] * 12)
    plan = bal.plan_epoch(0, list(range(12)))
    for _ in range(len(plan[1])):
        bal.next_shard(1)
        bal.observe(1, 1.0, 100, 1.0)      # done with it: it holds nothing when it asks
    stolen = bal.next_shard(1)
    assert stolen in (plan[2][-1], plan[3][-1])
    (move,) = bal.take_moves()
    assert move == Move(stolen, move.src, 1, "steal") and move.src in (2, 3)
    # Nothing to gain from stealing a victim's only shard when it is almost done.
    small = _bal("load", sizes=[100] * 4)
    small.plan_epoch(0, [0, 1, 2, 3])
    small.next_shard(1), small.next_shard(1)
    small.rebalance(1.0, {1: 100, 2: 0, 3: 0})
    assert small.queued(2) == [1] and small.next_shard(1) is None


def test_remove_worker_and_requeue():
    bal = _bal("static", sizes=[100] * 9)
    plan = bal.plan_epoch(0, list(range(9)))
    first = bal.next_shard(2)
    moves = bal.remove_worker(2)
    assert [m.shard for m in moves] == plan[2][1:]
    assert all(m.src == 2 and m.dst in (1, 3) and m.reason == "lost" for m in moves)
    bal.requeue([first])
    assert bal.next_shard(2) is None
    left = sorted(bal.queued(1) + bal.queued(3))
    assert left == sorted(set(range(9)))


def test_fixed_batches():
    bal = _bal("load", batch=16)
    _teach(bal, {1: 100.0, 2: 10.0, 3: 50.0})
    assert bal.batch_sizes() == {1: 16, 2: 16, 3: 16}


def test_proportional_batches_sum_and_clamp():
    bal = _bal("load", batch=32, batch_policy="proportional")
    assert bal.batch_sizes() == {1: 32, 2: 32, 3: 32}          # no rates yet
    _teach(bal, {1: 100.0, 2: 50.0, 3: 50.0})
    sizes = bal.batch_sizes()
    assert sum(sizes.values()) == 96 and sizes == {1: 48, 2: 24, 3: 24}
    clamped = _bal("load", batch=32, batch_policy="proportional", min_batch=8, max_batch=40)
    _teach(clamped, {1: 1000.0, 2: 10.0, 3: 100.0})
    sizes = clamped.batch_sizes()
    assert sizes == {1: 40, 2: 16, 3: 40}          # 2 is raised off the floor to keep 96
    _teach(clamped, {2: 0.01}, reports=30)
    assert clamped.batch_sizes()[2] >= 8
    uneven = _bal("load", batch=10, batch_policy="proportional")
    _teach(uneven, {1: 100.0, 2: 100.0, 3: 100.0 / 3})
    assert sum(uneven.batch_sizes().values()) == 30


@pytest.mark.parametrize("name", sorted(BALANCERS))
def test_state_dict_round_trip(name):
    bal = _bal(name, sizes=[100] * 12)
    _teach(bal, {1: 100.0, 2: 50.0, 3: 20.0})
    bal.plan_epoch(3, list(range(12)))
    bal.next_shard(1)
    bal.rebalance(5.0, {1: 100, 2: 0, 3: 0})
    state = json.loads(json.dumps(bal.state_dict()))
    copy = build_balancer(name, WORKERS, [100] * 12, BalancerConfig())
    copy.load_state_dict(state)
    assert copy.state_dict() == bal.state_dict()
    assert [copy.next_shard(w) for w in (1, 2, 3, 3)] == [bal.next_shard(w) for w in (1, 2, 3, 3)]
    assert copy.rate(3) == bal.rate(3) and copy.batch_sizes() == bal.batch_sizes()


def test_rate_before_reports():
    bal = _bal("load")
    assert bal.rate(1) == 1.0
    _teach(bal, {1: 30.0, 2: 10.0})
    assert bal.rate(3) == pytest.approx(20.0) and bal.predicted_rate(3) == pytest.approx(20.0)


ops = st.lists(st.tuples(st.sampled_from(["next", "next", "next", "done", "observe",
                                          "rebalance", "remove"]),
                         st.integers(1, 4), st.floats(0.5, 200.0)), max_size=80)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(BALANCERS)),
       sizes=st.lists(st.integers(1, 300), min_size=1, max_size=30),
       hysteresis=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
       seed=st.randoms(use_true_random=False), script=ops)
def test_every_shard_done_exactly_once(name, sizes, hysteresis, seed, script):
    workers = [1, 2, 3, 4]
    config = BalancerConfig(rebalance_interval=1.0, hysteresis=hysteresis)
    bal = build_balancer(name, workers, sizes, config)
    order = list(range(len(sizes)))
    seed.shuffle(order)
    bal.plan_epoch(0, order)
    held = {w: [] for w in workers}     # committed shards, oldest first
    done = Counter()
    t = 0.0

    def fetch(w):
        shard = bal.next_shard(w)
        if shard is not None:
            assert all(shard not in h for h in held.values()), "handed out twice"
            held[w].append(shard)
        return shard

    for op, w, x in script:
        t += 0.25
        alive = [v for v in workers if v in bal.workers]
        if w not in alive:
            continue
        if op == "next" and len(held[w]) < 2:
            fetch(w)
        elif op == "done" and held[w]:
            done[held[w].pop(0)] += 1
        elif op == "observe":
            bal.observe(w, t, int(x) + 1, 1.0)
        elif op == "rebalance":
            bal.rebalance(t, {v: sum(sizes[s] for s in held[v]) for v in alive})
        elif op == "remove" and len(alive) > 1:
            bal.remove_worker(w)
            bal.requeue(held.pop(w))
            held[w] = []
    # Drain: live workers finish what they hold, report it (as every push does in the
    # server) and ask until nothing is left.
    for _ in range(4 * len(sizes) + 8):
        for v in list(bal.workers):
            if held[v]:
                t += 0.25
                bal.observe(v, t, sum(sizes[s] for s in held[v]), 1.0)
            done.update(held[v])
            held[v] = []
            fetch(v)
    for v in bal.workers:
        done.update(held[v])
    assert done == Counter(range(len(sizes)))
    assert all(not bal.queued(v) for v in bal.workers)
    for move in bal.take_moves():
        assert move.reason in ("rebalance", "steal", "lost", "probe") and move.src != move.dst


def _teach_times(bal, busy, gap, reports=50, t=0.0):
    """Reports of 100 samples: ``busy[w]`` seconds of compute, one every ``gap[w]`` seconds."""
    for k in range(1, reports + 1):
        for w in busy:
            bal.observe(w, t + k * gap[w], 100, busy[w])


def test_plan_counts_communication_overhead():
    # Same compute speed, but rank 3 spends 3 ms more per step outside compute.
    bal = _bal("load", sizes=[100] * 60)
    _teach_times(bal, busy={1: 1e-3, 2: 1e-3, 3: 1e-3}, gap={1: 2e-3, 2: 2e-3, 3: 5e-3})
    assert bal.rate(3) == pytest.approx(bal.rate(1))
    assert bal.overhead(3) == pytest.approx(4e-5, rel=0.05)
    plan = bal.plan_epoch(0, list(range(60)))
    assert len(plan[3]) == pytest.approx(60 * 0.2 / 1.2, abs=1)     # rates 1/2 : 1/2 : 1/5
    assert bal.effective_rate(1) == pytest.approx(5e4, rel=0.05)     # 100 samples per 2 ms
    assert bal.effective_rate(3) == pytest.approx(2e4, rel=0.05)     # 100 samples per 5 ms


def test_slow_worker_holding_work_is_not_given_the_last_shard():
    bal = _bal("load", sizes=[100] * 9)
    plan = bal.plan_epoch(0, list(range(9)))          # 3 each, before any rate
    _teach(bal, {1: 100.0, 2: 100.0, 3: 25.0})
    assert bal.next_shard(3) == plan[3][0]            # holding nothing: always served
    # Holding 4 s of work, rank 3 would end a second shard at 8 s; rank 1 or 2, after
    # their own three, at 4 s. The shard stays queued (to be stolen) rather than committed.
    assert bal.next_shard(3) is None
    assert bal.queued(3) == plan[3][1:]
    bal.observe(3, 5.0, 100, 4.0)                     # its shard is done
    assert bal.next_shard(3) == plan[3][1]            # with nothing left it gets it after all
    # A fast worker asking for a prefetch gets it: nobody would end it sooner.
    assert bal.next_shard(1) == plan[1][0] and bal.next_shard(1) == plan[1][1]


def test_committed_count_follows_hand_outs_and_reports():
    bal = _bal("load", sizes=[100] * 9)
    _teach(bal, {1: 100.0, 2: 100.0, 3: 100.0})    # (without a rate, one shard at a time)
    bal.plan_epoch(0, list(range(9)))
    bal.next_shard(1), bal.next_shard(1)
    bal.observe(1, 1.0, 30, 0.1)
    assert bal._committed[1] == 170
    bal.rebalance(2.0, {1: 120, 2: 0, 3: 0})       # the server's count wins
    assert bal._committed[1] == 120
    shard = bal.next_shard(2)
    bal.remove_worker(2)
    bal.requeue([shard])                           # maybe half done: counts as nothing
    taker = 1 if shard in bal.queued(1) else 3
    before = bal._committed[taker]
    while bal.queued(taker)[0] != shard:
        bal._queues[taker].pop(0)
    assert bal.next_shard(taker) == shard and bal._committed[taker] == before
    resumed = bal.next_shard(3)
    bal.discount(3, 60)                            # started at sample 60 (a resumed remainder)
    assert bal._committed[3] == 40 and resumed is not None


def test_the_logged_rate_counts_communication():
    """A worker behind a slow link computes as fast as the others but waits for its
    replies: its measured (logged) rate says so, its compute rate does not."""
    bal = _bal("load", sizes=[100] * 60)
    for k in range(1, 51):
        for w, comm in ((1, 0.0), (2, 0.0), (3, 0.03)):   # 100 samples in 10 ms; rank 3 +30 ms
            bal.observe(w, k * 0.04, 100, 0.01, comm_s=comm)
    assert bal.rate(3) == pytest.approx(bal.rate(1), rel=0.01)       # compute + I/O alike
    assert bal.measured_rate(1) == pytest.approx(bal.rate(1), rel=0.01)
    assert bal.measured_rate(3) == pytest.approx(bal.rate(3) / 4, rel=0.05)   # 10 ms of 40
