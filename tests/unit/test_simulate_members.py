"""`mpilb simulate --from RUN.h5` replays the run's joins, leaves and losses at their
recorded times (issue 29): from run logs written with the run log's writer."""

from __future__ import annotations

import json


from mpilb.cli.main import main
from mpilb.runfiles.runlog import RunLog

RATE = 100.0   # samples/s of every worker


def fake_run(path, windows: dict, members=(), world: int = 3, hosts=None) -> str:
    """A finished one-epoch async run: each worker computes at RATE while in its window
    (start, end) of `windows`, reported every 2 s; `members`: (t, worker, node, event);
    `hosts`: the ranks' host names."""
    cfg = {"balancer": "load", "mode": "async", "batch_policy": "fixed", "batch": 10,
           "rebalance_interval": 2.0, "seed": 0, "inject": [], "worker_timeout": 2.0,
           "data": str(path) + ".gone"}
    attrs = {"config": json.dumps(cfg), "world_size": world}
    if hosts:
        attrs["hostnames"] = json.dumps(hosts)
    log = RunLog(str(path), attrs, flush_interval=60.0)
    end = max(b for _, b in windows.values())
    for t, w, node, event in members:
        log.append("members", t=t, worker=w, node=node, event=event)
    shard = 0
    for t in range(2, int(end) + 1, 2):
        for w, (a, b) in sorted(windows.items()):
            if not a < t <= b:
                continue
            n = int(RATE * 2)
            log.append("workers", t=t, worker=w, samples=n, compute_s=n / RATE, io_s=0.0,
                       comm_s=0.0, idle_s=0.0, batch=10, rate=RATE, predicted_rate=RATE)
            for k in range(n // 10):
                log.append("updates", t=t - 2 + k * 0.1, worker=w, version=0, staleness=0,
                           batch=10, loss=0.0, lr_scale=1.0, epoch=0, shard=shard % 40)
                shard += 1
    log.append("epochs", epoch=0, t_start=0.0, t_end=float(end), samples=shard * 10,
               utilization=0.9, imbalance_s=0.0)
    log.close("finished")
    return str(path)


def simulate(path, capsys) -> dict:
    assert main(["simulate", "--from", path, "--params", "1000", "--balancer", "load",
                 "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["coverage"]["missing"] == 0 and result["coverage"]["duplicates"] == 0
    return result


def by_worker(result: dict) -> dict:
    return {w["worker"]: w for w in result["per_worker"]}


def test_a_joiner_works_only_after_its_join(tmp_path, capsys):
    windows = {1: (0, 40), 2: (0, 40), 3: (10, 40)}
    joined = simulate(fake_run(tmp_path / "join.h5", windows, [(10.0, 3, 0, "join")]), capsys)
    # the same rows without the join row: the worker is taken for one of the job's
    present = simulate(fake_run(tmp_path / "all.h5", windows), capsys)
    # (the engine numbers the run's workers 1..3 in rank order: rank 3 is worker 3)
    w = by_worker(joined)
    assert w[3]["first_push_s"] >= 10.0 and w[3]["samples"] > 0
    assert w[1]["first_push_s"] < 1.0 and w[2]["first_push_s"] < 1.0
    assert by_worker(present)[3]["first_push_s"] < 1.0
    samples = sum(v["samples"] for v in w.values())
    two_only = samples / (2 * RATE)           # had the joiner never come
    assert present["total_s"] * 1.05 < joined["total_s"] < 0.95 * two_only


def test_a_leave_hands_back_its_work_and_takes_longer(tmp_path, capsys):
    windows = {1: (0, 40), 2: (0, 40), 3: (0, 10)}
    left = simulate(fake_run(tmp_path / "leave.h5", windows, [(10.0, 3, 0, "leave")]), capsys)
    stayed = simulate(fake_run(tmp_path / "stay.h5", windows), capsys)
    assert left["left_workers"] == [3] and stayed["left_workers"] == []
    assert by_worker(left)[3]["last_push_s"] <= 10.0 + 1.0      # its step in flight at most
    assert by_worker(stayed)[3]["last_push_s"] > 20.0
    assert left["total_s"] > 1.2 * stayed["total_s"]
    assert left["lost_workers"] == []


def test_a_loss_is_declared_at_its_time(tmp_path, capsys):
    windows = {1: (0, 40), 2: (0, 40), 3: (0, 10)}
    lost = simulate(fake_run(tmp_path / "lost.h5", windows, [(10.0, 3, 0, "lost")]), capsys)
    assert lost["lost_workers"] == [3] and lost["left_workers"] == []
    # silent from --worker-timeout (2 s) before the row
    assert by_worker(lost)[3]["last_push_s"] <= 8.0 + 1.0


def test_table_names_the_changes(tmp_path, capsys):
    path = fake_run(tmp_path / "join.h5", {1: (0, 20), 2: (0, 20), 3: (6, 20)},
                    [(6.0, 3, -1, "join")])
    assert main(["simulate", "--from", path, "--params", "1000", "--balancer", "load"]) == 0
    assert "membership changes replayed: rank 3 join at 6.0 s" in capsys.readouterr().out


def network_replay(path, capsys) -> dict:
    assert main(["simulate", "--from", path, "--params", "100000", "--balancer", "load",
                 "--link-rate", "1gbit", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["coverage"]["missing"] == 0 and result["coverage"]["duplicates"] == 0
    return result


def test_a_join_on_the_network_model(tmp_path, capsys):
    """A joiner's id (4) past the job's 4 ranks, on the node its join names (n1), works
    from its join on; before, a replay on a network refused a run that workers joined."""
    windows = {1: (0, 40), 2: (0, 40), 3: (0, 40), 4: (10, 40)}   # rank 0 a store only
    hosts = ["n0", "n1", "n1", "n2"]
    joined = network_replay(fake_run(tmp_path / "join.h5", windows, [(10.0, 4, 1, "join")],
                                     world=4, hosts=hosts), capsys)
    w = by_worker(joined)
    assert sorted(w) == [1, 2, 3, 4] and joined["members"] == [[10.0, 4, "join"]]
    assert w[4]["first_push_s"] >= 10.0 and w[4]["samples"] > 0
    assert all(w[r]["first_push_s"] < 1.0 for r in (1, 2, 3))
    without = network_replay(fake_run(tmp_path / "three.h5", {r: windows[r] for r in (1, 2, 3)},
                                      world=4, hosts=hosts), capsys)
    # (the fake log's dataset is what its updates covered: the joiner's rows add samples)
    rate = {k: sum(v["samples"] for v in r["per_worker"]) / r["total_s"]
            for k, r in (("joined", joined), ("without", without))}
    assert rate["joined"] > 1.15 * rate["without"], rate


def test_a_joiner_on_a_node_of_its_own_and_one_that_never_worked(tmp_path, capsys):
    """A join that names no node of the job (-1) runs on a node of its own; an id that
    joined and never worked (no workers/ rows: it died in admission) is no worker."""
    windows = {1: (0, 30), 2: (0, 30), 4: (6, 30)}
    path = fake_run(tmp_path / "own.h5", windows, [(4.0, 3, 1, "join"), (6.0, 4, -1, "join")],
                    world=3, hosts=["n0", "n1", "n1"])
    result = network_replay(path, capsys)
    assert result["network"]["nodes"] == 3
    w = by_worker(result)
    assert sorted(w) == [1, 2, 4] and w[4]["first_push_s"] >= 6.0


def test_a_leave_on_the_network_model(tmp_path, capsys):
    windows = {1: (0, 40), 2: (0, 40), 3: (0, 10)}   # rank 0 a store only
    path = fake_run(tmp_path / "leave.h5", windows, [(10.0, 3, 2, "leave")], world=4,
                    hosts=["n0", "n1", "n1", "n2"])
    assert main(["simulate", "--from", path, "--params", "100000", "--balancer", "load",
                 "--link-rate", "1gbit", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["left_workers"] == [3] and result["coverage"]["missing"] == 0
    assert by_worker(result)[3]["last_push_s"] <= 11.0


def test_a_resume_takes_the_joiners_out(tmp_path):
    """A join at 4 s, the run resumed from 12 s with the job's ranks (`resumed_at`): the
    replay lets the joiner go at 12 s."""
    import h5py

    from mpilb.simulate.replay import load_run

    path = fake_run(tmp_path / "resumed.h5", {1: (0, 30), 2: (0, 30), 3: (4, 12)},
                    [(4.0, 3, 0, "join")])
    with h5py.File(path, "a") as f:
        f.attrs["resumed_at"] = json.dumps([12.0])
    rep = load_run(path, params=1000)
    assert rep.members == [(4.0, 3, "join"), (12.0, 3, "resume")]
    from mpilb.simulate.run import simulate

    res = simulate(rep.profiles, rep.shard_sizes, True, members=rep.engine_members(),
                   balancer="load", epochs=1, batch=10, params=1000)
    assert res["left_workers"] == [3] and res["coverage"]["missing"] == 0
