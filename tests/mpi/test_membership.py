"""Elastic membership under mpiexec: a worker leaves a running job (`mpilb leave`, SIGUSR2),
the run goes on and ends `finished` with exact coverage; bad requests are one line, exit 2."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

import mpirun
from mpilb.data.dataset import open_dataset
from mpilb.runfiles.runlog import read_columns

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from mpilb.data.dataset import prepare_synthetic

    root = tmp_path_factory.mktemp("members") / "d"
    prepare_synthetic(root, samples=30000, features=64, classes=10, shards=15, seed=1)
    return str(root)


def start(n, data, log, epochs=12, *extra, launcher=()):
    args = ["train", "--data", data, "--model", "mlp", "--hidden", "64", "--batch", "32",
            "--epochs", str(epochs), "--no-progress", "--log", str(log), *extra]
    cmd = mpirun.mpilb_cmd(n, *args)
    cmd[1:1] = launcher   # after mpiexec
    return subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=mpirun.env(),
                            start_new_session=True)


# Every worker sleeps 2 ms a step: a run that must outlive what a test does to it (a few
# `mpilb leave` commands, each a process start) lasts at least ~250 steps an epoch x 2 ms
# on a fast machine too (measured on a fast 2-core VM: 8 sync epochs unpaced in 2.4 s, before
# `mpilb leave` was answered), while on a slow one the sleeps overlap the others' compute.
PACED = ("--inject", "*:delay=0.002")


def rank_pid(log, rank: int) -> int:
    """The pid of `rank` of the job writing `log` (Hydra gives each rank PMI_RANK)."""
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as fh:
                cmd = fh.read().split(b"\0")
            with open(f"/proc/{p}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if (str(log).encode() in cmd and b"mpilb" in cmd and f"PMI_RANK={rank}".encode() in env
                and not any(b"hydra" in c or c.endswith(b"mpiexec") for c in cmd)):
            return int(p)
    raise AssertionError(f"no process of rank {rank}")


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as fh:   # a zombie awaiting its parent has ended too
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        time.sleep(0.05)
    return False


def leave(log, rank: int) -> subprocess.CompletedProcess:
    return mpirun.run(0, "leave", str(log), "--rank", str(rank), timeout=60)


def finish(proc, timeout=240):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out, err


def check_finished_exactly(log, data):
    attrs, cols = read_columns(str(log))
    assert attrs["status"] == "finished"
    cov = mpirun.recomputed_coverage(str(log), open_dataset(data).shard_sizes)
    assert cov["missing"] == 0 and cov["duplicates"] == 0 and cov["applied"] == cov["expected"], cov
    assert json.loads(attrs["coverage"])["missing"] == 0
    return attrs, cols


def test_mpilb_leave_lets_a_worker_go_and_the_run_finishes(data, tmp_path):
    """--servers 2 on 4 ranks: stores 0 and 1, workers 2 and 3. `mpilb leave --rank 3` part-way:
    rank 3 ends (exit 0) within seconds while the run goes on; the run ends `finished`,
    exit 0, every sample of every epoch applied once; members/ holds the leave; rank 3's
    samples count in per_worker. Requests that cannot be met are one line, exit 2."""
    log = tmp_path / "run.h5"
    proc = start(4, data, log, 6, "--servers", "2", *PACED)
    try:
        mpirun.wait_training(str(log), proc)
        pid = rank_pid(log, 3)
        for rank, says in ((0, "--rank 0 is the parameter server"), (1, "--rank 1 holds parameters"),
                           (7, "--rank 7: the run has ranks 0-3")):
            bad = leave(log, rank)
            assert bad.returncode == 2 and says in bad.stderr, bad.stderr
            assert len(bad.stderr.strip().splitlines()) == 1
        asked = time.monotonic()
        done = leave(log, 3)
        assert done.returncode == 0, done.stderr
        assert "rank 3 leaves after its current step" in done.stdout
        assert gone_within(pid, 10.0), "the worker that left is still running"
        left_after = time.monotonic() - asked
        assert proc.poll() is None, "the run ended with the leaver"
        last = leave(log, 2)   # the only worker left: the run cannot go on without it
        assert last.returncode == 2 and "is the last worker" in last.stderr, last.stderr
        again = leave(log, 3)
        assert again.returncode == 2 and "has left the run already" in again.stderr, again.stderr
    finally:
        code, out, err = finish(proc)
    assert code == 0, err
    attrs, cols = check_finished_exactly(log, data)
    members = cols["members"]
    assert list(members["worker"]) == [3] and list(members["event"]) == ["leave"]
    assert list(members["node"]) == [0]
    summary = attrs["summary"]
    assert summary["lost_workers"] == []
    assert {w["rank"] for w in summary["per_worker"]} == {2, 3}
    assert left_after < 10.0
    ended = leave(log, 2)
    assert ended.returncode == 2 and "the run has ended (status finished)" in ended.stderr
    assert not os.path.exists(f"{log}.requests")
    report = mpirun.run(0, "report", str(log), timeout=60)
    assert report.returncode == 0 and "rank 3 left" in report.stdout, report.stdout


@pytest.mark.parametrize("launcher", [(), ("-disable-auto-cleanup",)], ids=["default", "no-cleanup"])
def test_sigusr2_to_a_worker_lets_it_go_with_pipelining(data, tmp_path, launcher):
    """SIGUSR2 to worker 2's process (--pipeline 1: it holds a computed batch it never
    pushes): it leaves, its work goes to the others; the run ends finished, exit 0, exact.
    Under -disable-auto-cleanup Hydra sends the others SIGUSR1 as the leaver's process ends
    (after its MPI_Finalize too): that is no preemption (before: every worker reported it,
    the vote passed, and the run stopped `preempted`)."""
    log = tmp_path / "run.h5"
    proc = start(4, data, log, 10, "--pipeline", "1", *PACED, launcher=launcher)
    try:
        mpirun.wait_training(str(log), proc)
        pid = rank_pid(log, 2)
        os.kill(pid, signal.SIGUSR2)
        assert gone_within(pid, 10.0), "the worker told to leave is still running"
        assert proc.poll() is None
    finally:
        code, out, err = finish(proc)
    assert code == 0, err
    assert "mpilb: SIGUSR2: rank 2 leaves after its current step" in err
    assert "checkpointing and stopping" not in err
    attrs, cols = check_finished_exactly(log, data)
    assert list(cols["members"]["event"]) == ["leave"] and list(cols["members"]["worker"]) == [2]
    # its last pushes were applied: it counts like any other worker
    assert 2 in set(cols["updates"]["worker"].tolist())


def test_mpilb_leave_refuses_a_run_of_another_user(data, tmp_path):
    """Checked before anything else: the log's owner is not this user (exit 2, one line)."""
    if os.getuid() != 0:
        pytest.skip("needs root to give a file to another user")
    log = tmp_path / "run.h5"
    code = mpirun.run(2, "train", "--data", data, "--model", "mlp", "--hidden", "16",
                      "--epochs", "1", "--no-progress", "--log", str(log))
    assert code.returncode == 0, code.stderr
    other = tmp_path / "other.h5"
    shutil.copy(log, other)
    os.chown(other, 12345, 12345)
    bad = leave(other, 1)
    assert bad.returncode == 2 and "a run of another user (uid 12345)" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_leave_in_the_modes_that_hold_replies(data, tmp_path, mode):
    """sync rounds and the ssp bound hold replies: a worker asked to leave while held goes
    when its reply would have been released, and the rounds (the bound) go on without it."""
    log = tmp_path / "run.h5"
    proc = start(4, data, log, 8, "--mode", mode, *PACED)
    try:
        mpirun.wait_training(str(log), proc)
        pid = rank_pid(log, 1)
        done = leave(log, 1)
        assert done.returncode == 0, done.stderr
        assert gone_within(pid, 10.0), "the worker that left is still running"
    finally:
        code, out, err = finish(proc)
    assert code == 0, err
    attrs, cols = check_finished_exactly(log, data)
    assert list(cols["members"]["event"]) == ["leave"] and list(cols["members"]["worker"]) == [1]
    t_left = float(cols["members"]["t"][0])
    up = cols["updates"]
    assert not (up["worker"][up["t"] > t_left] == 1).any()   # nothing applied from it after


def join(log, timeout=120):
    return subprocess.Popen(mpirun.mpilb_cmd(1, "join", str(log)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=mpirun.env(),
                            start_new_session=True)


def test_a_worker_joins_a_running_job_and_counts_like_any_other(data, tmp_path):
    """`mpiexec -n 1 mpilb join RUN.h5` part-way through a 3-rank run: the joiner's first
    push is applied within 2 s of its admission, both launches exit 0, the run ends
    `finished` with exact coverage; members/ holds the join, per_worker the joiner. (Joins
    of a --wire bf16 run: tests/mpi/test_joining.py, two joins at once.)"""
    log = tmp_path / "run.h5"
    proc = start(3, data, log, 30)
    try:
        mpirun.wait_training(str(log), proc)
        joiner = join(log)
        jcode, jout, jerr = finish(joiner)
        assert jcode == 0, jerr
        assert "mpilb: joined as worker 3" in jerr
    finally:
        code, out, err = finish(proc)
    assert code == 0, err
    attrs, cols = check_finished_exactly(log, data)
    m = cols["members"]
    assert list(m["event"]) == ["join"] and list(m["worker"]) == [3]
    up = cols["updates"]
    first = up["t"][up["worker"] == 3].min()
    assert first - m["t"][0] < 2.0, (first, m["t"][0])
    assert 3 in {w["rank"] for w in attrs["summary"]["per_worker"]}
    assert "a worker joined the run at" in err


def test_mpilb_join_refusals(data, tmp_path):
    """A run that has ended, and a run that takes no joins (--no-join; --servers 2 runs take
    them: test_join_modes.py): one line, exit 2."""
    log = tmp_path / "run.h5"
    proc = start(4, data, log, 12, "--servers", "2", "--no-join")
    try:
        mpirun.wait_training(str(log), proc)
        refused = mpirun.run(1, "join", str(log), timeout=60)
        assert refused.returncode == 2, refused.stderr
        assert "started with --no-join" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    finally:
        code, out, err = finish(proc)
    assert code == 0, err
    ended = mpirun.run(1, "join", str(log), timeout=60)
    assert ended.returncode == 2 and "the run has ended (status finished)" in ended.stderr
