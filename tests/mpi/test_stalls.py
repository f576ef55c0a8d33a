"""No wait without a deadline: a parameter store that stalls (SIGSTOP; on a cluster, its
node's link down) ends the job with one line naming it within --worker-timeout + 10 s, and a
SIGTERM meanwhile still stops the run as preempted (exit 0) within 30 s."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import h5py
import pytest

import mpirun

pytestmark = pytest.mark.mpi


def rank_pid(tag: str, rank: int) -> int | None:
    """The pid of `rank` of the job whose processes carry MPILB_TEST_TAG=tag."""
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            items = env.read_bytes().split(b"\0")
        except OSError:
            continue
        if f"MPILB_TEST_TAG={tag}".encode() in items and f"PMI_RANK={rank}".encode() in items:
            return int(env.parent.name)
    return None


def start_and_stall(tmp_path, digits_dir, timeout_s: float):
    tag = uuid.uuid4().hex
    log = tmp_path / "run.h5"
    proc = subprocess.Popen(
        mpirun.mpilb_cmd(5, "train", "--data", digits_dir, "--hidden", "32", "--epochs", 2000,
                         "--servers", 2, "--worker-timeout", timeout_s, "--no-progress",
                         "--checkpoint-interval", 1, "--log", log),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=mpirun.env(MPILB_TEST_TAG=tag))
    deadline = time.monotonic() + 60
    while not (tmp_path / "run.ckpt.h5").exists():   # training, with a first checkpoint
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    pid = rank_pid(tag, 1)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    return proc, pid, log


def test_a_stalled_store_ends_the_job_naming_it(tmp_path, digits_dir):
    proc, pid, log = start_and_stall(tmp_path, digits_dir, 5)
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT) if proc.poll() is None else None
    took = time.monotonic() - t0
    assert proc.returncode == 1, err
    assert took < 5 + 10, took
    lines = [ln for ln in err.splitlines() if ln.startswith("mpilb:")]
    assert len(lines) == 1 and "rank 1 (a parameter store) did not answer" in lines[0], err
    with h5py.File(log, "r") as f:
        assert f.attrs["status"] == "failed"


def test_sigterm_during_a_store_stall_stops_the_run_within_30_s(tmp_path, digits_dir):
    proc, pid, log = start_and_stall(tmp_path, digits_dir, 60)
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT) if proc.poll() is None else None
    took = time.monotonic() - t0
    assert proc.returncode == 0, err
    assert took < 30, took
    assert "stopped: rank 1 (a parameter store) did not answer" in err
    with h5py.File(log, "r") as f:
        assert f.attrs["status"] == "preempted"
    with h5py.File(tmp_path / "run.ckpt.h5", "r") as f:   # the last checkpoint, readable
        assert f["params"].shape[0] > 0
