"""Time and memory of `mpilb prepare synthetic` and `mpilb data verify` on a large dataset.

    python benchmarks/prepare.py [--repeats 3] [--samples 1000000] [--features 128]

Each repeat prepares ``--samples x --features`` float32 samples (10 classes, 64 shards) into
a fresh directory, then verifies it (checksums and every value). Figures: seconds for each,
the prepare process's peak resident memory (its ``ru_maxrss``) and the bytes written.
Samples are generated and written in chunks, so the peak does not grow with the dataset.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402

NAME = "prepare"


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one child process."""
    code = ("import resource, subprocess, sys, time\n"
            "t = time.perf_counter()\n"
            "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
            "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    out = subprocess.run([sys.executable, "-c", code, *cmd], check=True, capture_output=True,
                         text=True).stdout.split()
    return float(out[0]), float(out[1]) / 1024


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the datasets are written")
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.samples = 1, 20_000
    res = _results.Results(NAME, "Dataset preparation", opts)
    prep = f"mpilb prepare synthetic DIR --samples {opts.samples} --features {opts.features} " \
           f"--classes 10 --shards {opts.shards}"
    secs, rss, written, verify = [], [], [], []
    for r in range(opts.repeats):
        out = os.path.join(opts.dir, f"mpilb-prepare-bench-{os.getpid()}")
        shutil.rmtree(out, ignore_errors=True)
        try:
            s, m = timed([sys.executable, "-m", "mpilb", "prepare", "synthetic", out, "--samples",
                          str(opts.samples), "--features", str(opts.features), "--classes", "10",
                          "--shards", str(opts.shards)])
            written.append(dir_bytes(out) / 1e6)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "mpilb", "data", "verify", out], check=True,
                           capture_output=True)
            verify.append(time.perf_counter() - t)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        secs.append(s)
        rss.append(m)
        print(f"  repeat {r + 1}: prepare {s:.2f} s, peak {m:.0f} MiB, {written[-1]:.0f} MB; "
              f"verify {verify[-1]:.2f} s", flush=True)
    g = res.group(f"{opts.samples:,} x {opts.features} float32 samples, {opts.shards} shards", prep)
    res.figure(g, "prepare_s", "prepare: seconds", secs, unit="s", digits=2)
    res.figure(g, "peak_rss_mib", "prepare: peak resident memory, MiB", rss, unit="MiB", digits=0)
    res.figure(g, "written_mb", "prepare: MB written", written, unit="MB", digits=0)
    res.figure(g, "verify_s", "`mpilb data verify DIR`: seconds", verify, unit="s", digits=2,
               command="mpilb data verify DIR")
    res.write(_results.out_path(opts, NAME))
    return 0


if __name__ == "__main__":
    sys.exit(main())
