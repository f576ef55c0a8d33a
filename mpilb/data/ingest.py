"""Bringing a user's data in: ``mpilb prepare npz | hdf5 | csv``.

Each source becomes two arrays that are memory-mapped or read block by block, never loaded
whole: an uncompressed ``.npz`` member is mapped where it lies inside the zip file; a
compressed member, HDF5 datasets and CSV rows are first copied, block by block, into
temporary ``.npy`` files beside OUT and mapped from there. :func:`mpilb.data.prepare.array_chunks`
then shuffles and :func:`mpilb.data.prepare.write_dataset` writes, one block at a time, so peak
memory stays flat as the input grows.

Targets: integer labels make a classification dataset (``num_classes = max + 1``); float
targets, one per sample or a vector per sample, a regression dataset. ``task`` overrides the
choice ("classify" turns whole-number floats into labels; "regress" integers into targets).
"""

from __future__ import annotations

import csv
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np

from mpilb.data.dataset import Dataset
from mpilb.errors import DataError, UsageError
from mpilb.data.prepare import array_chunks, block_rows, release_pages, write_dataset

TASKS = ("auto", "classify", "regress")
# CSV cells parsed per block (rows = this / columns, at least one): Python's strings and
# lists cost ~50x the numbers they hold, so a block is bounded in cells, not rows; a wide
# file (thousands of columns) parses a few rows at a time.
CSV_BLOCK_CELLS = 1 << 14


# --------------------------------------------------------------------------- shared


def _check_features(path, key: str, x) -> None:
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == bool):
        raise DataError(f"{path}: features '{key}' have non-numeric dtype {x.dtype}")


def _scan(path, x, y, x_key: str, y_key: str, task: str):
    """One blockwise pass over the inputs: finiteness, and what the targets are.

    Returns:
        ``(num_classes, target_shape)``: ``(C, ())`` for labels, ``(0, shape)`` for targets.
    """
    if task not in TASKS:
        raise UsageError(f"--task {task!r}: expected one of {', '.join(TASKS)}")
    integral = np.issubdtype(y.dtype, np.integer) or y.dtype == bool
    if not (integral or np.issubdtype(y.dtype, np.floating)):
        raise DataError(f"{path}: labels '{y_key}' have non-numeric dtype {y.dtype}")
    classify = task == "classify" or (task == "auto" and integral)
    if classify and y.ndim != 1:
        raise DataError(f"{path}: labels '{y_key}' must be 1-D, got shape {y.shape}")
    if not classify and y.ndim > 2:
        raise DataError(f"{path}: targets '{y_key}' must be one value or one vector per sample, got shape {y.shape}")
    lo, hi = np.inf, -np.inf
    step = block_rows(x, y)
    for start in range(0, len(y), step):
        xb, yb = np.asarray(x[start:start + step]), np.asarray(y[start:start + step])
        release_pages(x, y)
        if not np.isfinite(xb.astype(np.float32, copy=False)).all():
            raise DataError(f"{path}: features '{x_key}' contain NaN or Inf")
        if not np.isfinite(yb).all():
            raise DataError(f"{path}: {'labels' if classify else 'targets'} '{y_key}' contain NaN or Inf")
        if classify and not integral and (yb != np.round(yb)).any():
            bad = yb[yb != np.round(yb)][0]
            raise DataError(f"{path}: labels '{y_key}' are not integers (dtype {y.dtype}, e.g. {bad!r}); "
                            "drop --task classify to keep them as regression targets")
        if yb.size:
            lo, hi = min(lo, float(yb.min())), max(hi, float(yb.max()))
    if not classify:
        return 0, tuple(y.shape[1:])
    if lo < 0:
        raise DataError(f"{path}: negative label {int(lo)} in '{y_key}'; labels must be 0..C-1")
    if hi < 1:
        raise DataError(f"{path}: labels '{y_key}' hold a single class (all 0); need at least 2")
    return int(hi) + 1, ()


def _write(path, x, y, out, x_key, y_key, task, shards, test_fraction, seed, generator) -> Dataset:
    """Validate mapped ``x``/``y`` and write them, shuffled, as a dataset."""
    for key, a, what in ((x_key, x, "features"), (y_key, y, "labels or targets")):
        if a.ndim == 0:
            raise DataError(f"{path}: '{key}' is a single value (a 0-d array), not {what} "
                            f"with one row per sample")
    if len(x) != len(y):
        raise DataError(f"{path}: '{x_key}' has {len(x)} samples but '{y_key}' has {len(y)}; "
                        f"lengths must match")
    _check_features(path, x_key, x)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if len(y) == 0:
        raise DataError(f"{path}: the file holds no samples")
    num_classes, target_shape = _scan(path, x, y, x_key, y_key, task)
    if x.ndim == 1:
        x = x[:, None]
    if num_classes:
        chunks = ((bx, by.astype(np.int64)) for bx, by in array_chunks(x, y, seed))
    else:
        chunks = array_chunks(x, y, seed)
    return write_dataset(out, chunks, len(y), x.shape[1:], num_classes, shards, test_fraction,
                         seed, generator=generator, target_shape=target_shape)


@contextmanager
def _staging(out):
    """A temporary directory beside OUT (same file system) for mapped copies; removed after."""
    parent = Path(out).resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".mpilb-stage-", dir=parent) as tmp:
        yield Path(tmp)


def _stage_copy(src, dest: Path, dtype=None) -> np.ndarray:
    """Copy an array-like (h5py dataset, zip member array) into a mapped ``.npy``, by blocks."""
    arr = np.lib.format.open_memmap(dest, mode="w+", dtype=dtype or src.dtype, shape=src.shape)
    step = block_rows(src, arr)
    for lo in range(0, len(src), step):
        arr[lo:lo + step] = src[lo:lo + step]
        arr.flush()
        release_pages(src, arr)
    return np.load(dest, mmap_mode="r")


# --------------------------------------------------------------------------- npz


def _npz_member(path: Path, zf: zipfile.ZipFile, key: str, stage: Path) -> np.ndarray:
    """Memory-map one array of an .npz: in place if stored, else via a decompressed copy."""
    info = zf.getinfo(key + ".npy")
    with zf.open(info) as fh:
        version = np.lib.format.read_magic(fh)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read_header(fh)
        header_len = fh.tell()
        if dtype.hasobject:
            raise DataError(f"{path}: array '{key}' holds Python objects; save numeric arrays")
        if info.compress_type == zipfile.ZIP_STORED:
            with open(path, "rb") as raw:   # the member's local header: 30 bytes + name + extra
                raw.seek(info.header_offset + 26)
                name_len, extra_len = np.frombuffer(raw.read(4), dtype="<u2")
            offset = info.header_offset + 30 + int(name_len) + int(extra_len) + header_len
            return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape,
                             order="F" if fortran else "C")
        dest = stage / f"{key}.npy"
        arr = np.lib.format.open_memmap(dest, mode="w+", dtype=dtype, shape=shape,
                                        fortran_order=fortran)
        flat = arr.reshape(-1, order="F" if fortran else "C")
        step = max(1, (16 << 20) // max(1, dtype.itemsize))
        for lo in range(0, flat.size, step):
            n = min(step, flat.size - lo)
            flat[lo:lo + n] = np.frombuffer(fh.read(n * dtype.itemsize), dtype=dtype, count=n)
            arr.flush()
            release_pages(arr)
        return np.load(dest, mmap_mode="r")


def prepare_npz(file, out, x_key: str = "x", y_key: str = "y", shards: int = 8,
                test_fraction: float = 0.2, seed: int = 0, task: str = "auto") -> Dataset:
    """Write a dataset from a NumPy ``.npz`` (``np.savez`` or ``np.savez_compressed``).

    Raises:
        DataError: the file is missing or unreadable, a key is missing (the message lists
            the keys the file has), lengths differ, labels are negative or a single class,
            or values are not finite.
    """
    path = Path(file)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz archive ({exc}); save with "
                        "np.savez(file, x=..., y=...)") from exc
    with zf, _staging(out) as stage:
        keys = [n[:-4] for n in zf.namelist() if n.endswith(".npy")]
        for key, opt in ((x_key, "--x-key"), (y_key, "--y-key")):
            if key not in keys:
                raise DataError(f"{path}: no array '{key}' (keys in the file: {', '.join(keys) or 'none'}); use {opt}")
        try:
            x, y = _npz_member(path, zf, x_key, stage), _npz_member(path, zf, y_key, stage)
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise DataError(f"{path}: cannot read arrays ({exc})") from exc
        return _write(path, x, y, out, x_key, y_key, task, shards, test_fraction, seed,
                      {"name": "npz", "source": str(path.resolve()), "x_key": x_key, "y_key": y_key})


# --------------------------------------------------------------------------- hdf5


def prepare_hdf5(files, out, x_key: str, y_key: str, shards: int = 8, test_fraction: float = 0.2,
                 seed: int = 0, task: str = "auto") -> Dataset:
    """Write a dataset from one or more HDF5 files holding ``x_key`` and ``y_key``.

    The files' rows are concatenated in the order given (then shuffled); per-sample shapes
    must agree. Each file is copied block by block into a mapped staging file.
    """
    files = [Path(f) for f in files]
    if not files:
        raise UsageError("prepare hdf5: give at least one input FILE before OUT")
    shapes, total, y_dtypes = [], 0, set()
    opened = []
    try:
        for path in files:
            if not path.exists():
                raise DataError(f"{path}: file not found")
            try:
                f = h5py.File(path, "r", locking=False)
            except (OSError, RuntimeError) as exc:
                raise DataError(f"{path}: not a readable HDF5 file ({exc})") from exc
            opened.append(f)
            for key, opt in ((x_key, "--x-key"), (y_key, "--y-key")):
                if key not in f or not isinstance(f[key], h5py.Dataset):
                    have = [k for k in f.keys() if isinstance(f[k], h5py.Dataset)]
                    raise DataError(f"{path}: no dataset '{key}' (datasets in the file: "
                                    f"{', '.join(have) or 'none'}); use {opt}")
            x, y = f[x_key], f[y_key]
            for key, a in ((x_key, x), (y_key, y)):
                if a.ndim == 0:
                    raise DataError(f"{path}: '{key}' is a single value (a 0-d dataset), not "
                                    f"one row per sample")
            if len(x) != len(y):
                raise DataError(f"{path}: '{x_key}' has {len(x) if x.ndim else 0} samples but "
                                f"'{y_key}' has {len(y)}; lengths must match")
            _check_features(path, x_key, x)
            shapes.append((x.shape[1:], y.shape[1:]))
            y_dtypes.add(np.dtype(y.dtype))
            total += len(x)
        if len(set(shapes)) > 1:
            bad = next(i for i, s in enumerate(shapes) if s != shapes[0])
            raise DataError(f"{files[bad]}: samples of shape {shapes[bad][0]} / targets "
                            f"{shapes[bad][1]}, but {files[0]} has {shapes[0][0]} / {shapes[0][1]}")
        y_dtype = np.result_type(*y_dtypes)
        with _staging(out) as stage:
            xs = np.lib.format.open_memmap(stage / "x.npy", mode="w+", dtype=np.float32,
                                           shape=(total, *shapes[0][0]))
            ys = np.lib.format.open_memmap(stage / "y.npy", mode="w+", dtype=y_dtype,
                                           shape=(total, *shapes[0][1]))
            pos = 0
            for path, f in zip(files, opened):
                x, y = f[x_key], f[y_key]
                step = block_rows(xs, ys)
                for lo in range(0, len(x), step):
                    hi = min(len(x), lo + step)
                    try:
                        xs[pos + lo:pos + hi] = x[lo:hi]
                        ys[pos + lo:pos + hi] = y[lo:hi]
                    except (OSError, RuntimeError) as exc:
                        raise DataError(f"{path}: cannot read rows {lo}-{hi} ({exc})") from exc
                    xs.flush()
                    ys.flush()
                    release_pages(xs, ys)
                pos += len(x)
            xs.flush()
            ys.flush()
            del xs, ys
            x, y = np.load(stage / "x.npy", mmap_mode="r"), np.load(stage / "y.npy", mmap_mode="r")
            where = files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} more)"
            return _write(where, x, y, out, x_key, y_key, task, shards, test_fraction, seed,
                          {"name": "hdf5", "source": [str(p.resolve()) for p in files],
                           "x_key": x_key, "y_key": y_key})
    finally:
        for f in opened:
            f.close()


# --------------------------------------------------------------------------- csv


def _columns(path: Path, header: list[str], names: list[str], option: str) -> list[int]:
    index = {name: i for i, name in enumerate(header)}
    for name in names:
        if name not in index:
            raise DataError(f"{path}: no column '{name}' (columns: {', '.join(header)}); check {option}")
    return [index[n] for n in names]


def _bad_cell(path: Path, lines: list[int], rows: list[list[str]], cols: list[int], header) -> str:
    """The message for the first cell of ``rows`` (read from file ``lines``) that is not a number."""
    for line, row in zip(lines, rows):
        for c in cols:
            try:
                float(row[c])
            except ValueError:
                cell = row[c].strip()
                what = "an empty cell" if not cell else f"{cell[:30]!r} is not a number"
                return f"{path}: line {line}, column '{header[c]}': {what}"
    return f"{path}: line {lines[0]}: cannot parse the rows"  # pragma: no cover


def _csv_blocks(path: Path, reader, columns: int):
    """The data rows in blocks of about CSV_BLOCK_CELLS cells: ``(rows, lines)``, where
    ``lines[i]`` is the file line row ``i`` starts on (blank lines skipped, a quoted cell
    may span lines)."""
    per_block = max(1, CSV_BLOCK_CELLS // max(1, columns))
    rows, lines = [], []
    start = reader.line_num + 1
    for row in reader:
        if row and not (len(row) == 1 and not row[0].strip()):   # not a blank line
            if len(row) != columns:
                raise DataError(f"{path}: line {start}: {len(row)} cells, the header has {columns}")
            rows.append(row)
            lines.append(start)
            if len(rows) == per_block:
                yield rows, lines
                rows, lines = [], []
        start = reader.line_num + 1
    if rows:
        yield rows, lines


def prepare_csv(file, out, target: str, features: str | None = None, shards: int = 8,
                test_fraction: float = 0.2, seed: int = 0, task: str = "auto",
                delimiter: str = ",") -> Dataset:
    """Write a dataset from a CSV file with a header line.

    Args:
        target: the target column name(s), comma-separated; several make a target vector.
        features: the feature columns, comma-separated; default every other column.
        task: "auto": one target column whose cells are all integers (no decimal point or
            exponent) gives class labels; anything else, float targets.

    Raises:
        DataError: naming the file, and the line and column of a bad cell; a missing column
            lists the columns the header has.
    """
    path = Path(file)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    targets = [t.strip() for t in str(target).split(",") if t.strip()]
    if not targets:
        raise UsageError("prepare csv: --target needs one or more column names")
    with open(path, newline="", encoding="utf-8") as fh, _staging(out) as stage:
        reader = csv.reader(fh, delimiter=delimiter)
        header = [h.strip() for h in next(reader, [])]
        if not header:
            raise DataError(f"{path}: the file is empty (expected a header line of column names)")
        y_cols = _columns(path, header, targets, "--target")
        if features:
            x_cols = _columns(path, header, [f.strip() for f in features.split(",")], "--features")
        else:
            x_cols = [i for i in range(len(header)) if i not in y_cols]
        if not x_cols:
            raise DataError(f"{path}: no feature columns left besides the target(s)")
        overlap = set(x_cols) & set(y_cols)
        if overlap:
            raise UsageError(f"prepare csv: column '{header[min(overlap)]}' is both a feature and a target")
        # parsed block by block into raw float files beside OUT, mapped once complete
        with open(stage / "x.bin", "wb") as xf, open(stage / "y.bin", "wb") as yf:
            n, integral = 0, True
            for block, lines in _csv_blocks(path, reader, len(header)):
                try:
                    xb = np.array([[row[c] for c in x_cols] for row in block], dtype=np.float32)
                    yb = np.array([[row[c] for c in y_cols] for row in block], dtype=np.float64)
                except ValueError:
                    raise DataError(_bad_cell(path, lines, block, x_cols + y_cols, header)) from None
                xf.write(xb.tobytes())
                yf.write(yb.tobytes())
                integral = integral and all("." not in row[c] and "e" not in row[c].lower()
                                            and "n" not in row[c].lower()
                                            for row in block for c in y_cols)
                n += len(block)
        if n == 0:
            raise DataError(f"{path}: no data rows after the header")
        x = np.memmap(stage / "x.bin", dtype=np.float32, mode="r", shape=(n, len(x_cols)))
        y = np.memmap(stage / "y.bin", dtype=np.float64, mode="r", shape=(n, len(y_cols)))
        if task == "auto":
            task = "classify" if integral and len(y_cols) == 1 else "regress"
        y = y[:, 0] if len(y_cols) == 1 else y
        # labels as integers, targets as float32: a mapped copy, made block by block
        y = _stage_copy(y, stage / "y.npy", np.float32 if task == "regress" else np.int64) \
            if task != "classify" or integral else y
        return _write(path, x, y, out, "features", ",".join(targets), task, shards,
                      test_fraction, seed,
                      {"name": "csv", "source": str(path.resolve()), "target": targets,
                       "features": [header[c] for c in x_cols]})
