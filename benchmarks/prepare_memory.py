"""Peak memory of `mpilb prepare npz | hdf5 | csv` at 1x and 8x the input size.

    python benchmarks/prepare_memory.py [--repeats 3] [--rows 100000] [--features 64]
                                        [--csv-rows 250000] [--wide-rows 4500]

Each prepare runs in a fresh process and the figure is that process's peak resident memory
(its ``ru_maxrss``, read by a wrapper process that runs nothing else), so it includes Python,
NumPy and h5py themselves; the interpreter with those imports alone is measured too, as the
floor. Target (issue 12): memory stays flat as the input grows: in each repeat, the 8x input's
peak is at most 1.1x the 1x input's (run back to back). The 1x inputs are bigger than every
buffer the writer sizes by the input (a 4 MiB shuffle block, 1 MiB HDF5 chunks per shard),
so a ratio above 1 is growth, not a buffer filling up.

CSV is parsed a block of cells at a time, not a block of rows: a 1,000-column file costs
what a 17-column file does (the last group: same number of bytes, peak ratio <= 1.1).
Writes ``benchmarks/results/prepare_memory.json``; exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
from _runs import print_targets  # noqa: E402

NAME = "prepare_memory"
IMPORTS = "import h5py, numpy, mpilb.cli.main, mpilb.data.ingest, mpilb.data.prepare"


def peak_mib(cmd: list[str]) -> float:
    """Peak RSS (MiB) of one child process, read by a wrapper that runs only that child."""
    code = ("import resource, subprocess, sys\n"
            "res = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)\n"
            "if res.returncode:\n"
            "    sys.exit(res.stderr[-2000:])\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    res = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr}")
    kib = float(res.stdout.split()[-1])
    return kib / 1024 if sys.platform != "darwin" else kib / 2**20   # macOS reports bytes


def prepare(*args: str) -> list[str]:
    return [sys.executable, "-m", "mpilb", "prepare", *args]


def write_csv(path: Path, rows: int, columns: int, rng) -> None:
    """`columns` features and a float `target`, written in pieces (never the whole file in memory)."""
    with open(path, "w") as fh:
        fh.write(",".join(f"f{i}" for i in range(columns)) + ",target\n")
        step = max(1, 200_000 // (columns + 1))
        for lo in range(0, rows, step):
            block = rng.standard_normal((min(step, rows - lo), columns + 1))
            fh.write("\n".join(",".join(f"{v:.5f}" for v in row) for row in block) + "\n")


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
    del x, y
    # np.savez streams memory-mapped arrays into the zip without loading them whole
    np.savez(paths["npz"], x=np.load(d / f"{tag}-x.npy", mmap_mode="r"), y=np.load(d / f"{tag}-y.npy", mmap_mode="r"))
    for name in ("x", "y"):
        os.unlink(d / f"{tag}-{name}.npy")
    write_csv(paths["csv"], csv_rows, 16, rng)
    return paths


def commands(paths: dict, out: Path) -> dict:
    return {
        "npz": prepare("npz", str(paths["npz"]), str(out)),
        "hdf5": prepare("hdf5", str(paths["hdf5"]), str(out), "--x-key", "x", "--y-key", "y"),
        "csv": prepare("csv", str(paths["csv"]), str(out), "--target", "target"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=100_000, help="npz and hdf5 rows at 1x")
    ap.add_argument("--features", type=int, default=64, help="npz and hdf5 features")
    ap.add_argument("--csv-rows", type=int, default=250_000, help="CSV rows at 1x (17 columns)")
    ap.add_argument("--wide-rows", type=int, default=4_500,
                    help="rows of the 1,001-column CSV (about the 1x CSV's bytes at the default sizes)")
    ap.add_argument("--dir", default=None, help="where inputs and outputs are written (temporary)")
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.rows, opts.csv_rows, opts.wide_rows = 1, 5_000, 5_000, 200
    d = Path(tempfile.mkdtemp(prefix="mpilb-prepmem-", dir=opts.dir))
    res = _results.Results(NAME, "Peak memory while preparing", opts)
    sources = ("npz", "hdf5", "csv")
    peaks = {(k, s): [] for k in sources for s in (1, 8)}
    floor, wide = [], []
    try:
        paths = {s: make_inputs(d, opts.rows * s, opts.features, opts.csv_rows * s, f"s{s}")
                 for s in (1, 8)}
        write_csv(d / "wide.csv", opts.wide_rows, 1000, np.random.default_rng(1))
        mib = {s: {k: os.path.getsize(p) / 2**20 for k, p in paths[s].items()} for s in (1, 8)}
        mib_wide = os.path.getsize(d / "wide.csv") / 2**20
        out = d / "out"
        for r in range(opts.repeats):
            floor.append(peak_mib([sys.executable, "-c", IMPORTS]))
            for k in sources:
                for s in (1, 8):   # back to back: the ratio is taken within the repeat
                    shutil.rmtree(out, ignore_errors=True)
                    peaks[k, s].append(peak_mib(commands(paths[s], out)[k]))
            shutil.rmtree(out, ignore_errors=True)
            wide.append(peak_mib(prepare("csv", str(d / "wide.csv"), str(out), "--target", "target")))
            print(f"repeat {r + 1}: imports alone {floor[-1]:.0f} MiB; " + "; ".join(
                f"{k} {peaks[k, 1][-1]:.0f} -> {peaks[k, 8][-1]:.0f} MiB" for k in sources)
                + f"; csv 1,000 columns {wide[-1]:.0f} MiB", flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)

    g = res.group("The interpreter with NumPy, h5py and mpilb imported, nothing prepared",
                  f'python -c "{IMPORTS}"')
    res.figure(g, "imports_mib", "peak resident memory, MiB (the floor of every figure below)",
               floor, unit="MiB", digits=0)
    shapes = {"npz": f"{opts.rows:,} x {opts.features} float32, `np.savez`",
              "hdf5": f"{opts.rows:,} x {opts.features} float32, chunked",
              "csv": f"{opts.csv_rows:,} rows x 17 columns"}
    for k in sources:
        cmd = " ".join(["mpilb"] + commands({"npz": "IN.npz", "hdf5": "IN.h5", "csv": "IN.csv"},
                                            Path("OUT"))[k][3:])
        g = res.group(f"`prepare {k}`: 1x = {shapes[k]} ({mib[1][k]:.0f} MiB), 8x = "
                      f"{mib[8][k]:.0f} MiB", cmd)
        p1, p8 = peaks[k, 1], peaks[k, 8]
        res.figure(g, f"{k}_1x_mib", "peak resident memory at 1x, MiB", p1, unit="MiB", digits=0)
        res.figure(g, f"{k}_8x_mib", "peak resident memory at 8x, MiB", p8, unit="MiB", digits=0)
        res.figure(g, f"{k}_ratio", "peak at 8x ÷ peak at 1x", [b / a for a, b in zip(p1, p8)],
                   digits=2, target="<= 1.1")
        res.figure(g, f"{k}_above_floor", "the same, less the imports' floor: (8x − floor) ÷ (1x − floor)",
                   [(b - f) / (a - f) for a, b, f in zip(p1, p8, floor)], digits=2)
    g = res.group(f"`prepare csv`, 1,001 columns x {opts.wide_rows:,} rows ({mib_wide:.0f} MiB) "
                  f"against the 17-column 1x file ({mib[1]['csv']:.0f} MiB)",
                  "mpilb prepare csv WIDE.csv OUT --target target")
    res.figure(g, "wide_mib", "peak resident memory, MiB", wide, unit="MiB", digits=0)
    res.figure(g, "wide_ratio", "peak ÷ the 17-column file's peak at 1x",
               [w / a for w, a in zip(wide, peaks["csv", 1])], digits=2, target="<= 1.1")
    res.write(_results.out_path(opts, NAME))
    print_targets(res.checks())
    return 0 if res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
