"""Unit tests for the --inject grammar and the Injector (pure, no MPI)."""

import pytest

from mpilb.errors import UsageError
from mpilb.core.inject import Injector, InjectRule, parse_inject, parse_injects


@pytest.mark.parametrize("text, ranks, kind, value", [
    ("3:compute=4", {3}, "compute", 4.0),
    ("1,3:io=2.5", {1, 3}, "io", 2.5),
    ("2-4:readbw=10", {2, 3, 4}, "readbw", 10.0),
    ("1,5-6:delay=0", {1, 5, 6}, "delay", 0.0),
    ("*:hang", None, "hang", None),
    ("2:crash", {2}, "crash", None),
])
def test_kinds_and_rank_sets(text, ranks, kind, value):
    rule = parse_inject(text)
    assert rule.ranks == (None if ranks is None else frozenset(ranks))
    assert (rule.kind, rule.value) == (kind, value)
    assert (rule.start, rule.end, rule.prob, rule.text) == (0.0, None, 1.0, text)


def test_window_and_probability():
    rule = parse_inject("1,3:compute=3@10-30,p=0.5")
    assert rule.ranks == frozenset({1, 3})
    assert (rule.kind, rule.value, rule.start, rule.end, rule.prob) == ("compute", 3.0, 10.0, 30.0, 0.5)
    rule = parse_inject("2:hang@15")
    assert (rule.start, rule.end) == (15.0, None)
    rule = parse_inject("*:compute=2,p=0.05")
    assert rule.ranks is None and rule.prob == 0.05


@pytest.mark.parametrize("text, needle", [
    ("3compute=4", "missing ':'"),
    (":compute=4", "no ranks"),
    ("a:compute=4", "not a rank"),
    ("4-2:compute=4", "backwards"),
    ("3:slow=4", "unknown kind 'slow'"),
    ("3:compute", "compute needs a value"),
    ("3:compute=", "compute needs a value"),
    ("3:compute=0.5", "F >= 1"),
    ("3:io=0.9", "F >= 1"),
    ("3:readbw=0", "MB/s > 0"),
    ("3:delay=-1", "S >= 0"),
    ("3:compute=x", "'x' is not a number"),
    ("3:compute=2@", "empty window"),
    ("3:compute=2@30-10", "not after its start"),
    ("3:compute=2@-5", "empty window"),
    ("3:compute=2@5-5", "not after its start"),
    ("3:compute=2,p=0", "outside (0, 1]"),
    ("3:compute=2,p=1.5", "outside (0, 1]"),
    ("3:compute=2,q=0.5", "',p=PROB'"),
    ("3:hang=5", "hang takes no value"),
    ("3:crash=1", "crash takes no value"),
])
def test_bad_specs_have_clear_messages(text, needle):
    with pytest.raises(UsageError) as err:
        parse_inject(text)
    message = str(err.value)
    assert needle in message
    assert repr(text) in message and "RANKS:KIND" in message


def test_ranks_checked_against_job():
    rules = parse_injects(["1:compute=2", "2-3:io=2", "*:delay=1"], world_size=4)
    assert [r.kind for r in rules] == ["compute", "io", "delay"]
    with pytest.raises(UsageError, match=r"rank 0 is the parameter server.*workers 1\.\.3"):
        parse_injects(["0:compute=2"], world_size=4)
    with pytest.raises(UsageError, match=r"'2-5:io=2'.*rank 4 is not in this job of 4"):
        parse_injects(["2-5:io=2"], world_size=4)
    assert parse_injects(["0:compute=2"], world_size=1)[0].ranks == frozenset({0})
    with pytest.raises(UsageError, match="serial run has only rank 0"):
        parse_injects(["1:compute=2"], world_size=1)


def _injector(*specs, rank=1, seed=0, t0=100.0):
    inj = Injector([parse_inject(s) for s in specs], rank=rank, seed=seed)
    inj.start(t0)
    inj.begin_step(t0)
    return inj


def test_compute_delay_and_windows():
    inj = _injector("1:compute=3@10-30", "1:delay=0.5", "2:compute=9")
    assert inj.compute_extra(105.0, 2.0) == pytest.approx(0.5)         # only delay, before window
    assert inj.compute_extra(110.0, 2.0) == pytest.approx(4.5)         # (3-1)*2 + 0.5
    assert inj.compute_extra(129.9, 1.0) == pytest.approx(2.5)
    assert inj.compute_extra(130.0, 1.0) == pytest.approx(0.5)         # window end is exclusive
    assert inj.io_extra(110.0, 10**6, 1.0) == 0.0
    assert "1:compute=3@10-30" in inj.describe() and "2:compute" not in inj.describe()


def test_nothing_before_start():
    inj = Injector([parse_inject("*:compute=3")], rank=2, seed=0)
    assert inj.compute_extra(5.0, 1.0) == 0.0
    inj.start(0.0)
    assert inj.compute_extra(5.0, 1.0) == pytest.approx(2.0)


def test_io_and_readbw():
    inj = _injector("1:io=4", "1:readbw=10")
    # io: (4-1)*0.1; readbw: 20 MB at 10 MB/s = 2 s, minus 0.1 s already spent
    assert inj.io_extra(100.0, 20_000_000, 0.1) == pytest.approx(0.3 + 1.9)
    fast = _injector("1:readbw=1000")
    assert fast.io_extra(100.0, 1000, 0.5) == 0.0                     # already slower than the cap
    assert fast.compute_extra(100.0, 1.0) == 0.0


def test_faults_strike_at_start_and_stay():
    inj = _injector("1:hang@15", "3:crash")
    assert inj.fault(110.0) is None
    assert inj.fault(115.0) == "hang"
    assert inj.fault(200.0) == "hang"
    assert _injector("3:crash", rank=3).fault(100.0) == "crash"
    assert _injector("3:crash", rank=2).fault(100.0) is None
    assert _injector("*:crash@1", rank=7).fault(101.0) == "crash"


def _decisions(seed, rank, steps=2000, p=0.3):
    inj = _injector(f"*:delay=1,p={p}", rank=rank, seed=seed)
    out = []
    for k in range(steps):
        inj.begin_step(100.0 + k)
        out.append(inj.compute_extra(100.0 + k, 0.0) > 0)
    return out


def test_probability_is_deterministic_and_about_p():
    a = _decisions(seed=1, rank=2)
    assert a == _decisions(seed=1, rank=2)
    assert a != _decisions(seed=2, rank=2)
    assert a != _decisions(seed=1, rank=3)
    assert 0.25 < sum(a) / len(a) < 0.35


def test_rule_is_hashable_and_frozen():
    rule = InjectRule(frozenset({1}), "delay", 1.0)
    with pytest.raises(AttributeError):
        rule.kind = "io"
    assert rule in {rule}
