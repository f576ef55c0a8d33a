"""Joins into runs of more than one parameter store (--servers K > 1), and of --mode ssp and
sync (docs/membership.md, "Joining a running job"). Each run must end `finished`, exit 0,
with the joiner's `join` row in members/, its updates applied, and every sample of every
epoch applied once (recomputed from updates/)."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

import mpirun
from mpilb.runfiles.requests import requests_dir
from test_joining import exact, joiner, kill_a_joiner_once_joined, stand_ins_saying_they_connect
from test_membership import check_finished_exactly, data, finish, start  # noqa: F401

pytestmark = pytest.mark.mpi


def joined_and_finished(proc, j, log, data, worker: int, more: int = 0):  # noqa: F811
    """Both launches exit 0; the run ends finished with exact coverage; members/ holds the
    joins of `worker` (and the `more` after it, one launch), whose updates were applied.
    Returns (attrs, cols, rank 0's stderr)."""
    try:
        jcode, _, jerr = finish(j)
    finally:
        code, out, err = finish(proc)
    assert jcode == 0, jerr
    assert code == 0, err
    workers = list(range(worker, worker + 1 + more))
    for w in workers:
        assert f"joined as worker {w}" in jerr, jerr
    attrs, cols = check_finished_exactly(log, data)
    m = cols["members"]
    assert list(m["event"]) == ["join"] * len(workers) and sorted(m["worker"]) == workers, m
    up = cols["updates"]
    for w in workers:
        mine = up["worker"] == w
        assert mine.sum() > 0, f"no update of joiner {w} was applied"
        assert (up["t"][mine] >= m["t"][list(m["worker"]).index(w)]).all()
        assert w in {p["rank"] for p in attrs["summary"]["per_worker"]}
    return attrs, cols, err


def every_store_applied_everything(cols) -> None:
    """Each store of --servers K applied every update: its `servers/` rows count as many as
    rank 0's (a joiner whose slices missed a store would leave it behind, or hang it)."""
    s = cols["servers"]
    counts = {int(r): int(s["updates"][s["server"] == r].sum()) for r in np.unique(s["server"])}
    assert len(counts) > 1 and len(set(counts.values())) == 1, counts


def test_a_joiner_of_two_stores_killed_after_its_admission(data, tmp_path):  # noqa: F811
    """--servers 2: a joiner killed once it joined is a lost worker like any other: rank 0
    and store 1 stop listening to it, the run ends degraded, exit 3, coverage exact, both
    stores with every update; members/ holds its join and its loss."""
    log = tmp_path / "run.h5"
    code, err = kill_a_joiner_once_joined(
        start(4, data, log, 20, "--servers", "2", "--worker-timeout", "3"), log)
    assert code == 3, err
    attrs, cols = exact(log, data, "degraded")
    m = cols["members"]
    assert list(m["event"]) == ["join", "lost"] and list(m["worker"]) == [4, 4], m
    every_store_applied_everything(cols)


def test_a_joiner_that_never_connects_holds_no_store(data, tmp_path):  # noqa: F811
    """--servers 2: a stand-in that says it connects and then ends (rank 0 sees it gone and
    tells no store to accept), and one that says it connects and never calls MPI_Comm_connect
    (rank 0 and store 1 accept together; both give up after 5 s). Each is dropped with one
    line; then `mpiexec -n 2 mpilb join` is taken on the same stores (store 1 was not left
    in its accept): each rank is accepted by both stores together, as workers 4 and 5, and
    pushes every store its slice and pulls each slice from its store; the run ends
    finished, exit 0, coverage exact, both stores with every update. (Before: refused, "a
    run with --servers K > 1 takes no joins yet", exit 2.)"""
    log = tmp_path / "run.h5"
    proc = start(4, data, log, 24, "--servers", "2")
    try:
        mpirun.wait_training(str(log), proc)
        said, silent = stand_ins_saying_they_connect(log)
        assert proc.poll() is None
        j = subprocess.Popen(mpirun.mpilb_cmd(2, "join", str(log)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=mpirun.env(),
                             start_new_session=True)
    except BaseException:
        finish(proc)
        raise
    attrs, cols, err = joined_and_finished(proc, j, log, data, 4, more=1)
    every_store_applied_everything(cols)
    dropped = [line for line in err.splitlines() if "join" in line and "dropped" in line]
    for who, why in ((said, "ended before it connected"), (silent, "did not connect within 5 s")):
        assert [line for line in dropped if f"pid {who.pid} " in line and why in line], err
    assert not os.path.exists(requests_dir(str(log)))


def test_a_worker_joins_an_ssp_run(data, tmp_path):  # noqa: F811
    """--mode ssp --staleness-bound 2 on 3 ranks: the joiner starts at the step of the slowest
    worker at work (as an idle worker woken with work does), so that it does not hold the
    others back for the steps it never took: they go on applying updates after the join,
    and so does it. (Before: refused, "takes no joins yet (async only)", exit 2.)"""
    log = tmp_path / "run.h5"
    proc = start(3, data, log, 14, "--mode", "ssp", "--staleness-bound", "2")
    try:
        mpirun.wait_training(str(log), proc)
        j = joiner(log)
    except BaseException:
        finish(proc)
        raise
    attrs, cols, err = joined_and_finished(proc, j, log, data, 3)
    up, t_join = cols["updates"], float(cols["members"]["t"][0])
    for w in (1, 2):
        assert (up["worker"][up["t"] > t_join + 1.0] == w).sum() > 0, f"worker {w} held back"


@pytest.mark.parametrize("servers", [2])   # (one store: the same path, less; the suite's time)
def test_a_worker_joins_a_sync_run_at_a_round_boundary(data, tmp_path, servers):  # noqa: F811
    """--mode sync with 2 workers on --servers 2 (with 2 stores, the joiner's id reserved
    with them while it waits), the last slowed (20 ms a step), so that a round is open nearly
    all the time: the joiner, accepted while a round is open, is admitted when it closes
    (mpilb/server/round_entry.py); from the next round on every round waits for it too. Each round's updates
    share one version (the round's): the joiner's first update is in a round of its own
    version with the others', none of its updates is stale, and none is counted twice
    (coverage exact). (Before: refused, "takes no joins yet (async only)", exit 2.)"""
    log = tmp_path / "run.h5"
    n = servers + 2
    proc = start(n, data, log, 6, "--mode", "sync", "--servers", str(servers),
                 "--inject", f"{n - 1}:delay=0.02")
    try:
        mpirun.wait_training(str(log), proc)
        j = joiner(log)
    except BaseException:
        finish(proc)
        raise
    attrs, cols, err = joined_and_finished(proc, j, log, data, n)
    up = cols["updates"]
    mine = up["worker"] == n
    assert (up["staleness"][mine] == 0).all(), up["staleness"][mine]
    first = int(up["version"][mine].min())
    assert set(up["worker"][up["version"] == first].tolist()) >= {n - 2, n - 1, n}
    if servers > 1:
        every_store_applied_everything(cols)
    # every round after the join holds one update of each worker at work (none twice)
    for v in np.unique(up["version"][up["version"] > first])[:-1]:
        ranks = up["worker"][up["version"] == v].tolist()
        assert len(ranks) == len(set(ranks)), (v, ranks)


def test_a_store_stalled_when_a_worker_joins_ends_the_job_naming_it(data, tmp_path):  # noqa: F811
    """--servers 2: store 1 stopped (SIGSTOP), then a worker joins. Every store takes part in
    MPI's accept of a joiner, so a store that cannot held rank 0 in it without a bound (the
    accept waits for every store). Rank 0 now has every store answer first: the stalled one
    is named within --worker-timeout, one line, exit 1, the log failed."""
    import signal
    import time

    from test_joining import joiner
    from test_membership import PACED, rank_pid

    timeout = 8
    log = tmp_path / "run.h5"
    proc = start(4, data, log, 200, "--servers", "2", "--worker-timeout", str(timeout), *PACED)
    store = j = None
    try:
        mpirun.wait_training(str(log), proc)
        store = rank_pid(log, 1)
        os.kill(store, signal.SIGSTOP)
        t0 = time.monotonic()
        j = joiner(log)
        code, _, err = finish(proc, timeout=timeout + 60)
        took = time.monotonic() - t0
    finally:
        if store is not None:
            try:
                os.kill(store, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if j is not None and j.poll() is None:
            os.killpg(j.pid, signal.SIGKILL)
    assert code == 1, err
    errors = [line for line in err.splitlines() if line.startswith("mpilb: error:")]
    assert len(errors) == 1 and "rank 1 (a parameter store) did not answer" in errors[0], err
    assert took < 2 * timeout + 15, took
    import h5py
    with h5py.File(log, "r") as f:
        assert f.attrs["status"] == "failed"
