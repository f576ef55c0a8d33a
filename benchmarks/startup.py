"""Start-up of rank 0 on a large dataset: the first start (every file checked) against a
second one (files recorded as verified are not checked again; mpilb/data/verified.py).

Measured from the launch of ``mpiexec -n 2 mpilb train`` to the start of training on rank 0
(the first shard assignment), which the first progress line tells: with
``--progress-interval 0.01`` it comes 10-20 ms after the start and states its own delay
(``mpilb [    0.0 s]``), which is subtracted. Before each "first" start the verification
records are removed; the files stay in the page cache (prepared or read just before), as on
a requeue.

    python benchmarks/startup.py DIR [--repeats 5]

DIR is made with e.g. ``mpilb prepare synthetic DIR --samples 2000000 --features 256
--classes 10 --shards 32 --test-fraction 0.01`` (2.07 GB).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runs import mpiexec  # noqa: E402

LINE = re.compile(r"^mpilb \[\s*([\d.]+) s\]")


def forget(data: str) -> None:
    """Remove the verification records of `data` (beside it and in $MPILB_CACHE)."""
    from mpilb.data.verified import VerifiedFiles

    for p in VerifiedFiles(data).paths:
        if p.exists():
            p.unlink()


def start_seconds(data: str, log: str) -> float:
    """Seconds from launch to the start of training on rank 0."""
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "mpilb", "train", "--data", data,
           "--model", "softmax", "--epochs", "1", "--max-seconds", "0.3", "--eval-interval", "100",
           "--progress-interval", "0.01", "--log", log]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    for line in proc.stderr:
        m = LINE.match(line)
        if m and first is None:
            first = time.monotonic() - t0 - float(m.group(1))
    if proc.wait(timeout=600) != 0 or first is None:
        raise SystemExit(f"run failed (rc {proc.returncode}): {' '.join(cmd)}")
    os.unlink(log)
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    size = sum(p.stat().st_size for p in Path(args.data).glob("*.h5"))
    firsts, seconds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "run.h5")
        for i in range(args.repeats):
            forget(args.data)
            firsts.append(start_seconds(args.data, log))
            seconds.append(start_seconds(args.data, log))
            print(f"repeat {i}: first start {firsts[-1]:.2f} s, second start {seconds[-1]:.2f} s",
                  flush=True)
    f, s = np.array(firsts), np.array(seconds)
    ratio = s / f
    print(f"dataset {args.data}: {size / 1e9:.2f} GB in {len(list(Path(args.data).glob('*.h5')))} files")
    print(f"first start  (all files checked):  median {np.median(f):.2f} s  (min {f.min():.2f}, max {f.max():.2f})")
    print(f"second start (records trusted):    median {np.median(s):.2f} s  (min {s.min():.2f}, max {s.max():.2f})")
    print(f"second / first: median {np.median(ratio):.3f}  (min {ratio.min():.3f}, max {ratio.max():.3f}); "
          f"target <= 0.1: {'PASS' if np.median(ratio) <= 0.1 else 'MISS'}")


if __name__ == "__main__":
    main()
