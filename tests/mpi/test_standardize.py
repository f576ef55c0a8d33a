"""`mpilb prepare csv|npz|hdf5 ... --standardize`: statistics of the training shards in the
manifest, every split written standardized; a one-line warning for unscaled data."""

import json
from pathlib import Path

import numpy as np
import pytest

import mpirun
from mpilb.data.dataset import open_dataset
from mpilb.data.verified import verify_dataset
from mpilb.runfiles.runlog import read_columns

ROOT = Path(__file__).resolve().parents[2]


def _raw_npz(path, n=600, regression=False):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 3)) * [1.0, 50.0, 0.01] + [0.0, 1000.0, 5.0]
    x[:, 2] = 7.0 if regression else x[:, 2]      # (a constant feature: std 1)
    y = (x[:, 0] * 40 + 300) if regression else (x[:, 0] > 0).astype(np.int64)
    np.savez(path, x=x.astype(np.float32), y=y.astype(np.float32 if regression else np.int64))
    return path


def _prepare(*args):
    res = mpirun.run(0, "prepare", *args, timeout=120)
    assert res.returncode == 0, res.stderr
    return res


@pytest.mark.parametrize("regression", [False, True])
def test_statistics_from_training_shards_apply_to_every_split(tmp_path, regression):
    src = _raw_npz(tmp_path / "raw.npz", regression=regression)
    _prepare("npz", src, tmp_path / "raw", "--shards", "3")
    res = _prepare("npz", src, tmp_path / "std", "--shards", "3", "--standardize")
    assert "standardized" in res.stdout and "mpilb: warning" not in res.stderr
    raw, std = open_dataset(tmp_path / "raw"), verify_dataset(tmp_path / "std")   # checksums
    train = [raw.load_file(s.file, s.samples) for s in raw.shards]
    x = np.concatenate([t[0] for t in train]).astype(np.float64)
    mean, sd = x.mean(axis=0), x.std(axis=0)
    sd[sd == 0] = 1.0
    stats = std.standardize["features"]
    np.testing.assert_allclose(stats["mean"], mean, rtol=1e-6)
    np.testing.assert_allclose(stats["std"], sd, rtol=1e-5)
    for a, b in [(raw.load_file(s.file, s.samples), std.load_file(s.file, s.samples))
                 for s in raw.shards] + [(raw.load_test(), std.load_test())]:
        np.testing.assert_allclose(b[0], (a[0] - mean) / sd, rtol=1e-4, atol=1e-4)
        if not regression:
            np.testing.assert_array_equal(b[1], a[1])          # labels untouched
    if regression:
        y = np.concatenate([t[1] for t in train]).astype(np.float64)
        assert std.standardize["targets"]["mean"] == pytest.approx([y.mean()])
        np.testing.assert_allclose(std.load_test()[1], (raw.load_test()[1] - y.mean()) / y.std(),
                                   rtol=1e-4, atol=1e-4)
        assert "standardized units" in res.stdout
        res = _prepare("npz", src, tmp_path / "feat", "--shards", "3", "--standardize", "features")
        assert list(open_dataset(tmp_path / "feat").standardize) == ["features"]


def test_unscaled_data_is_one_warning_at_prepare_and_train(tmp_path, digits_dir):
    src = _raw_npz(tmp_path / "raw.npz")
    res = _prepare("npz", src, tmp_path / "raw", "--shards", "2")
    warnings = [ln for ln in res.stderr.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "features look unscaled (feature 1" in warnings[0]
    assert "--standardize" in warnings[0]
    res = mpirun.run(0, "train", "--data", tmp_path / "raw", "--epochs", "1", "--no-progress",
                     "--log", tmp_path / "r.h5", "--model", "softmax")
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("features look unscaled") == 1
    res = mpirun.run(0, "train", "--data", digits_dir, "--epochs", "1", "--no-progress",
                     "--log", tmp_path / "d.h5", "--model", "softmax")
    assert res.returncode == 0 and "unscaled" not in res.stderr


def _csv(frame, path):
    frame.to_csv(path, index=False)
    return path


def _final(log):
    attrs, _ = read_columns(str(log))
    return json.loads(attrs["summary"]) if isinstance(attrs["summary"], str) else attrs["summary"]


def test_breast_cancer_standardized_reaches_095(tmp_path):
    datasets = pytest.importorskip("sklearn.datasets")
    pytest.importorskip("pandas")
    src = _csv(datasets.load_breast_cancer(as_frame=True).frame, tmp_path / "bc.csv")
    res = _prepare("csv", src, tmp_path / "raw", "--target", "target", "--shards", "4")
    assert "features look unscaled" in res.stderr
    _prepare("csv", src, tmp_path / "bc", "--target", "target", "--shards", "4", "--standardize")
    res = mpirun.run(0, "train", "--data", tmp_path / "bc", "--epochs", "10", "--no-progress",
                     "--log", tmp_path / "bc.h5", timeout=300)
    assert res.returncode == 0, res.stderr
    assert _final(tmp_path / "bc.h5")["final_test_accuracy"] >= 0.95


def test_diabetes_standardized_reaches_r2_03(tmp_path):
    pytest.importorskip("torch")
    datasets = pytest.importorskip("sklearn.datasets")
    pytest.importorskip("pandas")
    frame = datasets.load_diabetes(as_frame=True, scaled=False).frame   # raw features, targets
    src = _csv(frame, tmp_path / "diabetes.csv")
    _prepare("csv", src, tmp_path / "dia", "--target", "target", "--shards", "4", "--standardize")
    res = mpirun.run(0, "train", "--data", tmp_path / "dia", "--epochs", "15", "--no-progress",
                     "--model", f"{ROOT}/examples/regression.py:Regressor", "--lr", "0.01",
                     "--log", tmp_path / "dia.h5", timeout=300)
    assert res.returncode == 0, res.stderr
    assert _final(tmp_path / "dia.h5")["final_test_metric"] >= 0.3
