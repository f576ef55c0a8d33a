"""Hostile inputs and moments of issue 16: each ends promptly, user input with one line and
exit 2, and nothing is destroyed (the rest of the list: test_startup, test_resume,
test_survival)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpirun
from mpilb.runfiles.summary import summarize_log

pytestmark = pytest.mark.mpi


def one_error(res, code, needle):
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    lines = [l for l in (res.stdout + res.stderr).splitlines() if l.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("mpilb: error: ") and needle in lines[0], lines[0]


def make_empty_shard(src, dst, shard=2):
    """A copy of a dataset whose shard `shard` holds no samples (allowed; `data verify` OK)."""
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    entry = m["shards"][shard]
    path = dst / entry["file"]
    with h5py.File(path, "r") as f:
        x, y = f["x"], f["y"]
        specs = [(k, d.shape[1:], d.dtype, d.chunks) for k, d in (("x", x), ("y", y))]
    path.unlink()
    with h5py.File(path, "w") as f:
        for k, shape, dtype, chunks in specs:
            f.create_dataset(k, shape=(0, *shape), maxshape=(None, *shape), dtype=dtype,
                             chunks=chunks)
    entry["samples"] = 0
    entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


@pytest.mark.parametrize("balancer", ["load", "static"])
def test_empty_shard_trains_exactly(digits_dir, tmp_path, balancer):
    data = make_empty_shard(Path(digits_dir), tmp_path / "d")
    assert mpirun.run(0, "data", "verify", str(data)).returncode == 0
    res = mpirun.run(4, "train", "--data", str(data), "--epochs", 3, "--hidden", 16,
                     "--no-progress", "--worker-timeout", 5, "--balancer", balancer,
                     "--log", str(tmp_path / "run.h5"), timeout=60)
    assert res.returncode == 0, res.stderr
    s = summarize_log(str(tmp_path / "run.h5"))
    cov = s["coverage"]
    assert s["lost_workers"] == [] and s["epochs_completed"] == 3
    assert cov["applied"] == cov["expected"] > 0 and cov["duplicates"] == cov["missing"] == 0


# ------------------------------------------------------------------ report on hostile files

@pytest.fixture(scope="module")
def finished_run(digits_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("finished")
    res = mpirun.run(0, "train", "--data", digits_dir, "--epochs", 1, "--hidden", 16,
                     "--no-progress", "--log", str(d / "run.h5"), timeout=60)
    assert res.returncode == 0, res.stderr
    return d


@pytest.mark.parametrize("case", ["truncated", "scrambled", "checkpoint", "shard", "directory",
                                  "plots-onto-file", "plots-unwritable"])
def test_report_on_hostile_files(finished_run, digits_dir, tmp_path, case):
    log = finished_run / "run.h5"
    args = [str(log)]
    if case == "truncated":
        (tmp_path / "t.h5").write_bytes(log.read_bytes()[:3000])
        args, needle = [str(tmp_path / "t.h5")], "not a readable mpilb run log"
    elif case == "scrambled":   # used to hang for many minutes in SWMR checksum retries
        data = bytearray(log.read_bytes())
        rng = np.random.default_rng(1)
        for i in rng.integers(100, len(data), 2000):
            data[i] ^= 0xFF
        (tmp_path / "s.h5").write_bytes(bytes(data))
        args, needle = [str(tmp_path / "s.h5")], "s.h5"
    elif case == "checkpoint":
        args, needle = [str(finished_run / "run.ckpt.h5")], "not an mpilb run log: an mpilb checkpoint"
    elif case == "shard":
        args, needle = [os.path.join(digits_dir, "shard-00000.h5")], "not an mpilb run log"
    elif case == "directory":
        args, needle = [str(finished_run)], "is a directory"
    elif case == "plots-onto-file":
        (tmp_path / "f").write_text("x")
        args += ["--plots", str(tmp_path / "f")]
        needle = "--plots"
    else:
        args += ["--plots", "/proc/mpilb-plots"]
        needle = "--plots /proc/mpilb-plots"
    one_error(mpirun.run(0, "report", *args, timeout=30), 2, needle)


def test_empty_test_set_gives_null_accuracy(tmp_path):
    data = tmp_path / "d"
    assert mpirun.run(0, "prepare", "synthetic", str(data), "--samples", 300, "--features", 4,
                      "--classes", 3, "--shards", 2, "--test-fraction", 0).returncode == 0
    res = mpirun.run(0, "train", "--data", str(data), "--epochs", 1, "--hidden", 8,
                     "--no-progress", "--log", str(tmp_path / "run.h5"), timeout=60)
    assert res.returncode == 0, res.stderr
    assert "test accuracy n/a" in res.stdout
    out = mpirun.run(0, "report", str(tmp_path / "run.h5"), "--json").stdout
    assert "NaN" not in out and json.loads(out)["final_test_accuracy"] is None


def test_data_given_a_file_and_corrupt_npz(tmp_path):
    np.savez(tmp_path / "good.npz", x=np.zeros((20, 3), np.float32), y=np.zeros(20, np.int64))
    good = (tmp_path / "good.npz").read_bytes()
    (tmp_path / "bad.npz").write_bytes(good[: len(good) // 2])
    one_error(mpirun.run(0, "train", "--data", str(tmp_path / "good.npz"), "--no-progress",
                         timeout=60), 2, "is a file, not a dataset directory")
    one_error(mpirun.run(0, "prepare", "npz", str(tmp_path / "bad.npz"), str(tmp_path / "o")),
              2, "not a readable .npz")


# ------------------------------------------------------------------ checkpoints

@pytest.mark.parametrize("damage", ["json", "nan"])
def test_damaged_checkpoint_is_refused_at_resume(finished_run, digits_dir, tmp_path, damage):
    shutil.copy(finished_run / "run.h5", tmp_path / "run.h5")
    shutil.copy(finished_run / "run.ckpt.h5", tmp_path / "run.ckpt.h5")
    with h5py.File(tmp_path / "run.ckpt.h5", "r+") as f:
        if damage == "json":
            f.attrs["balancer"] = '{"name": "load", "rates": [1, 2'
        else:
            f["params"][7] = np.nan
    res = mpirun.run(4, "train", "--data", digits_dir, "--epochs", 3, "--hidden", 16,
                     "--no-progress", "--log", str(tmp_path / "run.h5"), "--resume", timeout=60)
    one_error(res, 2, "damaged" if damage == "json" else "non-finite parameter")


FULL_DISK = textwrap.dedent("""
    import os, resource, signal, sys
    import numpy as np
    from mpilb.runfiles import checkpoint
    from mpilb.core.balancer import build_balancer
    from mpilb.config.build import build_config
    from mpilb.data.dataset import open_dataset
    from mpilb.models import build_model
    from mpilb.core.optimizers import build_optimizer
    from mpilb.run.session import balancer_config
    from mpilb.core.epochs import EpochTracker
    data, out = sys.argv[1], sys.argv[2]
    ds = open_dataset(data)
    cfg = build_config({}, {"hidden": "256,256"})
    model = build_model("mlp", tuple(ds.sample_shape), ds.num_classes, (256, 256))
    tracker = EpochTracker(ds.shard_sizes)
    tracker.begin(0, 0.0)
    kw = dict(cfg=cfg, model=model, dataset=ds, params=model.init_params(0),
              optimizer=build_optimizer("adam", model.num_params, lr=0.1), version=1, epoch=0,
              tracker=tracker, balancer=build_balancer("load", [1], ds.shard_sizes,
              balancer_config(cfg)), train_s=1.0, run_id="0" * 32)
    checkpoint.save(out, **kw)
    # a writer killed mid-write left its temp file behind
    open(os.path.join(os.path.dirname(out), "." + os.path.basename(out) + ".tmp999999"), "wb").write(b"x" * 1000)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a full disk: writes past the limit fail
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))
    try:
        checkpoint.save(out, **kw)
    except checkpoint.MpilbError as exc:
        print("ERROR", exc)
    print(sorted(os.listdir(os.path.dirname(out))))
""")


def test_full_disk_during_checkpoint_is_clean(digits_dir, tmp_path):
    (tmp_path / "fd.py").write_text(FULL_DISK)
    os.mkdir(tmp_path / "ck")
    out = tmp_path / "ck" / "c.h5"
    # (the script's directory comes first on its sys.path: name the tree under test)
    res = subprocess.run([sys.executable, str(tmp_path / "fd.py"), digits_dir, str(out)],
                         capture_output=True, text=True, timeout=60,
                         env=mpirun.env(PYTHONPATH=Path(__file__).resolve().parents[2]))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("ERROR --checkpoint") and "previous checkpoint is intact" in lines[0]
    assert lines[1] == "['c.h5']"   # no temp of ours, and the dead writer's temp is gone
    with h5py.File(out, "r") as f:
        assert f.attrs["version"] == 1


# ------------------------------------------------------------------ signals at odd moments

def test_sigterm_just_after_finished_exits_0(digits_dir, tmp_path):
    cmd = mpirun.mpilb_cmd(4, "train", "--data", digits_dir, "--epochs", 1, "--hidden", 16,
                           "--no-progress", "--log", str(tmp_path / "run.h5"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpirun.env(), start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("mpilb: finished"):
                os.kill(proc.pid, signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert summarize_log(str(tmp_path / "run.h5"))["status"] == "finished"


def test_sigterm_with_a_hung_worker_exits_0_preempted(synth_dir, tmp_path):
    cmd = mpirun.mpilb_cmd(4, "train", "--data", synth_dir, "--epochs", 100, "--hidden", 16,
                           "--no-progress", "--log", str(tmp_path / "run.h5"),
                           "--inject", "2:hang@0.5", "--worker-timeout", 3)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpirun.env(), start_new_session=True)
    try:
        t0 = time.monotonic()
        while not (tmp_path / "run.h5").exists() and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        time.sleep(1.5)
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    s = summarize_log(str(tmp_path / "run.h5"))
    assert s["status"] == "preempted" and s["lost_workers"] == [2]
    assert (tmp_path / "run.ckpt.h5").exists()
