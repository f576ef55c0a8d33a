"""What --wire bf16/fp16's CPU casts cost, with numpy's arithmetic and with torch's casts.

    python benchmarks/wire_casts.py [--repeats 5] [--floats 270000] [--out FILE]

mpilb.mpi.wire_format converts on the CPU with numpy, or with torch where the process has
imported torch already (a torch model's ranks). For each format and direction (encode:
float32 to the wire, decode: back), in each repeat, both ways in turn on the same vector
(one thread, as the launcher gives each rank): microseconds per cast (the median of 50
casts), and numpy's time over torch's in that repeat. Each repeat also checks that the two
give the same bits. The vector is finite, as gradients and parameters are (NaN's handling:
tests/unit/test_wire_format.py). Writes
benchmarks/results/wire_casts.json; ``python benchmarks/gendocs.py`` renders it into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")   # before numpy and torch: one thread a rank
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
from mpilb.mpi import wire_format as F  # noqa: E402

NAME = "wire_casts"
CASTS = 50


def timed(fn) -> float:
    """Microseconds per call: the median of CASTS calls (after one to warm up)."""
    fn()
    times = []
    for _ in range(CASTS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def one_repeat(fmt, x: np.ndarray, torch) -> dict:
    """{(direction, way): microseconds} for one format, both ways in turn, bits checked."""
    n = x.size
    out = {}
    results = {}
    for way in ("numpy", "torch"):
        saved = sys.modules.get("torch")
        sys.modules["torch"] = torch if way == "torch" else None   # what wire_format sees
        try:
            enc = np.empty(n, fmt.wire_dtype)
            dec = np.empty(n, np.float32)
            scratch = fmt.scratch(n, np)
            with np.errstate(invalid="ignore"):
                out[("encode", way)] = timed(lambda: fmt.encode(x, enc, np, scratch))
            out[("decode", way)] = timed(lambda: fmt.decode(enc, dec, np))
            results[way] = (enc.copy(), dec.copy())
        finally:
            sys.modules["torch"] = saved
    finite = ~np.isnan(x)
    (en, dn), (et, dt) = results["numpy"], results["torch"]
    if not (np.array_equal(en[finite], et[finite]) and np.array_equal(dn[finite], dt[finite])
            and np.isnan(dt[~finite]).all()):
        sys.exit(f"{fmt.name}: torch's casts differ from numpy's")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--floats", type=int, default=270_000,
                    help="vector length (default: about the torch MLP of cluster.py's case d)")
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.floats = 1, 20_000
    try:
        import torch
    except ImportError:
        sys.exit("torch is not installed: nothing to compare numpy's casts with")
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(opts.floats) * 3).astype(np.float32)   # finite, as gradients and
    # parameters are (a vector holding a NaN costs both ways bf16's repair pass as well)
    res = _results.Results(NAME, "--wire's CPU casts: numpy's and torch's", opts)
    for name in ("bf16", "fp16"):
        fmt = F.wire_format(name)
        runs = [one_repeat(fmt, x, torch) for _ in range(opts.repeats)]
        g = res.group(f"{name}, {opts.floats:,} floats, one thread: microseconds per cast",
                      f"python benchmarks/wire_casts.py --floats {opts.floats}")
        for direction in ("encode", "decode"):
            for way in ("numpy", "torch"):
                res.figure(g, f"{name}-{direction}-{way}", f"{direction}, {way}",
                           [r[(direction, way)] for r in runs], unit="us", digits=0)
            res.figure(g, f"{name}-{direction}-ratio", f"{direction}: numpy ÷ torch (same repeat)",
                       [r[(direction, "numpy")] / r[(direction, "torch")] for r in runs],
                       unit="x", digits=1)
            print(f"{name} {direction}: numpy "
                  f"{statistics.median(r[(direction, 'numpy')] for r in runs):.0f} us, torch "
                  f"{statistics.median(r[(direction, 'torch')] for r in runs):.0f} us", flush=True)
    res.write(_results.out_path(opts, NAME))
    return 0


if __name__ == "__main__":
    sys.exit(main())
