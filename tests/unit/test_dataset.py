"""Unit tests for mpilb.data.dataset: writing, opening, verifying and describing datasets."""

import json
import tracemalloc

import h5py
import numpy as np
import pytest

from mpilb.data import dataset as D
from mpilb.data import verified as V
from mpilb.data import prepare as P
from mpilb.errors import DataError, UsageError


def rehash(ds):
    """Recompute the manifest checksums after a test tampered with a file on purpose."""
    path = ds.root / "manifest.json"
    manifest = json.loads(path.read_text())
    for entry in manifest["shards"] + [manifest["test"]]:
        entry["sha256"] = D.sha256_file(ds.root / entry["file"])
    path.write_text(json.dumps(manifest))


def rewrite(path, x=None, y=None):
    """Replace x and/or y of an HDF5 file (any shape and dtype)."""
    with h5py.File(path, "r+") as f:
        for key, value in (("x", x), ("y", y)):
            if value is not None:
                del f[key]
                f.create_dataset(key, data=value)


def edit_manifest(ds, fn):
    path = ds.root / "manifest.json"
    manifest = json.loads(path.read_text())
    fn(manifest)
    path.write_text(json.dumps(manifest))


def read_all(ds):
    xs, ys = [], []
    for i in range(len(ds.shards)):
        with h5py.File(ds.shard_path(i), "r") as f:
            xs.append(f["x"][...])
            ys.append(f["y"][...])
    return np.concatenate(xs), np.concatenate(ys)


# ------------------------------------------------------------------ good datasets


def test_small_dataset_verifies(small_dataset):
    ds = V.verify_dataset(small_dataset.root)
    assert ds.total_samples == 1600 and ds.test_samples == 400
    assert ds.sample_shape == (16,) and ds.num_classes == 4 and ds.dtype == "float32"
    assert ds.format_version == D.FORMAT_VERSION
    assert list(ds.offsets) == [0, 400, 800, 1200]
    assert ds.shard_nbytes(0) == 400 * (16 * 4 + 8)


def test_prepare_digits_round_trip(tmp_path):
    ds = D.prepare_digits(tmp_path / "digits", shards=5, test_fraction=0.25, seed=3)
    ds = V.verify_dataset(ds.root)
    assert ds.num_classes == 10 and ds.sample_shape == (1, 8, 8)
    assert ds.total_samples + ds.test_samples == 1797
    assert ds.test_samples == round(1797 * 0.25)
    x, y = read_all(ds)
    assert x.dtype == np.float32 and x.shape == (ds.total_samples, 1, 8, 8)
    assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() == 1.0
    assert set(np.unique(y)) == set(range(10))
    # Shuffled before sharding: a shard is a mix of classes, not a run of one.
    with h5py.File(ds.shard_path(0), "r") as f:
        assert len(np.unique(f["y"][...])) == 10


def test_synthetic_deterministic_from_seed(tmp_path):
    a = D.prepare_synthetic(tmp_path / "a", 1000, 8, 3, shards=3, seed=7)
    b = D.prepare_synthetic(tmp_path / "b", 1000, 8, 3, shards=3, seed=7)
    c = D.prepare_synthetic(tmp_path / "c", 1000, 8, 3, shards=3, seed=8)
    sums = lambda ds: [s.sha256 for s in ds.shards] + [ds.test_sha256]  # noqa: E731
    assert sums(a) == sums(b)
    assert sums(a) != sums(c)
    assert np.array_equal(read_all(a)[0], read_all(b)[0])


def test_synthetic_classes_balanced_and_learnable(tmp_path):
    from sklearn.linear_model import LogisticRegression

    ds = D.prepare_synthetic(tmp_path / "s", 12000, 32, 10, shards=2, seed=0)
    x, y = read_all(ds)
    freq = np.bincount(y, minlength=10) / len(y)
    assert freq.min() > 0.05 and freq.max() < 0.15
    xt, yt = ds.load_test()
    # Far above chance (0.1): the labels are a function of x a student can learn.
    assert LogisticRegression(max_iter=300).fit(x, y).score(xt, yt) > 0.7


def test_synthetic_noise_replaces_labels(tmp_path):
    clean = D.prepare_synthetic(tmp_path / "a", 4000, 8, 4, shards=2, noise=0.0, seed=1)
    noisy = D.prepare_synthetic(tmp_path / "b", 4000, 8, 4, shards=2, noise=0.5, seed=1)
    (xa, ya), (xb, yb) = read_all(clean), read_all(noisy)
    assert np.array_equal(xa, xb)
    changed = np.mean(ya != yb)
    assert 0.3 < changed < 0.45  # half replaced, a quarter of those by the same label


@pytest.mark.parametrize("samples,shards,test_fraction", [(1003, 7, 0.1), (10, 10, 0.0), (999, 64, 0.3)])
def test_shard_sizes_balanced(tmp_path, samples, shards, test_fraction):
    ds = D.prepare_synthetic(tmp_path / "s", samples, 4, 2, shards=shards, test_fraction=test_fraction)
    assert len(ds.shards) == shards
    assert max(ds.shard_sizes) - min(ds.shard_sizes) <= 1
    assert ds.test_samples == round(samples * test_fraction)
    assert ds.total_samples + ds.test_samples == samples
    assert [s.file for s in ds.shards] == [f"shard-{i:05d}.h5" for i in range(shards)]
    V.verify_dataset(ds.root)


def test_chunked_along_samples(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "CHUNK_BYTES", 1024)
    ds = D.prepare_synthetic(tmp_path / "s", 500, 16, 2, shards=2)
    with h5py.File(ds.shard_path(0), "r") as f:
        assert f["x"].chunks == (1024 // (16 * 4), 16)  # 16 rows of 64 bytes
        assert f["y"].dtype == np.int64 and f["y"].chunks == (16,)
        assert f["x"].compression is None


def test_chunk_rows_capped_by_samples(small_dataset):
    with h5py.File(small_dataset.shard_path(0), "r") as f:
        assert f["x"].chunks == (400, 16)  # 1 MiB would be 16384 rows; the shard has 400


def test_synthetic_generation_is_chunked(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "GEN_CHUNK", 4096)
    samples, features = 400_000, 32
    whole = samples * features * 4  # 51 MB of float32; one block is 0.5 MB
    tracemalloc.start()
    try:
        D.prepare_synthetic(tmp_path / "s", samples, features, 4, shards=8)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < whole / 3, f"peak {peak} bytes vs {whole} for the whole array"


def test_dataset_info(small_dataset):
    text = D.dataset_info(small_dataset.root)
    assert "shards:         4" in text
    assert "train samples:  1600" in text and "test samples:   400" in text
    assert "(16,) float32" in text and "classes:        4" in text
    assert "synthetic" in text and "KiB" in text


def test_rewrite_existing_dataset_allowed(small_dataset):
    ds = D.prepare_synthetic(small_dataset.root, 300, 4, 2, shards=2)
    assert len(ds.shards) == 2
    assert not (ds.root / "shard-00003.h5").exists()


def test_refuses_foreign_nonempty_out(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="notes.txt"):
        D.prepare_synthetic(out, 100, 4, 2, shards=2)
    assert (out / "notes.txt").exists()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(shards=0), "shards"),
        (dict(test_fraction=1.0), "test-fraction"),
        (dict(test_fraction=-0.1), "test-fraction"),
        (dict(features=0), "features"),
        (dict(classes=1), "classes"),
        (dict(samples=5, shards=8), "shards"),
        (dict(noise=1.5), "noise"),
    ],
)
def test_prepare_parameters_validated(tmp_path, kwargs, match):
    args = dict(samples=100, features=4, classes=2, shards=2) | kwargs
    with pytest.raises(UsageError, match=match):
        D.prepare_synthetic(tmp_path / "s", **args)


# ------------------------------------------------------------------ bad datasets


def test_checksum_mismatch_names_file(small_dataset):
    with h5py.File(small_dataset.shard_path(1), "r+") as f:
        f["x"][0, 0] = 123.0
    D.open_dataset(small_dataset.root)  # metadata is still fine
    with pytest.raises(DataError, match=r"shard-00001\.h5: checksum mismatch \(manifest sha256 [0-9a-f]+"):
        V.verify_dataset(small_dataset.root)


def test_missing_shard(small_dataset):
    small_dataset.shard_path(2).unlink()
    with pytest.raises(DataError, match=r"shard-00002\.h5: file is missing"):
        D.open_dataset(small_dataset.root)


def test_truncated_file(small_dataset):
    path = small_dataset.shard_path(1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"shard-00001\.h5: not a readable HDF5 file \(truncated\?\)"):
        D.open_dataset(small_dataset.root)


def test_shape_differs_between_shards(small_dataset):
    rewrite(small_dataset.shard_path(2), x=np.zeros((400, 15), np.float32))
    rehash(small_dataset)
    with pytest.raises(DataError, match=r"shard-00002\.h5: x has shape \(400, 15\)"):
        D.open_dataset(small_dataset.root)


def test_dtype_differs_between_shards(small_dataset):
    rewrite(small_dataset.shard_path(3), x=np.zeros((400, 16), np.float64))
    rehash(small_dataset)
    with pytest.raises(DataError, match=r"shard-00003\.h5: x has dtype float64"):
        D.open_dataset(small_dataset.root)


def test_label_dtype_checked(small_dataset):
    rewrite(small_dataset.shard_path(0), y=np.zeros(400, np.int32))
    with pytest.raises(DataError, match=r"shard-00000\.h5: y has dtype int32"):
        D.open_dataset(small_dataset.root)


def test_labels_out_of_range(small_dataset):
    y = np.zeros(400, np.int64)
    y[17] = 4  # num_classes is 4
    rewrite(small_dataset.shard_path(1), y=y)
    rehash(small_dataset)
    with pytest.raises(DataError, match=r"shard-00001\.h5: label 4 at row 17 is out of range \[0, 4\)"):
        V.verify_dataset(small_dataset.root)


def test_negative_labels(small_dataset):
    y = np.zeros(400, np.int64)
    y[399] = -1
    rewrite(small_dataset.shard_path(0), y=y)
    rehash(small_dataset)
    with pytest.raises(DataError, match=r"shard-00000\.h5: label -1 at row 399"):
        V.verify_dataset(small_dataset.root)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_features(small_dataset, bad):
    x = np.zeros((400, 16), np.float32)
    x[5, 3] = bad
    rewrite(small_dataset.shard_path(2), x=x)
    rehash(small_dataset)
    with pytest.raises(DataError, match=r"shard-00002\.h5: non-finite feature \(NaN or Inf\) at row 5"):
        V.verify_dataset(small_dataset.root)


def test_verify_reads_in_chunks(small_dataset, monkeypatch):
    # Bad row in the last of several check blocks: still found, with its global row index.
    monkeypatch.setattr(V, "CHECK_BYTES", 100 * (16 * 4 + 8))
    x = np.zeros((400, 16), np.float32)
    x[350, 0] = np.nan
    rewrite(small_dataset.shard_path(1), x=x)
    rehash(small_dataset)
    with pytest.raises(DataError, match="at row 350"):
        V.verify_dataset(small_dataset.root)


def test_load_test_validated(small_dataset):
    x, y = small_dataset.load_test()
    assert x.shape == (400, 16) and y.shape == (400,) and y.max() < 4
    bad = x.copy()
    bad[0, 0] = np.nan
    rewrite(small_dataset.test_path, x=bad)
    with pytest.raises(DataError, match=r"test\.h5: non-finite"):
        small_dataset.load_test()


def test_empty_dataset_no_shards(small_dataset):
    edit_manifest(small_dataset, lambda m: m.update(shards=[]))
    with pytest.raises(DataError, match=r"manifest\.json: the dataset has no shards"):
        D.open_dataset(small_dataset.root)


def test_empty_dataset_no_samples(small_dataset):
    def empty(m):
        for s in m["shards"]:
            s["samples"] = 0

    edit_manifest(small_dataset, empty)
    with pytest.raises(DataError, match=r"manifest\.json: the dataset has no samples"):
        D.open_dataset(small_dataset.root, check_files=False)


def test_missing_manifest(small_dataset):
    (small_dataset.root / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"manifest\.json: manifest is missing"):
        D.open_dataset(small_dataset.root)


def test_malformed_manifest_json(small_dataset):
    (small_dataset.root / "manifest.json").write_text('{"format_version": 1,')
    with pytest.raises(DataError, match=r"manifest\.json: malformed JSON"):
        D.open_dataset(small_dataset.root)


@pytest.mark.parametrize("key", ["format_version", "sample_shape", "dtype", "num_classes", "shards", "test"])
def test_manifest_missing_key(small_dataset, key):
    edit_manifest(small_dataset, lambda m: m.pop(key))
    with pytest.raises(DataError, match=rf"manifest\.json: missing key '{key}'"):
        D.open_dataset(small_dataset.root)


def test_manifest_missing_shard_key(small_dataset):
    edit_manifest(small_dataset, lambda m: m["shards"][1].pop("sha256"))
    with pytest.raises(DataError, match=r"manifest\.json: missing key 'sha256'"):
        D.open_dataset(small_dataset.root)


def test_manifest_wrong_type(small_dataset):
    edit_manifest(small_dataset, lambda m: m.update(num_classes="4"))
    with pytest.raises(DataError, match=r"key 'num_classes' must be int, got str"):
        D.open_dataset(small_dataset.root)


def test_manifest_format_version(small_dataset):
    edit_manifest(small_dataset, lambda m: m.update(format_version=2))
    with pytest.raises(DataError, match="format_version 2 is not supported"):
        D.open_dataset(small_dataset.root)


def test_manifest_file_name_must_stay_inside(small_dataset):
    edit_manifest(small_dataset, lambda m: m["shards"][0].update(file="../elsewhere.h5"))
    with pytest.raises(DataError, match="plain file name"):
        D.open_dataset(small_dataset.root)


# ------------------------------------------------------------------ npz


def save_npz(tmp_path, **arrays):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    return path


def test_npz_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.random((300, 3, 2))
    y = np.sort(rng.integers(0, 5, 300))  # sorted: the writer must shuffle
    path = save_npz(tmp_path, feats=x, labels=y)
    ds = D.prepare_npz(path, tmp_path / "out", x_key="feats", y_key="labels", shards=3)
    ds = V.verify_dataset(ds.root)
    assert ds.num_classes == 5 and ds.sample_shape == (3, 2)
    xs, ys = read_all(ds)
    xt, yt = ds.load_test()
    assert xs.dtype == np.float32 and ys.dtype == np.int64
    assert sorted(np.concatenate([ys, yt]).tolist()) == sorted(y.tolist())
    assert not np.all(np.diff(ys) >= 0)  # shuffled
    assert np.allclose(np.sort(np.concatenate([xs, xt]).sum(axis=(1, 2))), np.sort(x.sum(axis=(1, 2))), atol=1e-5)


def test_npz_wrong_keys_lists_keys(tmp_path):
    path = save_npz(tmp_path, data=np.zeros((10, 2)), target=np.zeros(10, int))
    with pytest.raises(DataError, match=r"data\.npz: no array 'x' \(keys in the file: data, target\)"):
        D.prepare_npz(path, tmp_path / "out", shards=2)


def test_npz_mismatched_lengths(tmp_path):
    path = save_npz(tmp_path, x=np.zeros((10, 2)), y=np.zeros(9, int))
    with pytest.raises(DataError, match=r"data\.npz: 'x' has 10 samples but 'y' has 9"):
        D.prepare_npz(path, tmp_path / "out", shards=2)


def test_npz_non_integer_labels(tmp_path):
    path = save_npz(tmp_path, x=np.zeros((10, 2)), y=np.linspace(0, 1, 10))
    with pytest.raises(DataError, match=r"data\.npz: labels 'y' are not integers"):
        D.prepare_npz(path, tmp_path / "out", shards=2, task="classify")


def test_npz_float_targets_make_a_regression_dataset(tmp_path):
    path = save_npz(tmp_path, x=np.zeros((10, 2)), y=np.linspace(0, 1, 10))
    ds = V.verify_dataset(D.prepare_npz(path, tmp_path / "out", shards=2).root)
    assert ds.num_classes == 0 and ds.label_dtype == "float32" and ds.target_shape == ()


def test_npz_negative_labels(tmp_path):
    path = save_npz(tmp_path, x=np.zeros((10, 2)), y=np.arange(10) - 1)
    with pytest.raises(DataError, match=r"data\.npz: negative label -1"):
        D.prepare_npz(path, tmp_path / "out", shards=2)


def test_npz_non_finite_features(tmp_path):
    x = np.zeros((10, 2))
    x[3, 1] = np.nan
    path = save_npz(tmp_path, x=x, y=np.arange(10) % 2)
    with pytest.raises(DataError, match=r"data\.npz: features 'x' contain NaN or Inf"):
        D.prepare_npz(path, tmp_path / "out", shards=2)


def test_npz_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nothere\.npz: file not found"):
        D.prepare_npz(tmp_path / "nothere.npz", tmp_path / "out")


def test_digits_needs_sklearn(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_sklearn(name, *args, **kwargs):
        if name.startswith("sklearn"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sklearn)
    with pytest.raises(UsageError, match="pip install scikit-learn"):
        D.prepare_digits(tmp_path / "d")
