"""Unit tests for mpilb.data.shards.ShardReader: reads, permutations, prefetch and cache."""

import threading
import time

import h5py
import numpy as np
import pytest

from mpilb.errors import DataError
from mpilb.data.shards import ShardData, ShardReader


def file_rows(ds, shard):
    with h5py.File(ds.shard_path(shard), "r") as f:
        return f["x"][...], f["y"][...]


@pytest.fixture
def reader(small_dataset):
    s = ShardReader(small_dataset, seed=5)
    yield s
    s.close()


def wait_for_reads(reader, count, timeout=5.0):
    """Wait until the background thread has finished `count` loads (read time recorded)."""
    deadline = time.monotonic() + timeout
    while reader.loads_done < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reader.loads_done >= count
    time.sleep(0.05)  # the future is marked done just after load() returns


def test_read_ranges_in_file_order(reader, small_dataset):
    x, y = file_rows(small_dataset, 1)
    xr, yr = reader.read(1, 10, 50)
    assert np.array_equal(xr, x[10:50]) and np.array_equal(yr, y[10:50])
    xa, ya = reader.read(1)
    assert np.array_equal(xa, x) and np.array_equal(ya, y)
    xe, ye = reader.read(1, 400, 400)
    assert xe.shape == (0, 16) and ye.shape == (0,)


@pytest.mark.parametrize("lo,hi", [(-1, 5), (5, 4), (0, 401)])
def test_read_rejects_bad_range(reader, lo, hi):
    with pytest.raises(IndexError):
        reader.read(0, lo, hi)


def test_permutation_deterministic(small_dataset):
    a, b, c = (ShardReader(small_dataset, seed=s) for s in (5, 5, 6))
    try:
        p = a.permutation(3, 2)
        assert np.array_equal(p, b.permutation(3, 2))
        assert np.array_equal(p, np.random.default_rng([5, 3, 2]).permutation(400))
        assert np.array_equal(np.sort(p), np.arange(400))
        assert not np.array_equal(p, a.permutation(4, 2))
        assert not np.array_equal(p, a.permutation(3, 1))
        assert not np.array_equal(p, c.permutation(3, 2))
    finally:
        for s in (a, b, c):
            s.close()


def test_load_positions_follow_permutation(reader, small_dataset):
    x, y = file_rows(small_dataset, 3)
    data = reader.load(2, 3)
    perm = reader.permutation(2, 3)
    assert (data.epoch, data.shard, len(data)) == (2, 3, 400)
    assert np.array_equal(data.x, x[perm]) and np.array_equal(data.y, y[perm])
    assert data.nbytes == 400 * 16 * 4 + 400 * 8


def test_prefetch_same_data_and_no_wait_when_finished(reader):
    reader.prefetch(1, 0)
    wait_for_reads(reader, 1)
    data, waited = reader.get(1, 0)
    assert waited == 0.0
    fresh = reader.load(1, 0)
    assert np.array_equal(data.x, fresh.x) and np.array_equal(data.y, fresh.y)


def test_get_waits_for_unfinished_prefetch(small_dataset):
    with ShardReader(small_dataset, io_delay=lambda nbytes, elapsed: 0.3) as reader:
        reader.prefetch(0, 1)
        data, waited = reader.get(0, 1)
        assert 0.15 < waited < 2.0
        assert reader.read_seconds_total >= 0.3
        assert data.shard == 1


def test_get_without_prefetch_counts_read_time(small_dataset):
    with ShardReader(small_dataset, io_delay=lambda nbytes, elapsed: 0.1) as reader:
        data, waited = reader.get(0, 2)
        assert waited >= 0.1 and data.epoch == 0


def test_io_delay_sees_bytes_read(small_dataset):
    seen = []
    with ShardReader(small_dataset, io_delay=lambda nbytes, elapsed: seen.append((nbytes, elapsed)) or 0.0) as reader:
        reader.read(0, 0, 100)
    assert seen[0][0] == 100 * (16 * 4 + 8) and seen[0][1] >= 0


def test_cache_serves_repeats_and_evicts_oldest(small_dataset):
    reads = []
    with ShardReader(small_dataset, io_delay=lambda n, e: reads.append(n) or 0.0, cache_size=2) as reader:
        first, _ = reader.get(0, 0)
        again, waited = reader.get(0, 0)
        assert again is first and waited == 0.0 and len(reads) == 1
        reader.get(0, 1)
        reader.get(0, 2)  # evicts (0, 0)
        reader.get(0, 0)
        assert len(reads) == 4


def test_prefetch_of_cached_shard_reads_nothing(small_dataset):
    reads = []
    with ShardReader(small_dataset, io_delay=lambda n, e: reads.append(n) or 0.0) as reader:
        reader.get(0, 0)
        reader.prefetch(0, 0)
        reader.get(0, 0)
        assert len(reads) == 1


def test_prefetch_exception_reraised(small_dataset):
    def failing(nbytes, elapsed):
        raise RuntimeError("simulated storage failure")

    with ShardReader(small_dataset, io_delay=failing) as reader:
        reader.prefetch(0, 1)
        with pytest.raises(RuntimeError, match="simulated storage failure"):
            reader.get(0, 1)


def test_prefetch_data_error_names_file(small_dataset):
    x, y = file_rows(small_dataset, 2)
    y[7] = 9  # out of range for 4 classes
    with h5py.File(small_dataset.shard_path(2), "r+") as f:
        f["y"][...] = y
    with ShardReader(small_dataset) as reader:
        reader.prefetch(0, 2)
        with pytest.raises(DataError, match=r"shard-00002\.h5: label 9 at row 7"):
            reader.get(0, 2)


def test_read_validates_features(small_dataset):
    with h5py.File(small_dataset.shard_path(0), "r+") as f:
        f["x"][12, 0] = np.inf
    with ShardReader(small_dataset) as reader:
        reader.read(0, 0, 12)  # the bad row is not in this range
        with pytest.raises(DataError, match=r"shard-00000\.h5: non-finite feature .* row 12"):
            reader.read(0, 10, 20)


def test_read_missing_shard_names_file(small_dataset):
    small_dataset.shard_path(3).unlink()
    with ShardReader(small_dataset) as reader:
        with pytest.raises(DataError, match=r"shard-00003\.h5: file is missing"):
            reader.read(3)


def test_file_handles_kept_open(reader):
    reader.read(0, 0, 10)
    handle = reader._files[0]
    reader.read(0, 10, 20)
    assert reader._files[0] is handle


def test_put_inserts_received_data(reader):
    data = ShardData(4, 1, np.zeros((3, 16), np.float32), np.zeros(3, np.int64))
    reader.put(data)
    got, waited = reader.get(4, 1)
    assert got is data and waited == 0.0


def test_concurrent_get_and_prefetch_consistent(reader):
    results = {}

    def get():
        results["a"] = reader.get(0, 3)[0]

    reader.prefetch(0, 3)
    t = threading.Thread(target=get)
    t.start()
    results["b"] = reader.load(0, 3)
    t.join(5)
    assert np.array_equal(results["a"].x, results["b"].x)


def test_close_idempotent_and_final(small_dataset):
    reader = ShardReader(small_dataset)
    reader.read(0, 0, 5)
    reader.close()
    reader.close()
    with pytest.raises(RuntimeError, match="closed"):
        reader.prefetch(0, 0)


def test_shard_files_opened_without_chunk_cache(reader):
    """Training reads each chunk once: the reader's files get no chunk cache (its setup cost
    page faults and CPU at every shard's first read, for nothing reused)."""
    reader.read(0)
    assert reader._files[0].id.get_access_plist().get_cache()[2] == 0
