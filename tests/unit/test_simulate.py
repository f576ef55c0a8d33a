"""mpilb simulate: the engine drives the live balancer and ledger; replay; the command."""

import json

import pytest

from mpilb.core.balancer import BALANCERS
from mpilb.cli.main import main
from mpilb.runfiles.runlog import RunLog
from mpilb.simulate.run import simulate
from mpilb.simulate.cluster import Slices, constant, parse_rates
from mpilb.core.inject import parse_injects
from mpilb.errors import UsageError


def cluster(rates, link=0.0):
    return [constant(r, link, 1e12) for r in rates]


def run(rates, sizes, **kw):
    kw.setdefault("batch", 10)
    kw.setdefault("params", 1000)
    kw.setdefault("apply_s", 0.0)
    return simulate(cluster(rates), sizes, **kw)


def test_static_epoch_is_the_slow_workers_share():
    # 48 shards of 100 over 3 workers: 16 each; the slow one at 25 samples/s takes 64 s
    res = run([100, 100, 25], [100] * 48, balancer="static", epochs=1)
    assert res["epoch_s"] == pytest.approx(64.0, rel=1e-3)
    assert res["moves"] == 0
    assert res["utilization"] == pytest.approx((16 + 16 + 64) / (3 * 64), rel=1e-2)


def test_load_beats_static_with_one_slow_worker():
    static = run([100, 100, 25], [100] * 48, balancer="static", epochs=2)
    load = run([100, 100, 25], [100] * 48, balancer="load", epochs=2)
    ideal = 4800 / 225
    assert load["epoch_s"] < 0.6 * static["epoch_s"]
    assert load["epoch_s"] < 1.25 * ideal
    assert load["utilization"] > 0.85 > static["utilization"]
    assert load["moves"] > 0


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("name", sorted(BALANCERS))
def test_every_sample_applied_once_per_epoch(name, mode):
    sizes = [30 + 7 * k for k in range(20)]
    res = run([100, 70, 25], sizes, balancer=name, mode=mode, epochs=2)
    cov = res["coverage"]
    assert cov["expected"] == 2 * sum(sizes)
    assert cov["applied"] == cov["expected"] and cov["duplicates"] == 0 and cov["missing"] == 0
    assert len(res["epochs"]) == 2 and all(0 < e["utilization"] <= 1 for e in res["epochs"])


def test_sync_round_lasts_as_long_as_its_slowest_member_plus_apply():
    # two workers, batch 10, 100 and 50 samples/s: each round 0.2 s + the stores' work
    stores = Slices(params=1000, apply_s=0.01)
    res = run([100, 50], [100, 100], balancer="static", mode="sync", epochs=1,
              apply_s=0.01, server_gbps=stores.gbps)
    rounds = 10
    round_s = 0.2 + stores.push_s + stores.apply_s + 3 * stores.reply_s
    assert res["epoch_s"] == pytest.approx(rounds * round_s, rel=1e-6)


def test_stores_saturate_and_more_stores_relieve_them():
    # 64 fast workers, a 25M-parameter model: one store is the bottleneck
    kw = dict(balancer="load", epochs=1, batch=32, params=25_000_000, server_gbps=4.8,
              apply_s=0.0002)
    one = simulate(cluster([2000.0] * 64), [3200] * 64, servers=1, **kw)
    four = simulate(cluster([2000.0] * 64), [3200] * 64, servers=4, **kw)
    per_update = Slices(25_000_000, 1, 4.8, 0.0002).update_s
    assert one["server_busy"] > 0.95
    assert one["updates_per_s"] == pytest.approx(1 / per_update, rel=0.05)
    assert four["updates_per_s"] > 3.0 * one["updates_per_s"]


def test_a_crashed_worker_is_lost_and_its_work_done_by_the_others():
    rules = parse_injects(["2:crash@3"], 4)
    res = run([100, 100, 100], [100] * 24, balancer="load", epochs=2, inject=rules,
              worker_timeout=2.0)
    assert res["lost_workers"] == [2]
    assert res["coverage"]["missing"] == 0 and res["coverage"]["duplicates"] == 0


def test_injected_slowdown_window_and_transient_stragglers():
    late = run([100] * 3, [100] * 30, balancer="static", epochs=1,
               inject=parse_injects(["3:compute=4@5"], 4))
    # rank 3 does 500 samples at 100/s, then 500 at 25/s
    assert late["epoch_s"] == pytest.approx(5 + 500 / 25, rel=0.01)
    flaky = run([100] * 3, [100] * 30, balancer="static", epochs=1, seed=1,
                inject=parse_injects(["*:compute=2,p=0.5"], 4))
    assert 10 * 1.3 < flaky["epoch_s"] < 10 * 1.7


def test_proportional_batches_shorten_sync_rounds():
    fixed = run([100, 100, 30], [200] * 30, balancer="load", mode="sync", epochs=2,
                batch_policy="fixed", rebalance_interval=0.5)
    prop = run([100, 100, 30], [200] * 30, balancer="load", mode="sync", epochs=2,
               batch_policy="proportional", rebalance_interval=0.5)
    assert prop["epoch_s"] < 0.8 * fixed["epoch_s"]


def test_rates_specs():
    assert parse_rates("const:5", 3, 0) == [5.0] * 3
    rates = parse_rates("lognormal:mean=100,sigma=0.3", 4000, 0)
    assert sum(rates) / len(rates) == pytest.approx(100, rel=0.03)
    for bad in ("const:x", "lognormal:mean=1", "gauss:1", "const:-1"):
        with pytest.raises(UsageError, match="--rates"):
            parse_rates(bad, 3, 0)
    with pytest.raises(UsageError, match="at least 1"):
        parse_rates("const:1", 0, 0)


def test_rates_file(tmp_path):
    path = tmp_path / "rates.csv"
    path.write_text("worker,rate\n1,10\n2,20\n")
    assert parse_rates(f"file:{path}", None, 0) == [10.0, 20.0]


def fake_run(path, status="finished"):
    """A run log as the server writes it: 2 workers, one 4x slower, 2 epochs of 40 shards."""
    cfg = {"balancer": "static", "mode": "async", "batch_policy": "fixed", "batch": 10,
           "rebalance_interval": 2.0, "seed": 0, "inject": [], "data": str(path) + ".gone"}
    log = RunLog(str(path), {"config": json.dumps(cfg), "world_size": 3})
    for t in range(2, 42, 2):
        for w, rate in ((1, 200.0), (2, 50.0)):
            n = int(rate * 2)
            log.append("workers", t=t, worker=w, samples=n, compute_s=n / rate, io_s=0.0,
                       comm_s=0.0, idle_s=0.0, batch=10, rate=rate, predicted_rate=rate)
            for k in range(n // 10):
                log.append("updates", t=t - 2 + k * 0.01, worker=w, version=0, staleness=0,
                           batch=10, loss=0.0, lr_scale=1.0, epoch=0, shard=k % 40, )
    log.append("epochs", epoch=0, t_start=0.0, t_end=40.0, samples=4000, utilization=0.6,
               imbalance_s=30.0)
    log.close(status)


def test_replay_reads_the_traces_and_shard_sizes(tmp_path):
    from mpilb.simulate.replay import load_run

    fake_run(tmp_path / "run.h5")
    rep = load_run(str(tmp_path / "run.h5"), params=1000)
    assert len(rep.profiles) == 2 and len(rep.shard_sizes) == 40
    assert rep.profiles[1].compute[0] == pytest.approx(1 / 50)
    assert rep.measured_epoch_s == [40.0]


def test_cli_replay_json(tmp_path, capsys):
    fake_run(tmp_path / "run.h5")
    code = main(["simulate", "--from", str(tmp_path / "run.h5"), "--params", "1000",
                 "--balancer", "static,load", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["balancer"] for r in out] == ["static", "load"]
    for r in out:
        assert {"balancer", "batch_policy", "mode", "workers", "servers", "epoch_s", "utilization",
                "imbalance_s", "moves", "updates_per_s", "server_busy"} <= set(r)
    assert out[1]["epoch_s"] < out[0]["epoch_s"]


def test_cli_table_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    code = main(["simulate", "--workers", "4,8", "--rates", "const:100", "--samples", "3200",
                 "--shards", "32", "--epochs", "1", "--balancer", "static,load",
                 "--servers", "1,2", "--plot", str(png)])
    assert code == 0
    out = capsys.readouterr().out
    assert out.count(" static ") == 4 and "server_busy" in out
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("argv, words", [
    (["--from", "{tmp}/missing.h5"], "cannot read the run log"),
    (["--from", "{tmp}/running.h5"], "unfinished"),
    (["--workers", "4", "--rates", "lognormal:mean=1"], "bad --rates"),
    (["--workers", "0"], "at least 1"),
    (["--workers", "4", "--balancer", "fastest"], "unknown"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, words):
    fake_run(tmp_path / "running.h5", status="running")
    code = main(["simulate", *[a.format(tmp=tmp_path) for a in argv]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and "\n" not in err
