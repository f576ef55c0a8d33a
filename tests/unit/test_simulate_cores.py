"""A node's cores in the simulator (mpilb/simulate/cores.py): ranks that outnumber them
share them, in replays (`--from`, the log's `cpus`) and with --cores-per-node."""

import json

import pytest

from mpilb.cli.main import main
from mpilb.runfiles.runlog import RunLog
from mpilb.simulate.cores import NodeCores
from mpilb.simulate.replay import load_run
from mpilb.simulate.run import run
from mpilb.simulate.workers import SimConfig
from mpilb.simulate.cluster import constant


def load_like_run(path, cpus=2):
    """A `load` run's log on one node: rank 0 and 3 workers, every worker busy to the end,
    rank 3 4x slower; workers compute 70% (1, 2) and 95% (3) of the time, rank 0 uses 40%
    of a core. Rows every 2 s, one push per 10 samples, 1 epoch of 20 s."""
    cfg = {"balancer": "load", "mode": "async", "batch_policy": "fixed", "batch": 10,
           "rebalance_interval": 2.0, "seed": 0, "inject": [], "data": str(path) + ".gone"}
    log = RunLog(str(path), {"config": json.dumps(cfg), "world_size": 4,
                             "nodes": json.dumps([0, 0, 0, 0]), "cpus": json.dumps([cpus] * 4),
                             "server_cpu_s": 8.0, "train_s": 20.0})
    shard = 0
    for t in range(2, 22, 2):
        for w, rate, n, comm in ((1, 200.0, 280, 0.6), (2, 200.0, 280, 0.6), (3, 50.0, 90, 0.1)):
            log.append("workers", t=t, worker=w, samples=n, compute_s=n / rate, io_s=0.0,
                       comm_s=comm, idle_s=0.0, batch=10, rate=rate, predicted_rate=rate)
            steps = n // 10
            for k in range(steps):
                log.append("updates", t=t - 2 + (k + 1) * 2.0 / steps, worker=w, version=0,
                           staleness=0, batch=10, loss=0.0, lr_scale=1.0, epoch=0,
                           shard=shard % 40)
                shard += 1
    log.append("epochs", epoch=0, t_start=0.0, t_end=20.0, samples=6500, utilization=0.95,
               imbalance_s=0.0)
    log.close("finished")


def replay(path, capsys, *extra):
    assert main(["simulate", "--from", str(path), "--params", "1000", "--balancer",
                 "static,load", "--json", *extra]) == 0
    return {r["balancer"]: r["epoch_s"] for r in json.loads(capsys.readouterr().out)}


def test_a_shared_node_speeds_up_the_slow_rank_once_the_others_are_idle(tmp_path, capsys):
    load_like_run(tmp_path / "run.h5")
    rep = load_run(str(tmp_path / "run.h5"), params=1000)
    assert rep.cores is not None and rep.cores.cores == (2,)
    # 0.7 + 0.7 + 0.95 busy workers and 0.4 of the server on 2 cores: measured 1.37x slow
    assert rep.profiles[2].compute[0] == pytest.approx(1 / 50 / 1.374, rel=0.01)
    shared = replay(tmp_path / "run.h5", capsys)
    own = replay(tmp_path / "run.h5", capsys, "--cores-per-node", "4")   # a core each: off
    # static: the fast two finish early and leave rank 3 a core of its own, so the static
    # run is shorter than the load run's speeds say; under load itself nothing moves much
    assert shared["static"] < 0.85 * own["static"]
    assert shared["load"] == pytest.approx(own["load"], rel=0.05)


def test_a_core_per_rank_changes_nothing_to_the_last_bit():
    profiles = [constant(r, 0.001, 1e9) for r in (100.0, 100.0, 25.0)]
    base = dict(balancer="load", epochs=2, batch=16, params=10_000)
    plain = run(SimConfig(**base), profiles, [500] * 12)
    cores = NodeCores((4,), {1: 0, 2: 0, 3: 0}, 0, 0.5)   # 4 ranks, 4 cores
    assert run(SimConfig(**base, cores=cores), profiles, [500] * 12) == plain


def test_cores_per_node_slows_a_crowded_what_if(capsys):
    argv = ["simulate", "--workers", "4", "--rates", "const:100", "--samples", "4000",
            "--shards", "16", "--epochs", "1", "--balancer", "static", "--json"]
    assert main(argv) == 0
    alone = json.loads(capsys.readouterr().out)[0]["epoch_s"]
    assert main(argv + ["--cores-per-node", "2"]) == 0
    crowded = json.loads(capsys.readouterr().out)[0]["epoch_s"]
    assert crowded > 1.5 * alone


@pytest.mark.parametrize("argv, words", [
    (["--workers", "4", "--cores-per-node", "0"], "--cores-per-node must be at least 1"),
    (["--nodes", "2", "--cores-per-node", "4"], "without a network only"),
])
def test_bad_cores_per_node_is_one_line_and_exit_2(capsys, argv, words):
    code = main(["simulate", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and "\n" not in err
