"""Issue 32, items 13-15: bad input ends with one line naming the file or option and exit 2
(not a traceback), outputs never replace a file unasked nor write through a link, and the
messages say the real problem. More hostile cases: test_hostile.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpirun
from test_hostile import FULL_DISK, one_error

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def run_dir(digits_dir, tmp_path_factory):
    """A finished one-epoch serial run on digits: run.h5 and run.ckpt.h5."""
    d = tmp_path_factory.mktemp("refusals")
    res = mpirun.run(0, "train", "--data", digits_dir, "--epochs", 1, "--hidden", 16,
                     "--no-progress", "--log", str(d / "run.h5"), timeout=60)
    assert res.returncode == 0, res.stderr
    return d


# ------------------------------------------------------------------ item 13: exit codes
@pytest.mark.parametrize("where", ["missing", "unwritable"])
def test_export_into_a_missing_or_unwritable_directory(run_dir, tmp_path, where):
    out = tmp_path / "no" / "w.npz" if where == "missing" else Path("/proc/mpilb-w.npz")
    res = mpirun.run(0, "export", str(run_dir / "run.ckpt.h5"), str(out))
    one_error(res, 2, str(out))


def test_report_on_a_log_whose_coverage_is_null(run_dir, tmp_path):
    shutil.copy(run_dir / "run.h5", tmp_path / "run.h5")
    with h5py.File(tmp_path / "run.h5", "r+") as f:
        f.attrs["coverage"] = "null"   # a run that ended before it was counted
    res = mpirun.run(0, "report", str(tmp_path / "run.h5"), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["coverage"] == dict(expected=0, applied=0, duplicates=0, missing=0)
    res = mpirun.run(0, "report", str(tmp_path / "run.h5"))
    assert res.returncode == 0 and "coverage: 0/0 applied" in res.stdout, res.stderr


@pytest.mark.parametrize("scalar", ["x", "y"])
def test_prepare_npz_with_a_0d_array(tmp_path, scalar):
    arrays = dict(x=np.zeros((20, 3), np.float32), y=np.arange(20) % 2)
    arrays[scalar] = np.asarray(arrays[scalar].ravel()[0])
    np.savez(tmp_path / "a.npz", **arrays)
    res = mpirun.run(0, "prepare", "npz", str(tmp_path / "a.npz"), str(tmp_path / "out"))
    one_error(res, 2, f"'{scalar}' is a single value")


@pytest.mark.parametrize("where", ["cli", "toml"])
def test_an_integer_option_past_32_bits(digits_dir, tmp_path, where):
    args = ["train", "--data", digits_dir, "--no-progress", "--log", str(tmp_path / "r.h5")]
    if where == "cli":
        args += ["--batch", 3000000000]
    else:
        (tmp_path / "c.toml").write_text("batch = 3000000000\n")
        args.insert(1, str(tmp_path / "c.toml"))
    res = mpirun.run(4, *args, timeout=60)
    one_error(res, 2, "--batch = 3000000000" if where == "cli" else "c.toml: batch = 3000000000")
    assert not (tmp_path / "r.h5").exists()


@pytest.mark.parametrize("array", ["coverage/counts", "params"])
def test_resume_from_a_checkpoint_with_arrays_of_the_wrong_length(run_dir, digits_dir, tmp_path,
                                                                   array):
    for name in ("run.h5", "run.ckpt.h5"):
        shutil.copy(run_dir / name, tmp_path / name)
    with h5py.File(tmp_path / "run.ckpt.h5", "r+") as f:
        values = f[array][()]
        del f[array]
        f[array] = values[:-5]
    res = mpirun.run(4, "train", "--data", digits_dir, "--epochs", 2, "--hidden", 16,
                     "--no-progress", "--log", str(tmp_path / "run.h5"), "--resume", timeout=60)
    one_error(res, 2, f"{tmp_path / 'run.ckpt.h5'} is damaged: {array} holds")


# ------------------------------------------------------------------ item 14: overwrites
def test_export_refuses_an_existing_file_unless_overwrite(run_dir, tmp_path):
    ckpt, out = str(run_dir / "run.ckpt.h5"), tmp_path / "w.npz"
    out.write_bytes(b"mine")
    one_error(mpirun.run(0, "export", ckpt, str(out)), 2, "--overwrite")
    assert out.read_bytes() == b"mine"
    res = mpirun.run(0, "export", ckpt, str(out), "--overwrite")
    assert res.returncode == 0, res.stderr
    assert len(np.load(out).files) == 4   # the mlp's weights and biases


def _link_to_a_file_of_the_user(directory: Path, name: str) -> Path:
    target = directory.parent / f"{directory.name}-precious"
    target.write_text("precious")
    (directory / name).symlink_to(target)
    return target


@pytest.mark.parametrize("command", ["export", "csv", "plots"])
def test_outputs_replace_a_symlink_instead_of_writing_through_it(run_dir, tmp_path, command):
    out = tmp_path / "out"
    out.mkdir()
    name = {"export": "w.npz", "csv": "updates.csv", "plots": "loss.png"}[command]
    target = _link_to_a_file_of_the_user(out, name)
    if command == "export":
        args = ["export", str(run_dir / "run.ckpt.h5"), str(out / name), "--overwrite"]
    else:
        args = ["report", str(run_dir / "run.h5"), f"--{command}", str(out)]
    res = mpirun.run(0, *args, timeout=60)
    assert res.returncode == 0, res.stderr
    assert target.read_text() == "precious"
    assert not (out / name).is_symlink() and (out / name).stat().st_size > 0
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]   # no temp left


# ------------------------------------------------------------------ item 15: messages
def test_a_test_file_that_is_also_a_shard(digits_dir, tmp_path):
    data = tmp_path / "d"
    shutil.copytree(digits_dir, data)
    m = json.loads((data / "manifest.json").read_text())
    m["test"] = dict(m["shards"][0])
    (data / "manifest.json").write_text(json.dumps(m))
    needle = "the test set's file shard-00000.h5 is also shard 0"
    one_error(mpirun.run(0, "data", "verify", str(data)), 2, needle)
    res = mpirun.run(4, "train", "--data", str(data), "--no-progress", "--log",
                     str(tmp_path / "r.h5"), timeout=60)
    one_error(res, 2, needle)
    assert "log" not in res.stderr.split(needle)[1]


def test_resume_with_another_validation_fraction_names_both(run_dir, digits_dir, tmp_path):
    for name in ("run.h5", "run.ckpt.h5"):
        shutil.copy(run_dir / name, tmp_path / name)
    res = mpirun.run(4, "train", "--data", digits_dir, "--epochs", 2, "--hidden", 16,
                     "--no-progress", "--log", str(tmp_path / "run.h5"), "--resume",
                     "--validation-fraction", 0.25, timeout=60)
    one_error(res, 2, "was written with --validation-fraction 0 (0 of 8 shards held out); "
                      "this run gives 0.25 (2 held out)")


def test_simulate_from_a_checkpoint_names_the_log(run_dir):
    res = mpirun.run(0, "simulate", "--from", str(run_dir / "run.ckpt.h5"))
    one_error(res, 2, f"an mpilb checkpoint, not a run log; give the run's log ({run_dir / 'run.h5'})")


def test_full_disk_on_the_first_checkpoint_says_there_is_none(digits_dir, tmp_path):
    first = FULL_DISK.replace("checkpoint.save(out, **kw)\n", "", 1)   # no earlier checkpoint
    (tmp_path / "fd.py").write_text(first)
    os.mkdir(tmp_path / "ck")
    res = subprocess.run([sys.executable, str(tmp_path / "fd.py"), digits_dir,
                          str(tmp_path / "ck" / "c.h5")],
                         capture_output=True, text=True, timeout=60,
                         env=mpirun.env(PYTHONPATH=Path(__file__).resolve().parents[2]))
    assert res.returncode == 0, res.stderr
    line = res.stdout.splitlines()[0]
    assert line.startswith("ERROR --checkpoint") and "intact" not in line
    assert "no checkpoint was written before this one" in line


def test_a_toml_config_with_a_utf8_bom_is_read(digits_dir, tmp_path):
    (tmp_path / "c.toml").write_bytes(b"\xef\xbb\xbfepochs = 1\nhidden = \"16\"\n")
    res = mpirun.run(0, "train", str(tmp_path / "c.toml"), "--data", digits_dir, "--no-progress",
                     "--log", str(tmp_path / "r.h5"), timeout=60)
    assert res.returncode == 0, res.stderr
    with h5py.File(tmp_path / "r.h5", "r") as f:
        assert json.loads(f.attrs["config"])["epochs"] == 1
