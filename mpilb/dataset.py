"""Datasets on disk: HDF5 shards plus a JSON manifest (DESIGN.md, "Dataset format").

A dataset is a directory holding ``manifest.json``, ``shard-00000.h5`` ... and ``test.h5``.
Every HDF5 file has ``x`` (float32, chunked along samples) and ``y`` (int64 labels).
This module writes datasets (``prepare_*``, all through :func:`write_dataset`), opens and
validates them (:func:`open_dataset`, :func:`verify_dataset`) and describes them
(:func:`dataset_info`). Reading shards during training is :mod:`mpilb.shards`' job.

Every problem with a dataset raises :class:`~mpilb.errors.DataError` whose message starts
with the offending file, so that a user of a 64-shard dataset knows which file to look at.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import h5py
import numpy as np

from .errors import DataError, UsageError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TEST_FILE = "test.h5"
X_DTYPE = "float32"
Y_DTYPE = "int64"

# Rows generated (or copied) per step when writing: large enough to amortise HDF5 calls,
# small enough that a 1e6 x 128 dataset never sits in memory at once.
GEN_CHUNK = 65536
# Target HDF5 chunk size along samples: ~1 MiB of x rows per chunk.
CHUNK_BYTES = 1 << 20
# Block size for streamed checksums and for chunk-wise content checks.
HASH_BLOCK = 4 << 20
CHECK_BYTES = 16 << 20

_SHARD_RE = re.compile(r"^shard-\d{5}\.h5$")


# --------------------------------------------------------------------------- manifest model


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest lists it."""

    index: int
    file: str
    samples: int
    sha256: str


@dataclass
class Dataset:
    """An opened dataset: the validated manifest plus its directory."""

    root: Path
    shards: list[ShardInfo]
    sample_shape: tuple[int, ...]
    dtype: str
    num_classes: int
    test_file: str
    test_samples: int
    format_version: int
    test_sha256: str = ""
    label_dtype: str = Y_DTYPE
    created: str = ""
    generator: dict = field(default_factory=dict)

    @property
    def total_samples(self) -> int:
        """Training samples over all shards (the test set not included)."""
        return sum(s.samples for s in self.shards)

    @property
    def shard_sizes(self) -> list[int]:
        """Samples per shard, in shard order."""
        return [s.samples for s in self.shards]

    @property
    def offsets(self) -> np.ndarray:
        """Global index of each shard's first sample (shards laid end to end)."""
        sizes = np.asarray(self.shard_sizes, dtype=np.int64)
        return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one sample: its float32 features plus its int64 label."""
        return int(np.prod(self.sample_shape, dtype=np.int64)) * 4 + 8

    def shard_path(self, i: int) -> Path:
        """Path of shard ``i``'s HDF5 file."""
        return self.root / self.shards[i].file

    def shard_nbytes(self, i: int) -> int:
        """Bytes of ``x`` plus ``y`` of shard ``i`` (what a full read delivers)."""
        return self.shards[i].samples * self.row_nbytes

    @property
    def test_path(self) -> Path:
        return self.root / self.test_file

    def load_test(self) -> tuple[np.ndarray, np.ndarray]:
        """Read the whole test set, validated like a shard.

        Returns:
            ``(x, y)``: float32 features of shape ``(test_samples, *sample_shape)`` and
            int64 labels.

        Raises:
            DataError: the file is missing, unreadable, or has a wrong shape, dtype,
                out-of-range label or non-finite feature.
        """
        path = self.test_path
        with open_h5(path) as f:
            x_ds, y_ds = check_h5_layout(f, path, self.test_samples, self.sample_shape)
            try:
                x, y = x_ds[...], y_ds[...]
            except (OSError, RuntimeError) as exc:
                raise DataError(f"{path}: cannot read data ({exc}); the file may be truncated") from exc
        check_values(path, x, y, self.num_classes)
        return x, y


# --------------------------------------------------------------------------- HDF5 helpers


def open_h5(path: Path) -> h5py.File:
    """Open an HDF5 file read-only, safe for many concurrent readers.

    HDF5 file locking breaks on many parallel file systems and among concurrent readers,
    so it is switched off: datasets are immutable once their manifest exists.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file is missing; re-run `mpilb prepare` or restore it")
    try:
        return h5py.File(path, "r", locking=False)
    except (OSError, RuntimeError) as exc:
        raise DataError(f"{path}: not a readable HDF5 file (truncated?): {exc}") from exc


def check_h5_layout(f: h5py.File, path: Path, samples: int, sample_shape: tuple[int, ...]):
    """Check that an open file has ``x``/``y`` of the expected shapes and dtypes.

    Returns:
        The ``(x, y)`` h5py datasets.
    """
    for key in ("x", "y"):
        if key not in f or not isinstance(f[key], h5py.Dataset):
            raise DataError(f"{path}: no dataset '{key}' in the file")
    x, y = f["x"], f["y"]
    if x.dtype != np.dtype(X_DTYPE):
        raise DataError(f"{path}: x has dtype {x.dtype}, expected {X_DTYPE}")
    if y.dtype != np.dtype(Y_DTYPE):
        raise DataError(f"{path}: y has dtype {y.dtype}, expected {Y_DTYPE}")
    want_x = (samples, *sample_shape)
    if tuple(x.shape) != want_x:
        raise DataError(f"{path}: x has shape {tuple(x.shape)}, manifest says {want_x}")
    if tuple(y.shape) != (samples,):
        raise DataError(f"{path}: y has shape {tuple(y.shape)}, manifest says {(samples,)}")
    return x, y


def check_values(path: Path, x: np.ndarray, y: np.ndarray, num_classes: int, first_row: int = 0) -> None:
    """Raise DataError if a label is outside ``[0, num_classes)`` or a feature is not finite."""
    if y.size:
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= num_classes:
            bad = int(np.flatnonzero((y < 0) | (y >= num_classes))[0])
            raise DataError(
                f"{path}: label {int(y[bad])} at row {first_row + bad} is out of range "
                f"[0, {num_classes})"
            )
    if x.size and not np.isfinite(x).all():
        finite_rows = np.isfinite(x.reshape(len(x), -1)).all(axis=1)
        bad = int(np.flatnonzero(~finite_rows)[0])
        raise DataError(f"{path}: non-finite feature (NaN or Inf) at row {first_row + bad}")


def sha256_file(path: Path, block: int = HASH_BLOCK) -> str:
    """SHA-256 of a file, streamed in ``block``-byte reads."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(block):
                h.update(chunk)
    except OSError as exc:
        raise DataError(f"{path}: cannot read file ({exc})") from exc
    return h.hexdigest()


# --------------------------------------------------------------------------- opening


def _require(manifest: dict, key: str, kind, path: Path):
    if key not in manifest:
        raise DataError(f"{path}: missing key '{key}'")
    value = manifest[key]
    # bool is an int in Python; a manifest with "samples": true is still malformed.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise DataError(f"{path}: key '{key}' must be {names}, got {type(value).__name__}")
    return value


def _file_entry(entry, where: str, path: Path) -> tuple[str, int, str]:
    if not isinstance(entry, dict):
        raise DataError(f"{path}: {where} must be an object with file, samples, sha256")
    name = _require(entry, "file", str, path)
    samples = _require(entry, "samples", int, path)
    sha = _require(entry, "sha256", str, path)
    # Only bare file names: a manifest must not point outside its directory.
    if not name or Path(name).name != name or name in (".", ".."):
        raise DataError(f"{path}: {where} file name {name!r} must be a plain file name")
    if samples < 0:
        raise DataError(f"{path}: {where} has a negative sample count ({samples})")
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise DataError(f"{path}: {where} sha256 {sha!r} is not a 64-digit hex digest")
    return name, samples, sha


def _read_manifest(root: Path) -> Dataset:
    path = root / MANIFEST
    if root.exists() and not root.is_dir():
        raise DataError(f"{root}: is a file, not a dataset directory (a directory made by "
                        f"`mpilb prepare`; for a .npz file use `mpilb prepare npz`)")
    if not root.is_dir():
        raise DataError(f"{root}: dataset directory does not exist")
    if not path.exists():
        raise DataError(f"{path}: manifest is missing; is {root} an mpilb dataset? (see `mpilb prepare`)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read manifest ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: malformed JSON ({exc})") from exc
    if not isinstance(manifest, dict):
        raise DataError(f"{path}: manifest must be a JSON object")

    version = _require(manifest, "format_version", int, path)
    if version != FORMAT_VERSION:
        raise DataError(
            f"{path}: format_version {version} is not supported (this mpilb reads {FORMAT_VERSION}); "
            "re-run `mpilb prepare`"
        )
    shape = _require(manifest, "sample_shape", list, path)
    if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
        raise DataError(f"{path}: key 'sample_shape' must be a non-empty list of positive integers")
    dtype = _require(manifest, "dtype", str, path)
    if dtype != X_DTYPE:
        raise DataError(f"{path}: key 'dtype' is {dtype!r}, only {X_DTYPE!r} is supported")
    label_dtype = manifest.get("label_dtype", Y_DTYPE)
    if label_dtype != Y_DTYPE:
        raise DataError(f"{path}: key 'label_dtype' is {label_dtype!r}, only {Y_DTYPE!r} is supported")
    num_classes = _require(manifest, "num_classes", int, path)
    if num_classes < 1:
        raise DataError(f"{path}: key 'num_classes' must be >= 1, got {num_classes}")

    entries = _require(manifest, "shards", list, path)
    shards = []
    for i, entry in enumerate(entries):
        name, samples, sha = _file_entry(entry, f"shards[{i}]", path)
        shards.append(ShardInfo(i, name, samples, sha))
    if not shards:
        raise DataError(f"{path}: the dataset has no shards")
    if sum(s.samples for s in shards) == 0:
        raise DataError(f"{path}: the dataset has no samples (every shard is empty)")
    if len({s.file for s in shards}) != len(shards):
        raise DataError(f"{path}: a shard file is listed twice")
    test_name, test_samples, test_sha = _file_entry(_require(manifest, "test", dict, path), "test", path)

    return Dataset(
        root=root,
        shards=shards,
        sample_shape=tuple(shape),
        dtype=dtype,
        num_classes=num_classes,
        test_file=test_name,
        test_samples=test_samples,
        format_version=version,
        test_sha256=test_sha,
        label_dtype=label_dtype,
        created=str(manifest.get("created", "")),
        generator=manifest.get("generator", {}) if isinstance(manifest.get("generator"), dict) else {},
    )


def _all_files(ds: Dataset) -> list[tuple[str, int, str]]:
    """(file, samples, sha256) for every shard, then the test file."""
    return [(s.file, s.samples, s.sha256) for s in ds.shards] + [
        (ds.test_file, ds.test_samples, ds.test_sha256)
    ]


def open_dataset(root, check_files: bool = True) -> Dataset:
    """Open a dataset directory and validate its manifest.

    Args:
        root: the dataset directory.
        check_files: also check that every shard and the test file exist, open with h5py
            and hold ``x``/``y`` of the manifest's sample count, shape and dtypes. This reads
            metadata only; :func:`verify_dataset` does the expensive checks.

    Returns:
        The :class:`Dataset`.

    Raises:
        DataError: naming the manifest or data file and what is wrong with it.
    """
    ds = _read_manifest(Path(root))
    if check_files:
        for name, samples, _ in _all_files(ds):
            path = ds.root / name
            with open_h5(path) as f:
                check_h5_layout(f, path, samples, ds.sample_shape)
    return ds


def verify_dataset(root, cached: bool = False) -> Dataset:
    """Fully verify a dataset: manifest, layout, checksums, labels and feature values.

    Files are hashed in blocks and read chunk by chunk, so memory stays small whatever
    the dataset's size. Every file that passes is recorded (:mod:`mpilb.verified`).

    Args:
        root: the dataset directory.
        cached: skip every check of the files recorded as passed that have not changed
            since (same path, size, mtime and inode). `mpilb train` starts with this;
            `mpilb data verify` checks everything.

    Returns:
        The :class:`Dataset` when everything checks out.

    Raises:
        DataError: naming the first bad file and its problem, e.g.
            ``shard-00003.h5: checksum mismatch (manifest sha256 ab12..., file cd34...)``.
    """
    from .verified import VerifiedFiles

    ds = open_dataset(root, check_files=False)
    records = VerifiedFiles(ds.root)
    rows = max(1, CHECK_BYTES // ds.row_nbytes)
    try:
        for name, samples, sha in _all_files(ds):
            path = ds.root / name
            if cached and records.trusted(path, sha):
                continue   # unchanged since it passed: layout, checksum and values
            records.begin(path)
            with open_h5(path) as f:
                check_h5_layout(f, path, samples, ds.sample_shape)
            _check_file(ds, path, samples, sha, rows)
            records.passed(path, sha)
    finally:
        records.save()   # what passed stays recorded, even when a later file fails
    return ds


def _check_file(ds: Dataset, path: Path, samples: int, sha: str, rows: int) -> None:
    """Checksum, then labels and feature values, of one file; DataError naming it."""
    actual = sha256_file(path)
    if actual != sha:
        raise DataError(
            f"{path}: checksum mismatch (manifest sha256 {sha[:12]}..., file {actual[:12]}...); "
            "the file was modified or damaged, re-run `mpilb prepare`"
        )
    with open_h5(path) as f:
        x_ds, y_ds = f["x"], f["y"]
        for lo in range(0, samples, rows):
            hi = min(samples, lo + rows)
            try:
                x, y = x_ds[lo:hi], y_ds[lo:hi]
            except (OSError, RuntimeError) as exc:
                raise DataError(f"{path}: cannot read rows {lo}-{hi} ({exc}); truncated?") from exc
            check_values(path, x, y, ds.num_classes, first_row=lo)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def dataset_info(root) -> str:
    """A human-readable multi-line summary of a dataset (manifest plus file sizes)."""
    ds = open_dataset(root, check_files=False)
    sizes = ds.shard_sizes
    file_bytes = []
    for name, _, _ in _all_files(ds):
        path = ds.root / name
        file_bytes.append(path.stat().st_size if path.exists() else 0)
    gen = ds.generator
    gen_text = ", ".join(f"{k}={v}" for k, v in gen.items()) if gen else "unknown"
    lines = [
        f"dataset:        {ds.root}",
        f"format version: {ds.format_version}",
        f"generator:      {gen_text}",
        f"created:        {ds.created or 'unknown'}",
        f"sample shape:   {ds.sample_shape} {ds.dtype}, labels {ds.label_dtype}",
        f"classes:        {ds.num_classes}",
        f"shards:         {len(ds.shards)} ({ds.shards[0].file} .. {ds.shards[-1].file})",
        f"train samples:  {ds.total_samples} (per shard min {min(sizes)}, max {max(sizes)}, "
        f"mean {ds.total_samples / len(sizes):.1f})",
        f"test samples:   {ds.test_samples} ({ds.test_file})",
        f"bytes:          {_human_bytes(ds.total_samples * ds.row_nbytes)} train data "
        f"({_human_bytes(ds.shard_nbytes(0))} per shard), "
        f"{_human_bytes(sum(file_bytes))} on disk",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- writing


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
        ours = {MANIFEST, MANIFEST + ".tmp", TEST_FILE}
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


def _create_xy(f: h5py.File, n: int, sample_shape: tuple[int, ...]):
    row_bytes = int(np.prod(sample_shape, dtype=np.int64)) * 4
    rows = max(1, min(n, CHUNK_BYTES // row_bytes))
    chunks_x = (rows, *sample_shape) if n else None
    chunks_y = (rows,) if n else None
    x = f.create_dataset("x", (n, *sample_shape), dtype=X_DTYPE, chunks=chunks_x, track_times=False)
    y = f.create_dataset("y", (n,), dtype=Y_DTYPE, chunks=chunks_y, track_times=False)
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
            with rows of ``sample_shape``, y integer labels in ``[0, num_classes)``.
        samples: total rows the blocks deliver (train + test).
        sample_shape: shape of one sample.
        num_classes: number of classes (labels are checked against it).
        shards: number of shard files.
        test_fraction: fraction of samples for ``test.h5``.
        seed: recorded in the manifest (the source used it to shuffle).
        generator: provenance recorded in the manifest.

    Returns:
        The written :class:`Dataset`, as :func:`open_dataset` reads it back.

    Raises:
        UsageError: bad parameters or a non-empty OUT that is not an mpilb dataset.
        DataError: a block with a bad shape, label or non-finite feature.
    """
    out = Path(out)
    sample_shape = tuple(int(d) for d in sample_shape)
    if num_classes < 2:
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
            y = np.asarray(y)
            n = len(y)
            if x.shape != (n, *sample_shape):
                raise DataError(f"{out}: block of shape {x.shape} does not match samples {(n, *sample_shape)}")
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
                    target = _create_xy(f, counts[k], sample_shape)
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
                _create_xy(f, counts[k], sample_shape)
    finally:
        if f is not None:
            f.close()

    manifest = {
        "format_version": FORMAT_VERSION,
        "sample_shape": list(sample_shape),
        "dtype": X_DTYPE,
        "label_dtype": Y_DTYPE,
        "num_classes": int(num_classes),
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


def array_chunks(x: np.ndarray, y: np.ndarray, seed: int, rows: int = GEN_CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield in-memory arrays as shuffled ``(x, y)`` blocks (seeded), for :func:`write_dataset`."""
    perm = np.random.default_rng([seed, 0xA77A]).permutation(len(y))
    for lo in range(0, len(y), rows):
        idx = perm[lo : lo + rows]
        yield x[idx], y[idx]


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


# --------------------------------------------------------------------------- prepare: npz


def _integer_labels(y: np.ndarray, path: Path, key: str) -> np.ndarray:
    if y.dtype == bool:
        return y.astype(np.int64)
    if np.issubdtype(y.dtype, np.integer):
        return y.astype(np.int64)
    if np.issubdtype(y.dtype, np.floating):
        # Float labels that hold whole numbers (3.0) are common in saved arrays; accept them.
        if np.isfinite(y).all() and (y == np.round(y)).all():
            return y.astype(np.int64)
        raise DataError(f"{path}: labels '{key}' are not integers (dtype {y.dtype}, e.g. {y.flat[0]!r})")
    raise DataError(f"{path}: labels '{key}' have non-numeric dtype {y.dtype}")


def prepare_npz(
    file, out, x_key: str = "x", y_key: str = "y", shards: int = 8, test_fraction: float = 0.2, seed: int = 0
) -> Dataset:
    """Write a dataset from a NumPy ``.npz`` file holding features and integer labels.

    Features are cast to float32 and labels to int64; ``num_classes = max(y) + 1``.

    Raises:
        DataError: the file is missing or unreadable, a key is missing (the message lists
            the keys the file has), lengths differ, labels are not integers or negative,
            or features are not finite.
    """
    path = Path(file)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    try:
        npz = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from exc
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise DataError(f"{path}: not an .npz archive (a single array); save with np.savez(file, x=..., y=...)")
    with npz:
        keys = list(npz.files)
        for key, opt in ((x_key, "--x-key"), (y_key, "--y-key")):
            if key not in keys:
                raise DataError(f"{path}: no array '{key}' (keys in the file: {', '.join(keys) or 'none'}); use {opt}")
        try:
            x, y = npz[x_key], npz[y_key]
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise DataError(f"{path}: cannot read arrays ({exc})") from exc
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError(f"{path}: labels '{y_key}' must be 1-D, got shape {y.shape}")
    if x.ndim == 0 or len(x) != len(y):
        raise DataError(
            f"{path}: '{x_key}' has {len(x) if x.ndim else 0} samples but '{y_key}' has {len(y)}; lengths must match"
        )
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == bool):
        raise DataError(f"{path}: features '{x_key}' have non-numeric dtype {x.dtype}")
    if x.ndim == 1:
        x = x[:, None]
    y = _integer_labels(y, path, y_key)
    if len(y) == 0:
        raise DataError(f"{path}: the file holds no samples")
    if y.min() < 0:
        raise DataError(f"{path}: negative label {int(y.min())} in '{y_key}'; labels must be 0..C-1")
    x = x.astype(np.float32, copy=False)
    if not np.isfinite(x).all():
        raise DataError(f"{path}: features '{x_key}' contain NaN or Inf")
    num_classes = int(y.max()) + 1
    if num_classes < 2:
        raise DataError(f"{path}: labels '{y_key}' hold a single class (all 0); need at least 2")
    return write_dataset(
        out, array_chunks(x, y, seed), len(y), x.shape[1:], num_classes, shards, test_fraction, seed,
        generator={"name": "npz", "source": str(path.resolve()), "x_key": x_key, "y_key": y_key},
    )
