"""--save-best: RUN.best.ckpt.h5 holds the weights of the best evaluation, exported like the
last checkpoint; the run's last lines say where it is and at which update."""

import json

import h5py
import numpy as np

import mpirun
from mpilb.runfiles.best import best_path
from mpilb.runfiles.runlog import read_columns

# lr 0.5 on digits: test accuracy peaks before the last epoch (seed 0: at the 4th of 6)
ARGS = ("--hidden", "32", "--lr", "0.5", "--eval-interval", "100000", "--no-progress")


def _train(digits_dir, log, *extra, n=0):
    res = mpirun.run(n, "train", "--data", digits_dir, *ARGS, "--log", log, *extra, timeout=300)
    assert res.returncode == 0, res.stderr
    return res


def test_best_checkpoint_holds_the_weights_of_the_best_evaluation(digits_dir, tmp_path):
    log = tmp_path / "run.h5"
    res = _train(digits_dir, log, "--epochs", "6", "--save-best")
    _, cols = read_columns(str(log))
    metric, versions, epochs = (cols["eval"][k] for k in ("test_metric", "version", "epoch"))
    k = int(np.argmax(metric))   # (the first of equal ones: a later tie is not "better")
    best = tmp_path / "run.best.ckpt.h5"
    assert best_path(str(tmp_path / "run.ckpt.h5")) == str(best)
    with h5py.File(best, "r") as f:
        info = json.loads(f.attrs["best"])
        best_params = f["params"][()]
    assert info == {"metric": float(metric[k]), "metric_name": "test accuracy",
                    "epoch": int(epochs[k]), "version": int(versions[k])}
    assert res.stdout.strip().splitlines()[-1] == (
        f"mpilb: best test accuracy {metric[k]:.4f} at update {versions[k]} "
        f"(epoch {epochs[k]} in the run log): {best}")
    # the same run stopped after that epoch ends with exactly those weights
    again = tmp_path / "again.h5"
    _train(digits_dir, again, "--epochs", str(int(epochs[k]) + 1))
    with h5py.File(tmp_path / "again.ckpt.h5", "r") as f:
        np.testing.assert_array_equal(f["params"][()], best_params)
    # read like any checkpoint: evaluate reproduces the metric, export writes the weights
    res = mpirun.run(0, "evaluate", best, "--data", digits_dir, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["accuracy"] == metric[k]
    res = mpirun.run(0, "export", best, tmp_path / "w.npz")
    assert res.returncode == 0, res.stderr
    # not a point to resume from (its coverage may be later than its weights)
    res = mpirun.run(0, "train", "--data", digits_dir, *ARGS, "--epochs", "7", "--log", log,
                     "--checkpoint", best, "--resume")
    assert res.returncode == 2 and "--save-best checkpoint" in res.stderr


def test_best_checkpoint_under_mpiexec_matches_its_eval_row(digits_dir, tmp_path):
    log = tmp_path / "run.h5"
    _train(digits_dir, log, "--epochs", "4", "--save-best", "--eval-interval", "0.5", n=3)
    _, cols = read_columns(str(log))
    metric = cols["eval"]["test_metric"]
    with h5py.File(tmp_path / "run.best.ckpt.h5", "r") as f:
        info = json.loads(f.attrs["best"])
    assert info["metric"] == float(np.max(metric))
    assert info["version"] == int(cols["eval"]["version"][int(np.argmax(metric))])
    res = mpirun.run(0, "evaluate", tmp_path / "run.best.ckpt.h5", "--data", digits_dir, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["accuracy"] == float(np.max(metric))
