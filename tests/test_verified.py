"""Start-up checks that scale: a verified file is not hashed again until it changes; a
corrupt chunk of a Fletcher-32 shard fails the read with the shard's name."""

from __future__ import annotations

import json
import os
import shutil
import stat

import h5py
import numpy as np
import pytest

from mpilb import dataset as D
from mpilb import verified as V
from mpilb.errors import DataError
from mpilb.shards import ShardStore


def age(root, seconds=10.0):
    """Make every file look written `seconds` ago (older than the racy window)."""
    for p in root.iterdir():
        st = os.stat(p)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = D.sha256_file

    def spy(path, *a, **kw):
        calls.append(os.path.basename(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(D, "sha256_file", spy)
    return calls


def test_second_start_hashes_nothing(small_dataset, counted):
    root = small_dataset.root
    age(root)
    D.verify_dataset(root, cached=True)
    assert len(counted) == 5                       # 4 shards + test.h5
    assert (root / V.CACHE_NAME).exists()
    counted.clear()
    D.verify_dataset(root, cached=True)
    assert counted == []
    D.verify_dataset(root)                         # `mpilb data verify`: everything, always
    assert len(counted) == 5


def test_changed_file_is_checked_again(small_dataset, counted):
    root = small_dataset.root
    age(root)
    D.verify_dataset(root, cached=True)
    counted.clear()
    shard = root / "shard-00002.h5"
    copy = root / "copy.h5"
    shutil.copy2(shard, copy)                      # same bytes and mtime, new inode
    os.replace(copy, shard)
    D.verify_dataset(root, cached=True)
    assert counted == ["shard-00002.h5"]


def test_fresh_files_are_not_trusted(small_dataset, counted):
    """A file modified within the racy window could change again without a new mtime."""
    root = small_dataset.root                      # just written
    D.verify_dataset(root, cached=True)
    counted.clear()
    D.verify_dataset(root, cached=True)
    assert len(counted) == 5


def test_corruption_after_a_cached_check_is_caught(small_dataset):
    root = small_dataset.root
    age(root)
    D.verify_dataset(root, cached=True)
    with open(root / "shard-00001.h5", "r+b") as fh:   # a change moves mtime on
        fh.seek(-100, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-100, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(DataError, match="shard-00001.h5: checksum mismatch"):
        D.verify_dataset(root, cached=True)


def test_read_only_dataset_records_in_mpilb_cache(small_dataset, tmp_path, monkeypatch, counted):
    if os.geteuid() == 0:
        # root writes through permission bits: make the record beside the dataset unwritable
        monkeypatch.setattr(V, "CACHE_NAME", "manifest.json/verified.json")
    root = small_dataset.root
    age(root)
    monkeypatch.setenv("MPILB_CACHE", str(tmp_path / "cache"))
    mode = os.stat(root).st_mode
    os.chmod(root, stat.S_IRUSR | stat.S_IXUSR)
    try:
        D.verify_dataset(root, cached=True)
        counted.clear()
        D.verify_dataset(root, cached=True)
        assert counted == []
        assert list((tmp_path / "cache" / "verified").glob("*.json"))
    finally:
        os.chmod(root, mode)


def test_garbled_record_means_check_again(small_dataset, counted):
    root = small_dataset.root
    age(root)
    (root / V.CACHE_NAME).write_text("{not json")
    D.verify_dataset(root, cached=True)
    assert len(counted) == 5
    json.loads((root / V.CACHE_NAME).read_text())   # rewritten whole


def test_flipped_byte_in_a_fletcher32_chunk_fails_the_read(small_dataset):
    ds = D.open_dataset(small_dataset.root)
    path = ds.shard_path(1)
    with h5py.File(path, "r") as f:
        x, y = f["x"][()], f["y"][()]
    with h5py.File(path, "w") as f:               # the shard as written with per-chunk checksums
        f.create_dataset("x", data=x, chunks=(64,) + x.shape[1:], fletcher32=True)
        f.create_dataset("y", data=y, chunks=(64,), fletcher32=True)
    with h5py.File(path, "r") as f:
        info = f["x"].id.get_chunk_info(2)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + 17)
        b = fh.read(1)
        fh.seek(info.byte_offset + 17)
        fh.write(bytes([b[0] ^ 0x01]))
    with ShardStore(ds) as store:
        np.testing.assert_array_equal(store.read(1, 0, 64)[0], x[:64])   # other chunks still read
        with pytest.raises(DataError, match=r"shard-00001\.h5: cannot read rows"):
            store.read(1)


def test_a_verified_dataset_can_be_prepared_again_in_place(tmp_path):
    """The checksum record opening a dataset leaves beside it is mpilb's own file: preparing
    into the same directory again replaces the dataset (it was refused as a foreign file)."""
    root = tmp_path / "d"
    D.prepare_synthetic(root, samples=200, features=4, classes=3, shards=2, seed=0)
    age(root)
    D.verify_dataset(root, cached=True)
    assert (root / V.CACHE_NAME).exists()
    D.prepare_synthetic(root, samples=300, features=4, classes=3, shards=3, seed=1)
    ds = D.open_dataset(root)
    assert ds.total_samples == 300 - ds.test_samples and len(ds.shard_sizes) == 3
    assert not (root / V.CACHE_NAME).exists()   # the old record went with the old files
