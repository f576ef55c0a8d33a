"""``mpilb prepare csv|npz|hdf5 ... --standardize``: features (and regression targets) scaled
to mean 0 and standard deviation 1, with statistics from the training shards only.

The data on disk is standardized, every split alike: training, validation (shards held out
by --validation-fraction) and test.h5, so that training, ``mpilb evaluate`` and the test rows
of a run all read it as it is, at no cost per read. The statistics are in the manifest
(``standardize``: ``features`` and ``targets``, each ``{"mean": [...], "std": [...]}``, one
value per feature in C order): new inputs for an exported model are ``(x - mean) / std``,
and its predictions of standardized targets are in standardized units,
``y = prediction * std + mean``. A feature constant over the training shards gets std 1.

Without it, :func:`unscaled` looks at a few thousand rows (prepare, and `mpilb train` start-up)
and says in one line when features or targets look unscaled.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import h5py
import numpy as np

from mpilb.data.dataset import MANIFEST, Dataset, open_dataset, sha256_file

BLOCK_BYTES = 1 << 24   # rows read (and rewritten) at a time
PROBE_ROWS = 4096       # rows the unscaled check looks at
SPREAD = 100.0          # a feature 100x larger than the median one, or values over 100


def _blocks(n: int, row_bytes: int):
    step = max(1, BLOCK_BYTES // max(1, row_bytes))
    for lo in range(0, n, step):
        yield lo, min(n, lo + step)


def split_stats(ds: Dataset, key: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-value mean and std (float64, flat) of ``key`` ("x" or "y") over the training
    shards, in one blockwise pass (shifted sums: no cancellation for large means)."""
    shift = total = squares = None
    count = 0
    for i in range(len(ds.shards)):
        with h5py.File(ds.shard_path(i), "r") as f:
            data = f[key]
            n = data.shape[0]
            width = int(np.prod(data.shape[1:], dtype=np.int64))
            for lo, hi in _blocks(n, 8 * width):
                block = np.asarray(data[lo:hi], np.float64).reshape(hi - lo, width)
                if shift is None:
                    shift, total, squares = block[0].copy(), np.zeros(width), np.zeros(width)
                block -= shift
                total += block.sum(axis=0)
                squares += np.square(block).sum(axis=0)
                count += hi - lo
    if not count:
        raise ValueError("no training samples")
    mean = total / count
    var = np.maximum(squares / count - np.square(mean), 0.0)
    std = np.sqrt(var)
    std[std == 0] = 1.0
    return mean + shift, std


def standardize_dataset(ds: Dataset, targets: bool = True) -> Dataset:
    """Standardize ``ds`` in place on disk (features; with `targets`, also regression
    targets), record the statistics and the new checksums in its manifest; returns it
    reopened. Classification labels are never touched."""
    stats = {"x": split_stats(ds, "x")}
    if targets and ds.regression:
        stats["y"] = split_stats(ds, "y")
    files = [s.file for s in ds.shards] + [ds.test_file]
    digests = {}
    for name in files:
        path = ds.root / name
        with h5py.File(path, "r+") as f:
            for key, (mean, std) in stats.items():
                data = f[key]
                shape = data.shape[1:]
                m, s = mean.reshape(shape), std.reshape(shape)
                for lo, hi in _blocks(data.shape[0], 4 * max(1, mean.size)):
                    data[lo:hi] = ((data[lo:hi] - m) / s).astype(data.dtype)
        digests[name] = sha256_file(path)
    manifest_path = ds.root / MANIFEST
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    for entry in manifest["shards"] + [manifest["test"]]:
        entry["sha256"] = digests[entry["file"]]
    names = {"x": "features", "y": "targets"}
    manifest["standardize"] = {names[k]: {"mean": m.tolist(), "std": s.tolist()}
                               for k, (m, s) in stats.items()}
    tmp = manifest_path.with_name(MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, manifest_path)
    return open_dataset(ds.root, check_files=False)


def _spread(mean: np.ndarray, std: np.ndarray) -> Optional[tuple[int, float, float]]:
    """(index, size, median size) of the largest feature when it looks unscaled, where a
    feature's size is |mean| + std; None when the features look scaled."""
    size = np.abs(mean) + std
    live = np.flatnonzero(std > 0)
    if not live.size:
        return None
    top = int(live[np.argmax(size[live])])
    median = float(np.median(size[live]))
    if size[top] > SPREAD or size[top] > SPREAD * median:
        return top, float(size[top]), median
    return None


def unscaled(ds: Dataset) -> Optional[str]:
    """One line saying that ``ds``'s features (or regression targets) look unscaled, from
    the first rows of shard 0, or None (also for a standardized dataset)."""
    if getattr(ds, "standardize", None) or not getattr(ds, "shards", None):
        return None   # (and stand-ins for a dataset: bench's, tests')
    x, y = ds.first_rows(PROBE_ROWS)
    x = np.asarray(x, np.float64).reshape(len(x), -1)
    if not len(x):
        return None
    said = []
    found = _spread(x.mean(axis=0), x.std(axis=0))
    if found is not None:
        said.append(f"features look unscaled (feature {found[0]}: |mean|+std {found[1]:.3g}, "
                    f"the median feature's {found[2]:.3g})")
    if ds.regression:
        y = np.asarray(y, np.float64).reshape(len(y), -1)
        size = float((np.abs(y.mean(axis=0)) + y.std(axis=0)).max())
        if size > SPREAD:
            said.append(f"targets look unscaled (|mean|+std {size:.3g})")
    if not said:
        return None
    return f"{ds.root}: {' and '.join(said)}; prepare it again with --standardize (docs/data.md)"


def describe(ds: Dataset) -> str:
    """The prepare line's note on what --standardize did."""
    what = "features and targets" if "targets" in ds.standardize else "features"
    note = (f"{ds.root}: {what} standardized with the training shards' mean and std "
            f"(manifest key 'standardize')")
    if "targets" in ds.standardize:
        note += "; predictions are in standardized units: y = prediction * std + mean"
    return note
