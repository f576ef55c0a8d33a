"""--chunk-kb end to end on one node, through the test hook that chunks pairs on one node as
if they were apart (mpi/chunks.py: MPILB_CHUNK_LOCAL=1; tests/cluster runs it across the
box's network): a step streamed chunk by chunk gives the floats of the step taken whole,
every mode keeps exact coverage, a worker lost while its chunks are due is lost as before,
and `bench ps` runs its null workers through the same protocol."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mpirun
from mpilb.mpi.chunks import LOCAL_ENV
from mpilb.runfiles.summary import summarize_log

pytestmark = pytest.mark.mpi

CHUNKED = {LOCAL_ENV: "1"}


def train(n, data, log, *args, env=CHUNKED, timeout=180):
    return mpirun.run(n, "train", "--data", data, "--model", "mlp", "--hidden", "256",
                      "--seed", "3", "--no-progress", "--log", str(log), *args,
                      timeout=timeout, **env)


@pytest.mark.parametrize("n, args", [
    (2, ["--optimizer", "sgd"]),
    (3, ["--servers", "2", "--optimizer", "momentum", "--wire", "bf16"]),
    (3, ["--servers", "2", "--optimizer", "momentum", "--correction", "gap"]),   # per chunk
    (3, ["--servers", "2", "--optimizer", "adam", "--lr", "0.001", "--correction", "dc"]),
])
def test_one_worker_streamed_in_chunks_steps_the_same_floats(digits_dir, tmp_path, n, args):
    """One worker without pipelining applies in one order whatever the transport, so the
    chunked run's parameters and optimizer state are the unchunked run's, bit for bit (the
    mlp's 19k floats: 5 chunks of 16 KB a slice)."""
    floats = {}
    for kb in (0, 16):
        log = tmp_path / f"kb{kb}.h5"
        res = train(n, digits_dir, log, "--epochs", "2", "--pipeline", "0", "--chunk-kb", str(kb),
                    "--checkpoint", str(tmp_path / f"kb{kb}.ckpt.h5"), *args)
        assert res.returncode == 0, res.stderr
        mpirun.finished_exact(log)
        floats[kb] = mpirun.checkpoint_floats(tmp_path / f"kb{kb}.ckpt.h5")
    assert floats[0].keys() == floats[16].keys() and floats[0]
    for key, value in floats[0].items():
        assert np.array_equal(value, floats[16][key]), key


@pytest.mark.parametrize("args", [
    ["--servers", "2", "--wire", "bf16"],               # async, streamed, both stores
    ["--servers", "2", "--optimizer", "momentum", "--lr", "0.05"],   # dana: a velocity a worker
    ["--mode", "ssp", "--servers", "2"],                 # chunks, answered whole
    ["--mode", "sync", "--optimizer", "momentum"],       # rounds
])
def test_chunked_runs_cover_every_sample_and_learn(digits_dir, tmp_path, args):
    log = tmp_path / "run.h5"
    res = train(5, digits_dir, log, "--epochs", "12", "--chunk-kb", "16", *args)
    assert res.returncode == 0, res.stderr
    s = mpirun.finished_exact(log)
    assert s["final_test_accuracy"] >= 0.85, s["final_test_accuracy"]


def test_a_worker_that_hangs_in_a_chunked_run_is_lost_and_the_run_degrades(synth_dir, tmp_path):
    log = tmp_path / "run.h5"
    res = mpirun.run(5, "train", "--data", synth_dir, "--model", "mlp", "--hidden", "256",
                     "--epochs", "6", "--servers", "2", "--chunk-kb", "16", "--no-progress",
                     "--inject", "3:hang@0.3", "--worker-timeout", "2", "--log", str(log),
                     timeout=180, **CHUNKED)
    assert res.returncode == 3, res.stderr
    s = summarize_log(str(log))
    assert s["status"] == "degraded" and s["lost_workers"] == [3]
    cov = s["coverage"]
    assert cov["applied"] == cov["expected"] and cov["duplicates"] == cov["missing"] == 0, cov


def test_bench_ps_null_workers_stream_in_chunks():
    res = mpirun.run(5, "bench", "ps", "--params", "200000", "--seconds", "0.5", "--repeats", "1",
                     "--servers", "2", "--json", "--chunk-kb", "64", timeout=120, **CHUNKED)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["updates_per_s"] > 5 and out["stores"] == [0, 1]


def test_a_push_whose_chunks_stall_does_not_hold_the_others(synth_dir, tmp_path):
    """Rank 3 sends its 40th push's header, then waits 5 s before the chunks (a worker that
    stops part-way through a push: the test hook). Rank 0 waits chunks.STALL_S (2 s) for
    them, goes on with the rest counted as zeros, and receives rank 3's next push once they
    are in: the other workers' updates go on meanwhile (before: rank 0 waited for the
    chunks, and no update was applied for 5 s), and the run covers every sample once."""
    log = tmp_path / "run.h5"
    res = mpirun.run(4, "train", "--data", synth_dir, "--model", "mlp", "--hidden", "256",
                     "--epochs", "12", "--chunk-kb", "16", "--no-progress", "--pipeline", "0",
                     "--inject", "*:delay=0.01", "--log", str(log), timeout=180,
                     **CHUNKED, MPILB_TEST_PUSH_PAUSE="40:5")
    assert res.returncode == 0, res.stderr
    mpirun.finished_exact(log)
    from mpilb.runfiles.runlog import read_columns

    _, cols = read_columns(str(log))
    t = np.sort(cols["updates"]["t"])
    gaps = np.diff(t)
    assert gaps.max() < 3.5, gaps.max()   # rank 0 went on after 2 s, not after 5
    w = cols["updates"]["worker"]
    late = cols["updates"]["t"][w == 3]
    # (the pause happened: rank 3's stalled push is applied after 2 s, its next one only once
    # the chunks came, 5 s after its header; other gaps are tens of ms)
    assert np.diff(np.sort(late)).max() > 2.5
