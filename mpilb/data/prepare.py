"""Writing datasets: every ``mpilb prepare`` source, all through :func:`write_dataset`.

The format is docs/data.md's dataset directory and HDF5 layout; :mod:`mpilb.data.dataset` reads and verifies it.
Writers stream: whatever the input's size, one block of rows and one open output file are in
memory at a time.
"""

from __future__ import annotations

import datetime as _dt
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import h5py
import numpy as np

from mpilb.data.dataset import _SHARD_RE, MANIFEST, TARGET_DTYPE, TEST_FILE, FORMAT_VERSION, X_DTYPE, Y_DTYPE, Dataset, check_values, open_dataset, sha256_file
from mpilb.errors import DataError, UsageError
from mpilb.data.verified import CACHE_NAME as VERIFIED_CACHE

# Rows generated (or copied) per step when writing: large enough to amortise HDF5 calls,
# small enough that a 1e6 x 128 dataset never sits in memory at once.
GEN_CHUNK = 65536
# Target HDF5 chunk size along samples: ~1 MiB of x rows per chunk.
CHUNK_BYTES = 1 << 20
# Rows per shuffled block of a user's arrays: about this many bytes (a few copies of a block
# are alive at once), at most GEN_CHUNK rows.
BLOCK_BYTES = 4 << 20
# Largest number of units the shuffle permutes (see :func:`array_chunks`): 512 KiB of indices.
MAX_BLOCKS = 65536

def shard_file_name(i: int) -> str:
    return f"shard-{i:05d}.h5"


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes that differ by at most one (larger first)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _prepare_out_dir(out: Path) -> None:
    """Create OUT, or clear the files of a previous mpilb dataset in it.

    A non-empty directory holding anything else is refused: writing there could mix
    a user's files with ours or, worse, delete them.
    """
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a directory; choose another OUT")
    if out.is_dir():
        entries = list(out.iterdir())
        # (the record of verified checksums that opening the dataset left beside it, too)
        ours = {MANIFEST, MANIFEST + ".tmp", TEST_FILE, VERIFIED_CACHE}
        foreign = [e.name for e in entries if not (e.name in ours or _SHARD_RE.match(e.name)) or e.is_dir()]
        if foreign:
            raise UsageError(
                f"{out}: directory is not empty and is not an mpilb dataset (found {foreign[0]!r}); "
                "choose an empty or new OUT"
            )
        # Manifest first: an interrupted rewrite must not look like a valid dataset.
        for e in sorted(entries, key=lambda e: e.name != MANIFEST):
            e.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _validate_split(samples: int, shards: int, test_fraction: float) -> tuple[int, list[int]]:
    if not isinstance(shards, (int, np.integer)) or shards < 1:
        raise UsageError(f"--shards must be >= 1, got {shards}")
    if not 0 <= test_fraction < 1:
        raise UsageError(f"--test-fraction must be in [0, 1), got {test_fraction}")
    n_test = int(round(samples * test_fraction))
    n_train = samples - n_test
    if n_train < shards:
        raise UsageError(
            f"{samples} samples leave {n_train} for training, fewer than --shards {shards}; "
            "use fewer shards or more samples"
        )
    return n_test, split_sizes(n_train, shards)


def _create_xy(f: h5py.File, n: int, sample_shape: tuple[int, ...], y_dtype: str = Y_DTYPE,
               target_shape: tuple[int, ...] = ()):
    """``x`` and ``y`` chunked along samples, each chunk with a Fletcher-32 checksum that
    HDF5 verifies on every read (a flipped bit is an error, not a wrong sample)."""
    row_bytes = int(np.prod(sample_shape, dtype=np.int64)) * 4
    rows = max(1, min(n, CHUNK_BYTES // row_bytes))
    # a chunked layout needs at least one row; an empty file gets a 1-row chunk
    x = f.create_dataset("x", (n, *sample_shape), dtype=X_DTYPE, chunks=(rows, *sample_shape),
                         maxshape=(None, *sample_shape) if not n else None,
                         fletcher32=True, track_times=False)
    y = f.create_dataset("y", (n, *target_shape), dtype=y_dtype, chunks=(rows, *target_shape),
                         maxshape=(None, *target_shape) if not n else None,
                         fletcher32=True, track_times=False)
    return x, y


def write_dataset(
    out,
    chunks: Iterable[tuple[np.ndarray, np.ndarray]],
    samples: int,
    sample_shape: tuple[int, ...],
    num_classes: int,
    shards: int = 8,
    test_fraction: float = 0.2,
    seed: int = 0,
    generator: dict | None = None,
    target_shape: tuple[int, ...] | None = None,
) -> Dataset:
    """Write a dataset from a stream of sample blocks; the writer all ``prepare_*`` share.

    The stream is cut in order: the first rows fill shard 0, the next shard 1, and so on,
    the last ``round(samples * test_fraction)`` rows go to ``test.h5``; shard sizes differ
    by at most one. Only one block and one open file are in memory at a time. The source
    does the shuffling, seeded: :func:`array_chunks` permutes in-memory arrays, and
    synthetic samples are independent draws, so any cut of the stream is a random split.

    Args:
        out: output directory; created, or cleared if it holds an older mpilb dataset.
        chunks: ``(x, y)`` blocks with ``samples`` rows in total; x castable to float32
            with rows of ``sample_shape``, y integer labels in ``[0, num_classes)`` or, for
            regression, float targets of ``target_shape`` per row.
        samples: total rows the blocks deliver (train + test).
        sample_shape: shape of one sample.
        num_classes: number of classes (labels are checked against it); 0 for float targets.
        shards: number of shard files.
        test_fraction: fraction of samples for ``test.h5``.
        seed: recorded in the manifest (the source used it to shuffle).
        generator: provenance recorded in the manifest.
        target_shape: regression only: ``()`` for one target per sample, ``(k,)`` for k.

    Returns:
        The written :class:`Dataset`, as :func:`open_dataset` reads it back.

    Raises:
        UsageError: bad parameters or a non-empty OUT that is not an mpilb dataset.
        DataError: a block with a bad shape, label or non-finite feature.
    """
    out = Path(out)
    sample_shape = tuple(int(d) for d in sample_shape)
    regression = num_classes == 0
    target_shape = tuple(int(d) for d in (target_shape or ())) if regression else ()
    y_dtype = TARGET_DTYPE if regression else Y_DTYPE
    if not regression and num_classes < 2:
        raise UsageError(f"need at least 2 classes, got {num_classes}")
    n_test, sizes = _validate_split(samples, shards, test_fraction)
    _prepare_out_dir(out)

    # The stream fills shard 0, then shard 1, ..., then the test file: one file open at a
    # time and whole-chunk writes, so memory does not grow with the number of shards.
    counts = sizes + [n_test]
    names = [shard_file_name(i) for i in range(shards)] + [TEST_FILE]
    entries: list[dict] = []
    k, filled = -1, 0  # current file and rows written to it
    f = target = None
    pos = 0

    def finish(f):
        f.close()
        entries.append({"file": names[k], "samples": int(counts[k]), "sha256": sha256_file(out / names[k])})

    try:
        for x, y in chunks:
            x = np.asarray(x, dtype=X_DTYPE)
            y = np.asarray(y, dtype=y_dtype) if regression else np.asarray(y)
            n = len(y)
            if x.shape != (n, *sample_shape):
                raise DataError(f"{out}: block of shape {x.shape} does not match samples {(n, *sample_shape)}")
            if y.shape != (n, *target_shape):
                raise DataError(f"{out}: targets of shape {y.shape}, expected {(n, *target_shape)}")
            if pos + n > samples:
                raise DataError(f"{out}: source delivered more than the {samples} samples announced")
            check_values(out, x, y, num_classes, first_row=pos)
            i = 0
            while i < n:
                while k < 0 or filled == counts[k]:  # skips a 0-sample test file too
                    if f is not None:
                        finish(f)
                        f = None
                    k, filled = k + 1, 0
                    # Room for two chunks: a block boundary inside a chunk is merged in memory.
                    f = h5py.File(out / names[k], "w", rdcc_nbytes=2 * CHUNK_BYTES)
                    target = _create_xy(f, counts[k], sample_shape, y_dtype, target_shape)
                take = min(n - i, counts[k] - filled)
                target[0][filled : filled + take] = x[i : i + take]
                target[1][filled : filled + take] = y[i : i + take]
                filled += take
                i += take
            pos += n
        if pos != samples:
            raise DataError(f"{out}: source delivered {pos} samples, {samples} announced")
        while k < len(counts) - 1 or f is not None:  # close the last file; create an empty test file
            if f is not None:
                finish(f)
                f = None
            if k < len(counts) - 1:
                k += 1
                f = h5py.File(out / names[k], "w")
                _create_xy(f, counts[k], sample_shape, y_dtype, target_shape)
    finally:
        if f is not None:
            f.close()

    manifest = {
        "format_version": FORMAT_VERSION,
        "sample_shape": list(sample_shape),
        "dtype": X_DTYPE,
        "label_dtype": y_dtype,
        "num_classes": int(num_classes),
        **({"target_shape": list(target_shape)} if regression else {}),
        "shards": entries[:-1],
        "test": entries[-1],
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "generator": dict(generator or {}, seed=seed, test_fraction=test_fraction),
    }
    tmp = out / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / MANIFEST)
    return open_dataset(out, check_files=False)


def release_pages(*arrays) -> None:
    """Drop the pages of memory-mapped arrays from this process's resident memory.

    They stay in the OS page cache (a shared file mapping loses nothing), but reading a large
    input through a map no longer grows the process: without this, every page touched counts
    in its resident set until the map is closed.
    """
    for a in arrays:
        m = getattr(a, "_mmap", None)
        if m is not None and hasattr(m, "madvise"):
            try:
                m.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):   # closed, or a platform without it
                pass


def block_rows(*arrays) -> int:
    """Rows per block for arrays read together: about BLOCK_BYTES, at most GEN_CHUNK."""
    row_bytes = sum(a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64)) for a in arrays)
    return max(1, min(GEN_CHUNK, BLOCK_BYTES // max(1, row_bytes)))


def take_rows(a, idx: np.ndarray) -> np.ndarray:
    """``a[idx]``; for a memory-mapped array, read with ``preadv`` from its file instead.

    Gathering scattered rows through a map faults in the pages around every row (the
    kernel's fault-around), so one shuffled block would map most of a large file into this
    process; reading the runs of consecutive rows into a fresh array touches only those.
    """
    m = getattr(a, "_mmap", None)
    if m is None or not a.flags.c_contiguous or not hasattr(os, "preadv") or len(idx) == 0:
        return a[idx]
    row = a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
    start = a.offset - a.offset % mmap.ALLOCATIONGRANULARITY    # where the map begins
    data_at = a.ctypes.data - np.frombuffer(m, dtype=np.uint8).ctypes.data + start
    order = np.argsort(idx, kind="stable")
    wanted = idx[order]
    out = np.empty((len(idx), *a.shape[1:]), dtype=a.dtype)
    flat = out.reshape(len(idx), -1).view(np.uint8) if out.size else out
    cuts = np.flatnonzero(np.diff(wanted) != 1) + 1
    fd = os.open(a.filename, os.O_RDONLY)
    try:
        for lo, hi in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [len(wanted)]))):
            view = memoryview(flat[lo:hi]).cast("B")
            if os.preadv(fd, [view], int(data_at + int(wanted[lo]) * row)) != len(view):
                raise DataError(f"{a.filename}: short read (file truncated?)")
    finally:
        os.close(fd)
    result = np.empty_like(out)
    result[order] = out          # back into the order asked for
    return result


def array_chunks(x: np.ndarray, y: np.ndarray, seed: int, rows: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield arrays as shuffled ``(x, y)`` blocks (seeded), for :func:`write_dataset`.

    ``x`` and ``y`` may be memory-mapped (``np.memmap``, ``np.load(mmap_mode="r")``): only
    one block of rows is read at a time, and the shuffle's own memory is bounded too. Up to
    :data:`MAX_BLOCKS` rows the order is a full random permutation; beyond, runs of
    ``ceil(n / MAX_BLOCKS)`` consecutive rows move together and each block of output rows
    is shuffled again, which mixes any sorted input (by class, by time) just as well.
    """
    n = len(y)
    rows = rows or block_rows(x, y)
    run = max(1, -(-n // MAX_BLOCKS))
    rng = np.random.default_rng([seed, 0xA77A])
    order = rng.permutation(-(-n // run))
    per = max(1, rows // run)
    for g in range(0, len(order), per):
        if run == 1:
            idx = order[g : g + per]
        else:
            idx = (order[g : g + per, None] * run + np.arange(run)).ravel()
            idx = np.sort(idx[idx < n])            # sorted: sequential reads from the map
        block_x, block_y = take_rows(x, idx), take_rows(y, idx)
        release_pages(x, y)
        if run > 1:
            mix = rng.permutation(len(idx))
            block_x, block_y = block_x[mix], block_y[mix]
        yield block_x, block_y


# --------------------------------------------------------------------------- prepare: digits


def prepare_digits(out, shards: int = 8, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """Write scikit-learn's bundled 8x8 digits (1797 samples, 10 classes) as a dataset.

    Features are scaled to [0, 1] and shaped ``(1, 8, 8)`` so a CNN can use them.

    Raises:
        UsageError: scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise UsageError("prepare digits needs scikit-learn: pip install scikit-learn") from exc
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = digits.target.astype(np.int64)
    return write_dataset(
        out, array_chunks(x, y, seed), len(y), (1, 8, 8), 10, shards, test_fraction, seed,
        generator={"name": "digits", "source": "sklearn.datasets.load_digits"},
    )


# --------------------------------------------------------------------------- prepare: synthetic


TEACHER_HIDDEN = 64
TEACHER_INPUT_STD = 0.5


@dataclass(frozen=True)
class Teacher:
    """Fixed random MLP (features -> 64 tanh -> classes) whose argmax gives the labels."""

    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray

    def logits(self, x: np.ndarray) -> np.ndarray:
        return np.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2

    def labels(self, x: np.ndarray) -> np.ndarray:
        return self.logits(x).argmax(axis=1).astype(np.int64)


def make_teacher(features: int, classes: int, seed: int) -> Teacher:
    """Build the seeded teacher, with output biases tuned so classes are roughly balanced.

    Hidden pre-activations of std 0.5 keep tanh mildly curved: the class boundaries are
    nonlinear but smooth, so a student MLP on 20000 x 32 x 10 reaches ~0.88 test accuracy
    (a steeper teacher pushes that below 0.8 at that size).
    """
    rng = np.random.default_rng([seed, 0x7EAC])
    w1 = rng.standard_normal((features, TEACHER_HIDDEN)) * (TEACHER_INPUT_STD / np.sqrt(features))
    b1 = 0.1 * rng.standard_normal(TEACHER_HIDDEN)
    w2 = rng.standard_normal((TEACHER_HIDDEN, classes)) * (3.0 / np.sqrt(TEACHER_HIDDEN))
    b2 = np.zeros(classes)
    # Balance on a pilot sample: push down the bias of over-represented classes.
    pilot = rng.standard_normal((8192, features))
    hidden_out = np.tanh(pilot @ w1 + b1) @ w2
    for _ in range(200):
        freq = np.bincount((hidden_out + b2).argmax(axis=1), minlength=classes) / len(pilot)
        if freq.min() > 0.85 / classes and freq.max() < 1.15 / classes:
            break
        b2 = b2 - 0.5 * np.log(np.maximum(freq, 0.5 / len(pilot)) * classes)
    return Teacher(w1, b1, w2, b2)


def synthetic_chunks(
    samples: int, features: int, classes: int, noise: float, seed: int, rows: int | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield the synthetic dataset in blocks; block ``k`` depends only on ``(seed, k)``."""
    rows = rows or GEN_CHUNK
    teacher = make_teacher(features, classes, seed)
    for k, lo in enumerate(range(0, samples, rows)):
        n = min(rows, samples - lo)
        rng = np.random.default_rng([seed, 0xDA7A, k])
        x = rng.standard_normal((n, features), dtype=np.float32)
        y = teacher.labels(x.astype(np.float64))
        if noise > 0:
            flip = rng.random(n) < noise
            y[flip] = rng.integers(0, classes, int(flip.sum()))
        yield x, y


def prepare_synthetic(
    out,
    samples: int,
    features: int,
    classes: int,
    shards: int = 8,
    noise: float = 0.0,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> Dataset:
    """Write a seeded synthetic classification dataset, generated and written in blocks.

    Features are standard Gaussian; labels are the argmax of a fixed random teacher MLP
    (:func:`make_teacher`); a fraction ``noise`` of labels is replaced by uniform random
    ones. Memory stays bounded by one block (:data:`GEN_CHUNK` rows), whatever ``samples``.
    """
    if features < 1:
        raise UsageError(f"--features must be >= 1, got {features}")
    if classes < 2:
        raise UsageError(f"--classes must be >= 2, got {classes}")
    if samples < 1:
        raise UsageError(f"--samples must be >= 1, got {samples}")
    if not 0 <= noise <= 1:
        raise UsageError(f"--noise must be in [0, 1], got {noise}")
    return write_dataset(
        out, synthetic_chunks(samples, features, classes, noise, seed), samples, (features,), classes,
        shards, test_fraction, seed,
        generator={"name": "synthetic", "samples": samples, "features": features, "classes": classes,
                   "noise": noise, "teacher": f"mlp {features}-{TEACHER_HIDDEN}tanh-{classes}"},
    )
