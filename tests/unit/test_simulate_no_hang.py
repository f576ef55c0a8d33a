"""`mpilb simulate`'s network model never hangs on degenerate inputs (#33): tiny transfers
late in a run, zero-size pushes, huge or unbounded link rates, one worker, zero compute."""

import math

import pytest

from mpilb.cli.main import main
from mpilb.errors import UsageError
from mpilb.simulate.cluster import Profile, constant
from mpilb.simulate.netengine import NetEngine
from mpilb.simulate.fabric import Fabric, PerLinkFabric
from mpilb.simulate.network import Layout, NetSpec, parse_rate
from mpilb.simulate.workers import SimConfig

GBIT = 125e6
MAX_POPS = 200_000    # far above what any test here needs; past it the loop is stuck


def counted(pop, limit: int = MAX_POPS):
    """``pop`` (a fabric's bound method, or the class's function) raising past ``limit``
    calls: a stuck loop fails fast."""
    count = [0]

    def counting(*self):
        count[0] += 1
        if count[0] > limit:
            raise AssertionError(f"the fabric popped {limit} events: stuck")
        return pop(*self)
    return counting


def bounded(fab: Fabric, limit: int = MAX_POPS) -> Fabric:
    """``fab`` with a pop that raises past ``limit`` calls."""
    fab.pop = counted(fab.pop, limit)
    return fab


def drain(fab: Fabric) -> dict:
    done = {}
    while fab.next_time() < math.inf:
        t, kind, token = fab.pop()
        if kind == 2:
            done[token] = t
    return done


@pytest.mark.parametrize("t0, nbytes, rate", [(945.3254248583684, 4000.0, 5e9),
                                              (939.227851929638, 4.0, 1.25e9),
                                              (686.7973703249007, 4e5, 1e12)])
@pytest.mark.parametrize("kind", [Fabric, PerLinkFabric])
def test_a_small_flow_late_in_a_run_is_done(t0, nbytes, rate, kind):
    """A flow's last bytes took less than the clock's resolution at t0 (an ulp of t0 at the
    rate is more than the 1e-9 tolerance): its departure fell at t0 again and again, v not
    advancing, for ever (a one-node replay with --params 1000 hung)."""
    fab = bounded(kind([rate], [math.inf], 0.0), 100)
    fab.transfer(t0, [fab.flow(t0, 0, nbytes)], "x")
    assert drain(fab)["x"] == pytest.approx(t0 + nbytes / rate, abs=1e-9)


def engine(nodes, ranks, k=1, params=1000, rate=1e6, link=GBIT, profiles=None, **kw):
    spec = NetSpec(nodes, ranks, [link] * nodes, latency_s=kw.pop("latency", 5e-5))
    layout = Layout(spec, k, kw.pop("node_of", None))
    profiles = profiles or [constant(rate, 0.0, 1e12) for _ in range(sum(ranks))]
    sizes = kw.pop("sizes", [100] * 8)
    cfg = SimConfig(balancer=kw.pop("balancer", "load"), epochs=kw.pop("epochs", 1), batch=10,
                    params=params, apply_s=kw.pop("apply_s", 2e-4), servers=k, pipeline=1, **kw)
    eng = NetEngine(cfg, profiles, sizes, layout=layout)
    bounded(eng.fabric)
    return eng


def finished(res, samples):
    cov = res["coverage"]
    assert cov["applied"] == cov["expected"] == samples and cov["duplicates"] == 0
    assert math.isfinite(res["epoch_s"])


def test_a_one_node_replay_of_a_tiny_model_late_in_time():
    # the reported case: one node (store and workers through shared memory), 1000 params,
    # slow steps so that the clock is at hundreds of seconds when the small slices travel
    eng = engine(1, [3], params=1000, rate=0.5, sizes=[20] * 20)
    finished(eng.run(), 400)
    assert eng.now > 300


def test_zero_size_pushes():
    # no parameters at all, and more stores than parameters (some slices of 0 floats)
    finished(engine(2, [2, 2], params=0).run(), 800)
    finished(engine(3, [2, 2, 2], k=3, params=2).run(), 800)
    # nothing on the wire, no latency, no store time: everything at once, still done
    finished(engine(2, [1, 1], params=0, latency=0.0, apply_s=0.0).run(), 800)


def test_a_huge_link_rate():
    big = parse_rate("1" + "0" * 300 + "gbit")
    assert math.isfinite(big)
    finished(engine(2, [2, 2], params=1000, link=big).run(), 800)
    finished(engine(2, [2, 2], params=10**9, link=1e30).run(), 800)


def test_an_unbounded_rate_is_refused():
    for text in ("1" + "0" * 400 + "gbit", "1" + "0" * 400 + "bps"):
        with pytest.raises(UsageError, match="too large"):
            parse_rate(text)
    for kind in (Fabric, PerLinkFabric):
        with pytest.raises(ValueError):
            kind([math.inf], [math.inf], 0.0)


def test_a_single_worker():
    finished(engine(1, [2], params=1000).run(), 800)
    finished(engine(2, [1, 1], params=1000, rate=0.5, sizes=[10] * 30).run(), 300)


def test_zero_compute_time():
    free = [Profile([0.0], [0.0]) for _ in range(4)]
    finished(engine(2, [2, 2], profiles=free).run(), 800)
    finished(engine(2, [2, 2], profiles=free, params=0, latency=0.0, apply_s=0.0).run(), 800)


@pytest.mark.parametrize("argv, words", [
    (["--link-rate", "1" + "0" * 400 + "gbit"], "too large"),
    (["--shm-rate", "1" + "0" * 400 + "gbit"], "too large"),
    (["--params", "-1"], "--params must be"),
    (["--apply-s", "-1"], "--apply-s must be"),
    (["--server-gbps", "0"], "--server-gbps must be"),
])
def test_degenerate_options_are_one_line_and_exit_2(capsys, argv, words):
    code = main(["simulate", "--nodes", "2", "--ranks-per-node", "2", *argv, "--epochs", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and "\n" not in err


@pytest.mark.parametrize("nodes", [None, 2])
def test_a_tiny_rebalance_interval_rebalances_once_a_chore_as_the_server_does(nodes, capsys):
    """`--rebalance-interval 1e-9` scheduled a rebalance every 1e-9 s of simulated time: a
    40 s run did not end in minutes. The server checks its timers once a chore (every
    CHORES_S), so that is the most it rebalances, in the simulator too: the run takes a
    second or two, and its figures are those of --rebalance-interval CHORES_S."""
    import time

    from mpilb.core.decisions import CHORES_S

    net = ["--nodes", str(nodes), "--ranks-per-node", "1,2", "--link-rate", "1gbit"] if nodes else \
        ["--workers", "4"]
    base = ["simulate", *net, "--epochs", "2", "--balancer", "load", "--json"]
    t0 = time.monotonic()
    assert main([*base, "--rebalance-interval", "1e-9"]) == 0
    took = time.monotonic() - t0
    tiny = capsys.readouterr().out
    assert main([*base, "--rebalance-interval", str(CHORES_S)]) == 0
    assert tiny == capsys.readouterr().out
    assert took < 30, took


@pytest.mark.parametrize("servers", ["1", "per-node"])
@pytest.mark.parametrize("burst", ["0.1", "0.2"])
def test_a_small_token_bucket_runs_dry_in_time(servers, burst, monkeypatch, capsys):
    """`--link-burst 0.2` (a bank of 24 KB spent at 5 GB/s) hung 64 s into the box's layout:
    running dry was scheduled a rounding short, the bank kept a few hundred-thousandths of
    a byte (more than its float error), and its next running dry fell at the same time
    again, for ever. A bank that would be spent in less than the clock can tell is dry."""
    monkeypatch.setattr(Fabric, "pop", counted(Fabric.pop))   # the fabric is made inside
    assert main(["simulate", "--nodes", "3", "--ranks-per-node", "1,2,2", "--link-rate", "1gbit",
                 "--params", "1000000", "--rates", "const:1e9", "--batch", "1", "--samples",
                 "2000", "--shards", "60", "--epochs", "1", "--balancer", "load", "--link-burst",
                 burst, "--servers", servers, "--json"]) == 0
    assert '"updates_per_s"' in capsys.readouterr().out
