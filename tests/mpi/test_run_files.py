"""A run's files can be trusted: a checkpoint is data (it never names code that runs), it
belongs to one run (an id in log and checkpoint, checked on --resume), one run writes it,
and a log that is damaged or deleted is never silently replaced by an empty one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import h5py
import numpy as np
import pytest

import mpirun
from mpilb.errors import UsageError
from mpilb.runfiles.summary import summarize_log
from mpilb.runfiles.runlog import RunLog

pytestmark = pytest.mark.mpi


def train_args(data, log, *extra):
    return ["train", "--data", data, "--hidden", "16", "--batch", "16", "--no-progress",
            "--log", str(log), *map(str, extra)]


@pytest.fixture(scope="module")
def finished(digits_dir, tmp_path_factory):
    """A short one-rank run: its log and checkpoint."""
    d = tmp_path_factory.mktemp("finished")
    res = mpirun.run(0, *train_args(digits_dir, d / "a.h5", "--epochs", 2), timeout=120)
    assert res.returncode == 0, res.stderr
    return d / "a.h5", d / "a.ckpt.h5"


def one_line_error(res, pattern: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and pattern in lines[0], res.stderr


# ------------------------------------------------------------------ a checkpoint runs no code

def edited_checkpoint(src, dst, marker) -> None:
    shutil.copy(src, dst)
    with h5py.File(dst, "a") as f:
        cfg = json.loads(f.attrs["config"])
        cfg["model"] = "os:system"
        cfg["model_arg"] = [f"command=\"touch {marker}\""]
        f.attrs["config"] = json.dumps(cfg)


@pytest.mark.parametrize("command", ["evaluate", "export-pt", "export-npz", "load"])
def test_an_edited_checkpoint_naming_code_is_refused_and_runs_nothing(finished, tmp_path,
                                                                      digits_dir, command):
    ckpt, marker = tmp_path / "evil.ckpt.h5", tmp_path / "ran"
    edited_checkpoint(finished[1], ckpt, marker)
    if command == "evaluate":
        res = mpirun.run(0, "evaluate", ckpt, "--data", digits_dir)
        one_line_error(res, "the run trained the user model os:system; a checkpoint's own model "
                            "name is never imported: name the model yourself with --model")
    elif command == "export-npz":    # needs no model: the arrays by name
        res = mpirun.run(0, "export", ckpt, tmp_path / "w.npz")
        assert res.returncode == 0, res.stderr
    elif command == "export-pt":     # not a torch model's checkpoint: refused, nothing run
        res = mpirun.run(0, "export", ckpt, tmp_path / "w.pt")
        assert res.returncode == 2, res.stderr
    else:
        from mpilb.runfiles.export import UntrustedModel, build_from_checkpoint, read_checkpoint

        with pytest.raises(UntrustedModel):
            build_from_checkpoint(read_checkpoint(ckpt))
    assert not marker.exists()


def test_a_torch_checkpoint_naming_code_exports_its_arrays_without_running_it(tmp_path, digits_dir):
    """The .pt export of a torch run rebuilds the module only when the user names it;
    otherwise the state_dict comes from the arrays' names, and nothing the file names runs."""
    pytest.importorskip("torch")
    from mpilb.runfiles.export import export

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = mpirun.run(0, "train", "--data", digits_dir, "--no-progress", "--log", tmp_path / "t.h5",
                     "--epochs", 1, "--model", os.path.join(root, "examples", "torch_mlp.py") + ":MLP",
                     timeout=180)
    assert res.returncode == 0, res.stderr
    marker = tmp_path / "ran"
    with h5py.File(tmp_path / "t.ckpt.h5", "a") as f:
        cfg = json.loads(f.attrs["config"])
        cfg["model"], cfg["model_arg"] = "os:system", [f"command=\"touch {marker}\""]
        f.attrs["config"] = json.dumps(cfg)
    line = export(tmp_path / "t.ckpt.h5", tmp_path / "t.pt")
    assert "torch state_dict" in line and not marker.exists()


def test_a_run_log_naming_code_is_not_imported_by_simulate(finished, tmp_path):
    from mpilb.simulate.replay import _params

    marker = tmp_path / "ran"
    assert _params({"model": "os:system", "model_arg": [f"command=\"touch {marker}\""]},
                   dataset=object()) is None
    assert not marker.exists()


# ------------------------------------------------------------------ a checkpoint is one run's

def test_the_log_and_checkpoint_of_a_run_share_its_id(finished):
    log, ckpt = finished
    with h5py.File(log, "r") as f, h5py.File(ckpt, "r") as g:
        assert len(f.attrs["run_id"]) == 32 and f.attrs["run_id"] == g.attrs["run_id"]


def test_resume_with_another_runs_checkpoint_is_refused(finished, tmp_path, digits_dir):
    """`--resume --log b.h5 --checkpoint a.ckpt.h5` (and `--overwrite` leaving A's
    checkpoint behind B's log) no longer continue B from A's weights."""
    res = mpirun.run(0, *train_args(digits_dir, tmp_path / "b.h5", "--epochs", 2), timeout=120)
    assert res.returncode == 0, res.stderr
    before = (tmp_path / "b.h5").read_bytes()
    res = mpirun.run(0, *train_args(digits_dir, tmp_path / "b.h5", "--epochs", 4, "--resume",
                                    "--checkpoint", finished[1]), timeout=120)
    one_line_error(res, f"--resume: the checkpoint {finished[1]} was written by another run "
                        f"than the log {tmp_path / 'b.h5'}")
    assert (tmp_path / "b.h5").read_bytes() == before   # nothing lost


def test_overwrite_removes_the_replaced_runs_checkpoint_at_once(tmp_path):
    log, ckpt = tmp_path / "r.h5", tmp_path / "r.ckpt.h5"
    with h5py.File(ckpt, "w") as f:
        f.attrs["format"], f.attrs["model"] = 1, "{}"
    other = tmp_path / "notes.h5"   # the user's own file there is kept
    with h5py.File(other, "w") as f:
        f["x"] = np.zeros(3)
    RunLog(str(log), {"run_id": "b"}, checkpoint=str(ckpt)).close("finished")
    assert not ckpt.exists()
    RunLog(str(log), {"run_id": "c"}, checkpoint=str(other)).close("finished")
    assert other.exists()


def test_two_runs_naming_one_checkpoint_cannot_both_run(tmp_path):
    ckpt = str(tmp_path / "shared.ckpt.h5")
    first = RunLog(str(tmp_path / "a.h5"), {"run_id": "a"}, checkpoint=ckpt)
    with pytest.raises(UsageError, match="--checkpoint .*shared.ckpt.h5: another mpilb run is "
                                         "writing this checkpoint now"):
        RunLog(str(tmp_path / "b.h5"), {"run_id": "b"}, checkpoint=ckpt)
    first.close("finished")
    first.write_summary({})
    assert os.listdir(tmp_path) == ["a.h5"]   # no lock file left, no empty log for b
    RunLog(str(tmp_path / "b.h5"), {"run_id": "b"}, checkpoint=ckpt).close("finished")


def test_a_checkpoint_left_without_its_log_keeps_its_number(tmp_path):
    from mpilb.runfiles.paths import next_run_log

    (tmp_path / "003.ckpt.h5").write_bytes(b"weights")
    assert os.path.basename(next_run_log(str(tmp_path))) == "004.h5"


# ------------------------------------------------------------------ damaged or deleted logs

def test_resume_from_a_truncated_or_missing_log_is_refused(finished, tmp_path, digits_dir):
    log, ckpt = tmp_path / "a.h5", tmp_path / "a.ckpt.h5"
    shutil.copy(finished[1], ckpt)
    data = finished[0].read_bytes()
    log.write_bytes(data[: len(data) // 3])
    res = mpirun.run(0, *train_args(digits_dir, log, "--epochs", 6, "--resume"), timeout=120)
    one_line_error(res, f"--resume: the run log {log} is damaged")
    assert log.stat().st_size == len(data) // 3 and ckpt.exists()
    log.unlink()
    res = mpirun.run(0, *train_args(digits_dir, log, "--epochs", 6, "--resume"), timeout=120)
    one_line_error(res, f"--resume: the run log {log} does not exist")
    assert not log.exists()


def test_a_log_deleted_during_the_run_is_written_back(tmp_path):
    log = tmp_path / "run.h5"
    rl = RunLog(str(log), {"run_id": "x"})
    rl.append("epochs", epoch=0, t_start=0.0, t_end=1.0, samples=10)
    rl.flush()
    log.unlink()
    rl.append("epochs", epoch=1, t_start=1.0, t_end=2.0, samples=10)
    rl.close("finished")
    with h5py.File(log, "r") as f:
        assert list(f["epochs/epoch"][()]) == [0, 1] and f.attrs["status"] == "finished"


def training(data, log, *extra) -> subprocess.Popen:
    """A 3-rank run started in the background, returned once it has trained a while."""
    proc = subprocess.Popen(mpirun.mpilb_cmd(3, *train_args(data, log, *extra)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpirun.env())
    deadline = time.monotonic() + 60
    while not log.exists() or log.stat().st_size < 20000:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    time.sleep(1.0)
    return proc


def test_a_log_deleted_mid_run_still_ends_with_its_epochs(tmp_path, digits_dir):
    log = tmp_path / "run.h5"
    proc = training(digits_dir, log, "--epochs", 200, "--max-seconds", 4)
    log.unlink()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "was deleted or replaced during the run; written again" in err
    summary = summarize_log(str(log))
    assert summary["epochs_completed"] >= 1 and summary["coverage"]["missing"] == 0


# ------------------------------------------------------------------ Ctrl-C stops like SIGTERM

def test_ctrl_c_checkpoints_and_the_run_resumes(tmp_path, digits_dir):
    log = tmp_path / "run.h5"
    proc = training(digits_dir, log, "--epochs", 400)
    proc.send_signal(signal.SIGINT)   # what a terminal's Ctrl-C sends mpiexec
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "interrupted (Ctrl-C): checkpointing and stopping" in err and "preemption" not in err
    with h5py.File(log, "r") as f:
        assert f.attrs["status"] == "preempted"
    assert (tmp_path / "run.ckpt.h5").exists()
    res = mpirun.run(3, *train_args(digits_dir, log, "--epochs", 6, "--resume"), timeout=120)
    assert res.returncode == 0, res.stderr


# ------------------------------------------------------------------ the log's disk full

@pytest.fixture
def full_disk(tmp_path):
    """A 400 kB tmpfs for the log (needs root; skipped otherwise)."""
    d = tmp_path / "full"
    d.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a small tmpfs for the log needs root and mount")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(d)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    yield d
    for _ in range(20):
        if subprocess.run(["umount", str(d)], capture_output=True).returncode == 0:
            break
        time.sleep(0.25)


@pytest.mark.parametrize("ranks", [0, 3])
def test_a_full_log_disk_still_checkpoints_and_the_run_resumes(full_disk, tmp_path, digits_dir, ranks):
    log, ckpt = full_disk / "run.h5", tmp_path / "c.ckpt.h5"
    res = mpirun.run(ranks, *train_args(digits_dir, log, "--epochs", 100, "--checkpoint", ckpt),
                     timeout=120)
    assert res.returncode == 1, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("mpilb:") or "Traceback" in ln]
    assert len(lines) == 1, res.stderr
    assert (f"--log {log}: cannot write the run log (No space left on device" in lines[0]
            and f"the checkpoint {ckpt} holds the run's weights" in lines[0]), lines[0]
    with h5py.File(ckpt, "r") as f:
        assert f["params"].shape[0] > 0
    moved = tmp_path / "run.h5"   # space freed: the log moved to a disk with room
    shutil.copy(log, moved)
    res = mpirun.run(ranks, *train_args(digits_dir, moved, "--epochs", 100, "--checkpoint", ckpt,
                                        "--resume"), timeout=120)
    assert res.returncode == 0, res.stderr
    s = summarize_log(str(moved))
    assert s["epochs_completed"] == 100 and s["coverage"]["missing"] == 0
