"""Datasets on disk: HDF5 shards plus a JSON manifest (docs/data.md, "The dataset directory" and "HDF5 layout").

A dataset is a directory holding ``manifest.json``, ``shard-00000.h5`` ... and ``test.h5``.
Every HDF5 file has ``x`` (float32, chunked along samples) and ``y``: int64 class labels,
or float32 targets (one per sample or a vector of ``target_shape``) for regression.
This module opens and validates datasets (:func:`open_dataset`; the full check of every file,
:func:`~mpilb.data.verified.verify_dataset`, is in :mod:`mpilb.data.verified`) and describes
them (:func:`dataset_info`, in :mod:`mpilb.data.describe`); :mod:`mpilb.data.prepare` writes
them and :mod:`mpilb.data.shards` reads shards during training.

Every problem with a dataset raises :class:`~mpilb.errors.DataError` whose message starts
with the offending file, so that a user of a 64-shard dataset knows which file to look at.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from mpilb.errors import DataError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TEST_FILE = "test.h5"
X_DTYPE = "float32"
Y_DTYPE = "int64"          # class labels (num_classes >= 2)
TARGET_DTYPE = "float32"   # regression targets (num_classes 0), shape () or (k,) per sample

# Block size for streamed checksums and for chunk-wise content checks.
HASH_BLOCK = 4 << 20

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
    target_shape: tuple[int, ...] = ()
    standardize: dict = field(default_factory=dict)   # prepare --standardize's mean and std
    # shards held out for validation (--validation-fraction); not part of ``shards``
    validation: list[ShardInfo] = field(default_factory=list)

    @property
    def regression(self) -> bool:
        """Float targets (``num_classes`` 0) rather than class labels."""
        return self.num_classes == 0

    @property
    def num_targets(self) -> int:
        """Outputs a model needs: the classes, or the length of a target vector."""
        return self.num_classes if self.num_classes else int(np.prod(self.target_shape, dtype=np.int64))

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
        """Bytes of one sample: its float32 features plus its label or target."""
        y_bytes = 4 * self.num_targets if self.regression else 8
        return int(np.prod(self.sample_shape, dtype=np.int64)) * 4 + y_bytes

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
            int64 labels or float32 targets.

        Raises:
            DataError: the file is missing, unreadable, or has a wrong shape, dtype,
                out-of-range label or non-finite feature.
        """
        return self.load_file(self.test_file, self.test_samples)

    def first_rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``n`` samples of the first training shard (a probe's batch)."""
        with open_h5(self.shard_path(0)) as f:
            return f["x"][:n], f["y"][:n]

    def load_file(self, name: str, samples: int) -> tuple[np.ndarray, np.ndarray]:
        """Read one whole file of the dataset (the test set, a validation shard), validated."""
        path = self.root / name
        with open_h5(path) as f:
            x_ds, y_ds = check_h5_layout(f, path, samples, self.sample_shape,
                                         self.label_dtype, self.target_shape)
            try:
                x, y = x_ds[...], y_ds[...]
            except (OSError, RuntimeError) as exc:
                raise DataError(f"{path}: cannot read data ({exc}); the file may be truncated") from exc
        check_values(path, x, y, self.num_classes)
        return x, y


# --------------------------------------------------------------------------- HDF5 helpers


def open_h5(path: Path, chunk_cache: bool = True) -> h5py.File:
    """Open an HDF5 file read-only, safe for many concurrent readers.

    HDF5 file locking breaks on many parallel file systems and among concurrent readers,
    so it is switched off: datasets are immutable once their manifest exists.

    `chunk_cache=False` gives the file no chunk cache, for a reader that reads each chunk
    once (training reads whole shards): with h5py's default chunk cache (8 MB per dataset
    with h5py 3.16) a shard's first read filled fresh cache memory, 1276 page faults and
    twice the CPU time (7.4 ms instead of 3.8 for 2000 x 784 floats), for chunks never
    read again.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file is missing; re-run `mpilb prepare` or restore it")
    try:
        if not chunk_cache:
            return h5py.File(path, "r", locking=False, rdcc_nbytes=0)
        return h5py.File(path, "r", locking=False)
    except (OSError, RuntimeError) as exc:
        raise DataError(f"{path}: not a readable HDF5 file (truncated?): {exc}") from exc


def check_h5_layout(f: h5py.File, path: Path, samples: int, sample_shape: tuple[int, ...],
                    label_dtype: str = Y_DTYPE, target_shape: tuple[int, ...] = ()):
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
    if y.dtype != np.dtype(label_dtype):
        raise DataError(f"{path}: y has dtype {y.dtype}, expected {label_dtype}")
    want_x = (samples, *sample_shape)
    if tuple(x.shape) != want_x:
        raise DataError(f"{path}: x has shape {tuple(x.shape)}, manifest says {want_x}")
    if tuple(y.shape) != (samples, *target_shape):
        raise DataError(f"{path}: y has shape {tuple(y.shape)}, manifest says {(samples, *target_shape)}")
    return x, y


def check_values(path: Path, x: np.ndarray, y: np.ndarray, num_classes: int, first_row: int = 0) -> None:
    """Raise DataError if a label is outside ``[0, num_classes)`` or a feature is not finite.

    ``num_classes`` 0 means float targets: they must be finite.
    """
    if y.size and num_classes == 0:
        if not np.isfinite(y).all():
            bad = int(np.flatnonzero(~np.isfinite(y.reshape(len(y), -1)).all(axis=1))[0])
            raise DataError(f"{path}: non-finite target (NaN or Inf) at row {first_row + bad}")
    elif y.size:
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
    if label_dtype not in (Y_DTYPE, TARGET_DTYPE):
        raise DataError(f"{path}: key 'label_dtype' is {label_dtype!r}, expected {Y_DTYPE!r} "
                        f"(class labels) or {TARGET_DTYPE!r} (regression targets)")
    num_classes = _require(manifest, "num_classes", int, path)
    target_shape = manifest.get("target_shape", [])
    if label_dtype == TARGET_DTYPE:
        if num_classes != 0:
            raise DataError(f"{path}: float32 targets need 'num_classes' 0, got {num_classes}")
        if not (isinstance(target_shape, list) and len(target_shape) <= 1 and all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in target_shape)):
            raise DataError(f"{path}: key 'target_shape' must be [] or [k] with k >= 1")
    elif num_classes < 1:
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
    shard_of = {s.file: s.index for s in shards}
    if test_name in shard_of:   # evaluated on samples it trains on: every figure would lie
        raise DataError(f"{path}: the test set's file {test_name} is also shard "
                        f"{shard_of[test_name]}: the test set needs a file of its own "
                        f"(prepare the dataset again)")

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
        target_shape=tuple(target_shape) if label_dtype == TARGET_DTYPE else (),
        created=str(manifest.get("created", "")),
        generator=manifest.get("generator", {}) if isinstance(manifest.get("generator"), dict) else {},
        standardize=manifest.get("standardize") if isinstance(manifest.get("standardize"), dict) else {},
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
            metadata only; :func:`mpilb.data.verified.verify_dataset` does the expensive checks.

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
                check_h5_layout(f, path, samples, ds.sample_shape, ds.label_dtype, ds.target_shape)
    return ds


# --------------------------------------------------------------------------- writers (moved)

# The ``prepare_*`` writers live in :mod:`mpilb.data.prepare` and :mod:`mpilb.data.ingest`, and
# :func:`dataset_info` in :mod:`mpilb.data.describe`; these names
# stay importable from here (``from mpilb.data.dataset import prepare_digits``). Imported lazily:
# those modules import this one.
_MOVED = {name: "prepare" for name in (
    "shard_file_name", "split_sizes", "write_dataset", "array_chunks", "prepare_digits",
    "prepare_synthetic", "Teacher", "make_teacher", "synthetic_chunks")}
_MOVED.update({name: "ingest" for name in ("prepare_npz", "prepare_hdf5", "prepare_csv")})
_MOVED.update({name: "standardize" for name in ("standardize_dataset",)})
_MOVED.update({name: "describe" for name in ("dataset_info", "_human_bytes")})


def __getattr__(name: str):
    if name in _MOVED:
        return getattr(importlib.import_module(f"{__package__}.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
