"""The README's straggler demo, run as written: the same 20-second run with the `load`
balancer and with a fixed even split, rank 3 four times slower from 3 s on.

    python benchmarks/readme_demo.py [--repeats 5]

Each repeat runs the README's two commands back to back in a fresh folder (the built-in
dataset, `mpiexec -n 4`), then reads both run logs: the mean time of the epochs that start
after the slowdown, `load` over `static` (the README's claim: at most 0.7), and how far rank 3's logged rate drops after
the slowdown against before it (what `rates.png` shows: at most 0.5 of its earlier rate).
Writes benchmarks/results/readme_demo.json, which `python benchmarks/gendocs.py` renders
into README.md. Exit status: 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _runs  # noqa: E402

NAME = "readme_demo"
SLOW_AT = 3.0
# The README's commands, word for word (docs/README: "A straggler and the balancer's answer").
DEMO = 'mpiexec -n 4 mpilb train --max-seconds 20 --epochs 1000 --inject "3:compute=4@3" --balancer {b} --log {b}.h5'
TARGETS = {"ratio": "<= 0.7", "drop": "<= 0.5"}


def command(balancer: str, seconds: float) -> list[str]:
    words = DEMO.format(b=balancer).replace('"', "").split()
    words[0] = _runs.mpiexec()
    i = words.index("mpilb")
    words[i:i + 1] = [sys.executable, "-m", "mpilb"]
    words[words.index("--max-seconds") + 1] = f"{seconds:g}"
    return words


PLOT = os.path.join(_results.REPO, "docs", "img", "straggler-rates.png")


def one_repeat(seconds: float, cache: str, plot: bool = False) -> dict:
    from mpilb.runfiles.runlog import read_columns

    d = tempfile.mkdtemp(prefix="mpilb-demo-")
    try:
        out = {}
        for b in ("load", "static"):
            res = subprocess.run(command(b, seconds), cwd=d, capture_output=True, text=True,
                                 timeout=seconds * 3 + 120, env=dict(os.environ, MPILB_CACHE=cache))
            if res.returncode != 0:
                sys.exit(f"{b}: exit {res.returncode}\n{res.stderr[-2000:]}")
            _, cols = read_columns(os.path.join(d, f"{b}.h5"))
            ep, wk = cols["epochs"], cols["workers"]
            after = ep["t_start"] >= SLOW_AT   # the epochs the straggler slows (static) or not
            out[f"{b}_epoch_s"] = float(np.mean((ep["t_end"] - ep["t_start"])[after]))
            mine = wk["worker"] == 3
            before = wk["rate"][mine & (wk["t"] <= SLOW_AT)]
            after = wk["rate"][mine & (wk["t"] > SLOW_AT + 2.0)]
            if b == "load":
                out["drop"] = float(np.median(after) / np.max(before)) if before.size and after.size else float("nan")
        out["ratio"] = out["load_epoch_s"] / out["static_epoch_s"]
        if plot:   # the README's picture: the load run's rates.png
            subprocess.run([sys.executable, "-m", "mpilb", "report", "load.h5", "--plots", "plots"],
                           cwd=d, check=True, capture_output=True)
            shutil.copy(os.path.join(d, "plots", "rates.png"), PLOT)
        print(f"  load {out['load_epoch_s']:.3f} s/epoch, static {out['static_epoch_s']:.3f}: "
              f"ratio {out['ratio']:.2f}; rank 3's rate after/before {out['drop']:.2f}", flush=True)
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=20.0, help="--max-seconds of each run")
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.seconds = 1, 8.0
    cache = tempfile.mkdtemp(prefix="mpilb-demo-cache-")
    res = _results.Results(NAME, "The README's straggler demo", opts)
    runs = []
    try:
        for r in range(opts.repeats):
            print(f"repeat {r + 1} of {opts.repeats}")
            runs.append(one_repeat(opts.seconds, cache, plot=r == opts.repeats - 1 and not opts.quick))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    g = res.group("The README's two commands, `load` then `static`", DEMO.format(b="load|static"))
    res.figure(g, "ratio", "mean epoch s after the slowdown, load ÷ static", [x["ratio"] for x in runs],
               unit="x", target=TARGETS["ratio"])
    res.figure(g, "drop", "rank 3's logged rate after the slowdown ÷ before it (load run)",
               [x["drop"] for x in runs], unit="x", target=TARGETS["drop"])
    res.figure(g, "load_epoch_s", "load: mean epoch", [x["load_epoch_s"] for x in runs],
               unit="s", digits=3)
    res.figure(g, "static_epoch_s", "static: mean epoch", [x["static_epoch_s"] for x in runs],
               unit="s", digits=3)
    _runs.print_targets(res.checks())
    res.write(_results.out_path(opts, NAME))
    return 0 if res.all_met() else 1

if __name__ == "__main__":
    sys.exit(main())
