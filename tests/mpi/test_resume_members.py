"""--resume across membership changes (issue 29): a run joined by one worker, SIGTERM'd
after the join, resumed with the job's own ranks: it finishes with exact coverage, the
first part's members/ rows stay in the log (with the resume's time, `resumed_at`, so that
the count of workers over time drops back to the launch's), and rank 0's `dynamic`
correction goes on from what it had measured (its checkpoint keeps the staleness average)."""

from __future__ import annotations

import json
import signal
import time

import h5py
import pytest

import mpirun
from mpilb.runfiles.plots import worker_counts
from mpilb.runfiles.runlog import read_columns
from test_joining import joiner, wait_joined
from test_membership import check_finished_exactly, data, finish, start  # noqa: F401

pytestmark = pytest.mark.mpi


def correction_state(ckpt) -> tuple[dict, int, int]:
    """The checkpoint's correction state, its version and its epoch."""
    with h5py.File(ckpt, "r") as f:
        return json.loads(f.attrs["correction"]), int(f.attrs["version"]), int(f.attrs["epoch"])


def pushes_of(log, worker: int) -> int:
    _, cols = read_columns(str(log))
    return int((cols["updates"]["worker"] == worker).sum())


def test_a_run_joined_then_preempted_resumes_with_its_own_ranks(data, tmp_path):  # noqa: F811
    log, ckpt = tmp_path / "run.h5", tmp_path / "run.ckpt.h5"
    proc = start(3, data, log, 40)
    try:
        mpirun.wait_training(str(log), proc)
        j = joiner(log)
        wait_joined(j)
        deadline = time.monotonic() + 60
        while pushes_of(log, 3) == 0:   # the joiner's pushes reach the log (flushed each 2 s)
            assert time.monotonic() < deadline, "the joiner's pushes never reached the log"
            assert proc.poll() is None, "the run ended before the joiner pushed"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)   # to mpiexec: the job stops, checkpointed
        jcode, _, jerr = finish(j, timeout=120)
    finally:
        code, _, err = finish(proc, timeout=120)
    assert code == 0, err
    assert jcode == 0, jerr
    attrs, cols = read_columns(str(log))
    assert attrs["status"] == "preempted", err
    joined = [(float(t), int(w)) for t, w, e in zip(cols["members"]["t"], cols["members"]["worker"],
                                                     cols["members"]["event"]) if e == "join"]
    assert [w for _, w in joined] == [3]
    state, version, epoch = correction_state(ckpt)
    with h5py.File(ckpt, "r") as f:
        resumed_from = float(f.attrs["train_s"])
    # the async default: `dynamic`, its staleness average over every gradient applied
    assert state["name"] == "dynamic" and state["meter"]["count"] == version > 0
    assert state["meter"]["mean"] > 0

    res = mpirun.run(3, "train", "--data", data, "--model", "mlp", "--hidden", "64", "--batch",
                     "32", "--epochs", str(epoch + 2), "--no-progress", "--log", str(log),
                     "--resume", timeout=240)
    assert res.returncode == 0, res.stderr
    attrs, cols = check_finished_exactly(log, data)
    kept = [(float(t), int(w)) for t, w, e in zip(cols["members"]["t"], cols["members"]["worker"],
                                                   cols["members"]["event"]) if e == "join"]
    assert kept == joined                  # the first part's join stays in the log
    assert int((cols["updates"]["worker"] == 3).sum()) > 0   # and the joiner's updates
    # the log says where the resumed launch (the job's two workers) took over
    assert json.loads(attrs["resumed_at"]) == [pytest.approx(resumed_from)]
    steps = worker_counts(attrs, cols)
    assert [c for _, c in steps] == [2, 3, 2] and steps[2][0] == pytest.approx(resumed_from)
    after, final, _ = correction_state(ckpt)
    # counted on from the checkpoint's (a fresh meter would count final - version only)
    assert after["meter"]["count"] == final > version
