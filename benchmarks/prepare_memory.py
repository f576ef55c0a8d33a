"""Peak memory of `mpilb prepare npz | hdf5 | csv` at 1x and 8x the input size.

    python benchmarks/prepare_memory.py [--rows 100000] [--features 64] [--csv-rows 25000]

Each prepare runs in its own process under `/usr/bin/time -v` (maximum resident set size),
so the figure includes Python, NumPy and h5py themselves. Target (issue 12): peak memory
stays flat as the input grows: 8x the input costs at most 1.25x the 1x peak.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runs import print_targets  # noqa: E402


def peak_mib(args: list[str]) -> float:
    res = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "mpilb", "prepare", *args],
                         capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"prepare {' '.join(args)} failed:\n{res.stderr[-2000:]}")
    kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr).group(1))
    return kb / 1024


def make_inputs(d: Path, rows: int, features: int, csv_rows: int, tag: str) -> dict:
    import h5py

    rng = np.random.default_rng(0)
    paths = {"npz": d / f"{tag}.npz", "hdf5": d / f"{tag}.h5", "csv": d / f"{tag}.csv"}
    # written in pieces so that making the 8x input does not itself need 8x memory
    x = np.lib.format.open_memmap(d / f"{tag}-x.npy", mode="w+", dtype=np.float32, shape=(rows, features))
    y = np.lib.format.open_memmap(d / f"{tag}-y.npy", mode="w+", dtype=np.float32, shape=(rows,))
    with h5py.File(paths["hdf5"], "w") as f:
        fx = f.create_dataset("x", (rows, features), dtype=np.float32, chunks=(4096, features))
        fy = f.create_dataset("y", (rows,), dtype=np.float32, chunks=(4096,))
        for lo in range(0, rows, 65536):
            n = min(65536, rows - lo)
            bx = rng.standard_normal((n, features), dtype=np.float32)
            by = bx[:, 0] * 2 + 0.1 * rng.standard_normal(n, dtype=np.float32)
            x[lo:lo + n], y[lo:lo + n], fx[lo:lo + n], fy[lo:lo + n] = bx, by, bx, by
    x.flush()
    y.flush()
    # np.savez streams memory-mapped arrays into the zip without loading them whole
    np.savez(paths["npz"], x=np.load(d / f"{tag}-x.npy", mmap_mode="r"), y=np.load(d / f"{tag}-y.npy", mmap_mode="r"))
    with open(paths["csv"], "w") as fh:
        fh.write(",".join(f"f{i}" for i in range(16)) + ",target\n")
        for lo in range(0, csv_rows, 10000):
            n = min(10000, csv_rows - lo)
            block = rng.standard_normal((n, 17))
            fh.write("\n".join(",".join(f"{v:.5f}" for v in row) for row in block) + "\n")
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--csv-rows", type=int, default=25_000)
    ap.add_argument("--dir", default=None)
    opts = ap.parse_args()
    d = Path(opts.dir or tempfile.mkdtemp(prefix="mpilb-prepmem-"))
    d.mkdir(parents=True, exist_ok=True)
    peaks = {}
    try:
        for scale in (1, 8):
            paths = make_inputs(d, opts.rows * scale, opts.features, opts.csv_rows * scale, f"s{scale}")
            size = {k: os.path.getsize(p) / 2**20 for k, p in paths.items()}
            peaks[scale] = {
                "npz": peak_mib(["npz", str(paths["npz"]), str(d / f"out-npz-{scale}")]),
                "hdf5": peak_mib(["hdf5", str(paths["hdf5"]), str(d / f"out-h5-{scale}"), "--x-key", "x", "--y-key", "y"]),
                "csv": peak_mib(["csv", str(paths["csv"]), str(d / f"out-csv-{scale}"), "--target", "target"]),
            }
            print(f"{scale}x input: " + ", ".join(f"{k} {size[k]:.0f} MiB -> peak RSS {v:.0f} MiB"
                                                  for k, v in peaks[scale].items()), flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print_targets([(f"prepare {k}: peak at 8x <= 1.25 x peak at 1x", peaks[8][k] <= 1.25 * peaks[1][k],
                    f"{peaks[1][k]:.0f} -> {peaks[8][k]:.0f} MiB ({peaks[8][k] / peaks[1][k]:.2f}x)")
                   for k in ("npz", "hdf5", "csv")])


if __name__ == "__main__":
    main()
