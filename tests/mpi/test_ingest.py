"""Bringing data in (mpilb.data.ingest): npz (memory-mapped), HDF5 and CSV; float targets; errors
that name the file, line and column; memory that stays flat as the input grows."""

import csv
import sys
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _runs import load_arrays  # noqa: E402

from mpilb.data import ingest  # noqa: E402
from mpilb.data import prepare  # noqa: E402
from mpilb.data.verified import verify_dataset  # noqa: E402
from mpilb.errors import DataError  # noqa: E402


def read_all(ds):
    """Every row of a dataset, training shards then the test set: (x, y)."""
    x, y, xt, yt = load_arrays(ds)
    return np.concatenate([x, xt]), np.concatenate([y, yt])


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_regression_targets_kept_and_shards_checksummed(tmp_path, save):
    rng = np.random.default_rng(0)
    x = rng.random((500, 3))
    y = np.sort(rng.random((500, 2)) * 100, axis=0)   # sorted: the writer must shuffle
    save(tmp_path / "r.npz", x=x, y=y)
    ds = verify_dataset(ingest.prepare_npz(tmp_path / "r.npz", tmp_path / "out", shards=3).root)
    assert ds.num_classes == 0 and ds.target_shape == (2,) and ds.label_dtype == "float32"
    xs, ys = read_all(ds)
    assert ys.dtype == np.float32 and ys.shape == (500, 2)
    np.testing.assert_allclose(np.sort(ys[:, 0]), np.sort(y[:, 0]).astype(np.float32))
    assert not np.all(np.diff(ys[:400, 0]) >= 0)
    with h5py.File(ds.shard_path(0), "r") as f:
        assert f["x"].fletcher32 and f["y"].fletcher32


def test_npz_streams_with_flat_memory(tmp_path, monkeypatch):
    """Peak traced memory writing an 8x larger npz stays about the same (one block)."""
    monkeypatch.setattr(prepare, "BLOCK_BYTES", 4096 * 32 * 4)
    peaks = []
    for rows in (40_000, 320_000):
        path = tmp_path / f"{rows}.npz"
        rng = np.random.default_rng(0)
        np.savez(path, x=rng.standard_normal((rows, 32), dtype=np.float32), y=rng.integers(0, 5, rows))
        tracemalloc.start()
        try:
            ingest.prepare_npz(path, tmp_path / f"out{rows}", shards=4)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    whole = 320_000 * 32 * 4
    # the constant part is mostly the 4 MiB read blocks of the checksums
    assert peaks[1] < whole / 3 and peaks[1] < 1.6 * peaks[0], peaks


def test_hdf5_files_concatenated(tmp_path):
    for i, n in enumerate((120, 80)):
        with h5py.File(tmp_path / f"{i}.h5", "w") as f:
            f["feat"] = np.full((n, 2, 2), i, dtype=np.float64)
            f["lab"] = np.arange(n) % 3
    ds = ingest.prepare_hdf5([tmp_path / "0.h5", tmp_path / "1.h5"], tmp_path / "out", "feat", "lab", shards=2)
    xs, ys = read_all(verify_dataset(ds.root))
    assert ds.num_classes == 3 and ds.sample_shape == (2, 2) and len(ys) == 200
    assert (xs[:, 0, 0] == 1).sum() == 80
    with pytest.raises(DataError, match=r"0\.h5: no dataset 'x' \(datasets in the file: feat, lab\); use --x-key"):
        ingest.prepare_hdf5([tmp_path / "0.h5"], tmp_path / "o2", "x", "lab")


def write_csv(tmp_path, text):
    path = tmp_path / "d.csv"
    path.write_text(text)
    return path


def test_csv_classes_regression_and_feature_selection(tmp_path):
    rows = "\n".join(f"{i * 0.5},{i % 7},{-i},{i % 3}" for i in range(60))
    path = write_csv(tmp_path, "a,b,c,label\n" + rows + "\n")
    ds = ingest.prepare_csv(path, tmp_path / "c", target="label", shards=2)
    assert ds.num_classes == 3 and ds.sample_shape == (3,)
    ds = ingest.prepare_csv(path, tmp_path / "r", target="c,label", features="a", shards=2)
    assert ds.num_classes == 0 and ds.target_shape == (2,) and ds.sample_shape == (1,)
    xs, ys = read_all(verify_dataset(ds.root))
    np.testing.assert_allclose(ys[:, 0], -2 * xs[:, 0])


@pytest.mark.parametrize("text,kwargs,message", [
    ("a,b,y\n1,2,0\n", {"target": "price"}, r"no column 'price' \(columns: a, b, y\); check --target"),
    ("a,b,y\n1,2,0\n", {"target": "y", "features": "a,z"}, r"no column 'z' .*check --features"),
    ("a,b,y\n1,2,0\n3,abc,1\n", {"target": "y"}, r"line 3, column 'b': 'abc' is not a number"),
    ("a,b,y\n1,2,0\n3,,1\n", {"target": "y"}, r"line 3, column 'b': an empty cell"),
    ("a,b,y\n1,2,0\n3,4\n", {"target": "y"}, r"line 3: 2 cells, the header has 3"),
    ("a,b,y\n", {"target": "y"}, r"no data rows"),
    # the line of the bad row itself, whatever blank lines follow it in the same block
    ("a,b,y\n1,x,0\n\n3,4,1\n", {"target": "y"}, r"line 2, column 'b': 'x' is not a number"),
    ("a,b,y\n\n1,2,0\n\n\n3,4,1.5e\n", {"target": "y"}, r"line 6, column 'y': '1.5e' is not"),
])
def test_csv_errors_name_line_and_column(tmp_path, text, kwargs, message):
    with pytest.raises(DataError, match=r"d\.csv: " + message):
        ingest.prepare_csv(write_csv(tmp_path, text), tmp_path / "out", **kwargs)


def test_csv_blocks_bound_cells_not_rows_and_do_not_change_the_data(tmp_path, monkeypatch):
    """A wide file parses a few rows at a time; the dataset is the same whatever the block
    size, and a bad cell in a later block still names its own line (blank lines, a quoted
    cell over two lines)."""
    rows = "\n".join(f"{i * 0.5},{i % 7},{-i},{i % 3}" + ("\n" if i % 9 == 0 else "")
                     for i in range(60))
    path = write_csv(tmp_path, "a,b,c,label\n" + rows + "\n")
    whole = read_all(verify_dataset(ingest.prepare_csv(path, tmp_path / "w", target="label").root))
    monkeypatch.setattr(ingest, "CSV_BLOCK_CELLS", 9)   # 2 rows of 4 cells per block
    small = read_all(verify_dataset(ingest.prepare_csv(path, tmp_path / "s", target="label").root))
    for a, b in zip(whole, small):
        np.testing.assert_array_equal(a, b)
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        next(reader)
        assert {len(rows) for rows, _ in ingest._csv_blocks(path, reader, 4)} == {2}
    text = 'a,b,y\n1,2,0\n\n"3\n",4,1\n5,6,0\n7,8,1\n\n9,oops,0\n'
    with pytest.raises(DataError, match=r"d\.csv: line 9, column 'b': 'oops' is not a number"):
        ingest.prepare_csv(write_csv(tmp_path, text), tmp_path / "bad", target="y")


def test_csv_error_from_the_command_line_is_one_line_exit_2(tmp_path):
    import mpirun

    path = write_csv(tmp_path, "a,b,y\n1,2,0\n3,x,1\n")
    res = mpirun.run(0, "prepare", "csv", path, tmp_path / "out", "--target", "y")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1
    assert "d.csv: line 3, column 'b': 'x' is not a number" in lines[0]


def test_take_rows_reads_a_mapped_array_like_fancy_indexing(tmp_path):
    a = np.arange(5000 * 6, dtype=np.float32).reshape(5000, 6)
    np.save(tmp_path / "a.npy", a)
    m = np.load(tmp_path / "a.npy", mmap_mode="r")
    idx = np.random.default_rng(0).permutation(5000)[:700]
    for view in (m, m[7:], m[:, 2], m[:, 2][:, None]):
        np.testing.assert_array_equal(prepare.take_rows(view, idx[idx < len(view)]),
                                      np.asarray(view)[idx[idx < len(view)]])
