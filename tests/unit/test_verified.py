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

from mpilb.data import dataset as D
from mpilb.data import verified as V
from mpilb.errors import DataError
from mpilb.data.shards import ShardReader


def age(root, seconds=10.0):
    """Make every file look written `seconds` ago (older than the racy window)."""
    for p in root.iterdir():
        st = os.stat(p)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = V.sha256_file

    def spy(path, *a, **kw):
        calls.append(os.path.basename(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(V, "sha256_file", spy)
    return calls


def test_second_start_hashes_nothing(small_dataset, counted):
    root = small_dataset.root
    age(root)
    V.verify_dataset(root, cached=True)
    assert len(counted) == 5                       # 4 shards + test.h5
    assert (root / V.CACHE_NAME).exists()
    counted.clear()
    V.verify_dataset(root, cached=True)
    assert counted == []
    V.verify_dataset(root)                         # `mpilb data verify`: everything, always
    assert len(counted) == 5


def test_changed_file_is_checked_again(small_dataset, counted):
    root = small_dataset.root
    age(root)
    V.verify_dataset(root, cached=True)
    counted.clear()
    shard = root / "shard-00002.h5"
    copy = root / "copy.h5"
    shutil.copy2(shard, copy)                      # same bytes and mtime, new inode
    os.replace(copy, shard)
    V.verify_dataset(root, cached=True)
    assert counted == ["shard-00002.h5"]


def test_fresh_files_are_not_trusted(small_dataset, counted):
    """A file modified within the racy window could change again without a new mtime."""
    root = small_dataset.root                      # just written
    V.verify_dataset(root, cached=True)
    counted.clear()
    V.verify_dataset(root, cached=True)
    assert len(counted) == 5


def test_corruption_after_a_cached_check_is_caught(small_dataset):
    root = small_dataset.root
    age(root)
    V.verify_dataset(root, cached=True)
    with open(root / "shard-00001.h5", "r+b") as fh:   # a change moves mtime on
        fh.seek(-100, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-100, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(DataError, match="shard-00001.h5: checksum mismatch"):
        V.verify_dataset(root, cached=True)


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
        V.verify_dataset(root, cached=True)
        counted.clear()
        V.verify_dataset(root, cached=True)
        assert counted == []
        assert list((tmp_path / "cache" / "verified").glob("*.json"))
    finally:
        os.chmod(root, mode)


def test_garbled_record_means_check_again(small_dataset, counted):
    root = small_dataset.root
    age(root)
    (root / V.CACHE_NAME).write_text("{not json")
    V.verify_dataset(root, cached=True)
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
    with ShardReader(ds) as reader:
        np.testing.assert_array_equal(reader.read(1, 0, 64)[0], x[:64])   # other chunks still read
        with pytest.raises(DataError, match=r"shard-00001\.h5: cannot read rows"):
            reader.read(1)


def test_a_verified_dataset_can_be_prepared_again_in_place(tmp_path):
    """The checksum record opening a dataset leaves beside it is mpilb's own file: preparing
    into the same directory again replaces the dataset (it was refused as a foreign file)."""
    root = tmp_path / "d"
    D.prepare_synthetic(root, samples=200, features=4, classes=3, shards=2, seed=0)
    age(root)
    V.verify_dataset(root, cached=True)
    assert (root / V.CACHE_NAME).exists()
    D.prepare_synthetic(root, samples=300, features=4, classes=3, shards=3, seed=1)
    ds = D.open_dataset(root)
    assert ds.total_samples == 300 - ds.test_samples and len(ds.shard_sizes) == 3
    assert not (root / V.CACHE_NAME).exists()   # the old record went with the old files


# ---------------------------------------------------------------- node-local copies (--store local)
def test_each_other_nodes_first_rank_checks_the_shards_placed_on_its_node():
    from mpilb.worker.node_copies import shards_to_verify
    from mpilb.data.shards import placement

    hosts = ["n0", "n0", "n1", "n1", "n2"]   # rank 0 and worker 1 on n0
    workers = [1, 2, 3, 4]
    p = placement(8, workers, 2, hosts)
    assert shards_to_verify(hosts, 0, workers, 2, 8) == []   # rank 0 checked n0's files
    assert shards_to_verify(hosts, 1, workers, 2, 8) == []   # n0 again
    assert shards_to_verify(hosts, 3, workers, 2, 8) == []   # not n1's first rank
    assert shards_to_verify(hosts, 2, workers, 2, 8) == sorted(
        s for s, c in p.items() if {2, 3} & set(c))
    assert shards_to_verify(hosts, 4, workers, 2, 8) == sorted(s for s, c in p.items() if 4 in c)
    assert shards_to_verify(["h"] * 5, 2, workers, 2, 8) == []   # one node


def test_a_node_copy_from_another_seed_is_refused_naming_node_rank_and_file(tmp_path, counted):
    """A node's copy of a shard that differs from what rank 0 verified (here: the same
    dataset prepared with another seed) is one line naming rank, node and file (exit 2);
    the node's own manifest, which matches its copy, is not what it is checked against."""
    from mpilb.worker.node_copies import verify_node_copies

    ref = D.prepare_synthetic(tmp_path / "ref", samples=600, features=8, classes=3, shards=3, seed=0)
    files = [(s.file, s.samples, s.sha256) for s in ref.shards]
    node = tmp_path / "node"
    shutil.copytree(tmp_path / "ref", node)
    other = D.prepare_synthetic(tmp_path / "other", samples=600, features=8, classes=3, shards=3,
                                seed=1)
    shutil.copy(tmp_path / "other" / other.shards[1].file, node / other.shards[1].file)
    shutil.copy(tmp_path / "other" / "manifest.json", node / "manifest.json")
    age(node)
    verify_node_copies(str(node), files, [0, 2], ["n0", "n0", "n1"], 2)   # good copies pass
    with pytest.raises(DataError) as err:
        verify_node_copies(str(node), files, [0, 1], ["n0", "n0", "n1"], 2)
    text = str(err.value)
    assert text.startswith(f"rank 2 on node n1: {node / files[1][0]}: checksum mismatch "
                           f"(manifest sha256 {files[1][2][:12]}..."), text
    assert "not the file rank 0 checked on node n0" in text and "\n" not in text
    # the passed copies are recorded: the next start hashes only what failed
    counted.clear()
    with pytest.raises(DataError):
        verify_node_copies(str(node), files, [0, 1, 2], ["n0", "n0", "n1"], 2)
    assert counted == [files[1][0]]
