"""Resume matrix: coverage stays exact, proven from the log's logged ranges (updates/lo,hi),
independently of the server's own counters, or the resume is refused with one line.

{fewer epochs, more epochs, other seed, other worker count, other mode} x {MPI, one rank}.
"""

from __future__ import annotations

import hashlib
import shutil

import h5py
import numpy as np
import pytest

import mpirun
from mpirun import recomputed_coverage
from mpilb.runfiles import checkpoint
from mpilb.data.dataset import open_dataset
from mpilb.runfiles.summary import summarize_log

pytestmark = pytest.mark.mpi

RANKS = {"mpi": 4, "one": 1}




def args_for(data, d, *extra):
    return ["train", "--data", data, "--hidden", "16", "--batch", "16", "--no-progress",
            "--log", str(d / "run.h5"), *map(str, extra)]


@pytest.fixture(scope="module", params=sorted(RANKS))
def interrupted(request, digits_dir, tmp_path_factory):
    """A run stopped by --max-seconds part-way through a later epoch."""
    d = tmp_path_factory.mktemp(f"base-{request.param}")
    n = RANKS[request.param]
    res = mpirun.run(n, *args_for(digits_dir, d, "--epochs", 200, "--max-seconds", 1.5),
                     timeout=120)
    assert res.returncode == 0, res.stderr
    ds = open_dataset(digits_dir)
    with h5py.File(d / "run.ckpt.h5", "r") as f:
        epoch, counts = int(f.attrs["epoch"]), f["coverage/counts"][()]
    assert epoch >= 1, "the base run must reach a later epoch (machine too slow?)"
    return request.param, d, epoch, bool(counts.any()), ds


def check_exact(d, ds):
    s = summarize_log(str(d / "run.h5"))
    mine = recomputed_coverage(str(d / "run.h5"), ds.shard_sizes)
    assert mine == s["coverage"], (mine, s["coverage"])
    assert mine["applied"] == mine["expected"] > 0 and mine["duplicates"] == mine["missing"] == 0, mine
    return s


def digest(p):
    return hashlib.sha256(open(p, "rb").read()).hexdigest()


@pytest.mark.parametrize("case", ["fewer-epochs", "more-epochs", "other-seed", "other-workers",
                                  "other-mode"])
def test_resume_matrix(interrupted, case, tmp_path, digits_dir):
    kind, base, epoch, mid_epoch, ds = interrupted
    d = tmp_path / "run"
    shutil.copytree(base, d)
    n = RANKS[kind]
    more = epoch + 2
    if case == "fewer-epochs":
        # stops at once; the checkpoint it ends with must keep the interrupted epoch's counts
        res = mpirun.run(n, *args_for(digits_dir, d, "--epochs", epoch, "--resume"), timeout=60)
        assert res.returncode == 0, res.stderr
        with h5py.File(d / "run.ckpt.h5", "r") as f:
            after = f["coverage/counts"][()]
        with h5py.File(base / "run.ckpt.h5", "r") as f:
            assert np.array_equal(after, f["coverage/counts"][()])
        res = mpirun.run(n, *args_for(digits_dir, d, "--epochs", more, "--resume"), timeout=90)
    elif case == "more-epochs":
        res = mpirun.run(n, *args_for(digits_dir, d, "--epochs", more, "--resume"), timeout=90)
    elif case == "other-seed":
        before = digest(d / "run.h5"), digest(d / "run.ckpt.h5")
        res = mpirun.run(n, *args_for(digits_dir, d, "--epochs", more, "--resume", "--seed", 1),
                         timeout=90)
        if mid_epoch:
            assert res.returncode == 2, res.stderr
            lines = [l for l in (res.stdout + res.stderr).splitlines() if l.strip()]
            assert len(lines) == 1 and "resume with --seed 0" in lines[0], lines
            assert (digest(d / "run.h5"), digest(d / "run.ckpt.h5")) == before
            return
    elif case == "other-workers":   # MPI -> one rank, one rank -> 2 workers
        res = mpirun.run(1 if n > 1 else 3, *args_for(digits_dir, d, "--epochs", more, "--resume"),
                         timeout=90)
    else:
        res = mpirun.run(n, *args_for(digits_dir, d, "--epochs", more, "--resume", "--mode", "sync"),
                         timeout=90)
    assert res.returncode == 0, res.stderr
    s = check_exact(d, ds)
    assert s["epochs_completed"] == more


def test_check_plan_allows_a_new_seed_at_an_epoch_boundary(digits_dir):
    ds = open_dataset(digits_dir)
    counts = np.zeros(sum(ds.shard_sizes), dtype=np.uint16)
    ck = checkpoint.Checkpoint(params=np.zeros(1, np.float32), optimizer={}, version=1, epoch=2,
                               counts=counts, completed=[], balancer={}, train_s=1.0,
                               config={"seed": 0}, plan=checkpoint.plan_signature(0, ds))
    checkpoint.check_plan(ck, 1, ds)          # nothing pending: fine
    counts[5] = 1
    checkpoint.check_plan(ck, 0, ds)
    with pytest.raises(checkpoint.UsageError, match="resume with --seed 0"):
        checkpoint.check_plan(ck, 1, ds)
