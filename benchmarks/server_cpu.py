"""Server CPU while every worker is slow: rank 0 must wait without spinning.

    python benchmarks/server_cpu.py [--repeats 5] [--epochs 3]

``mpiexec -n 4 mpilb train --data DIGITS --model softmax --epochs 3 --batch 32 --inject
"*:delay=0.05"``: every worker sleeps 50 ms per step, so pushes reach rank 0 about 60
times a second and it has nothing to do in between. The figure is the server's CPU time
(``server_cpu_s`` of the run summary: rank 0's process time from the start of training)
over the run's wall time, target at most 5 %. The digits dataset is made once in ``--dir``.
Exit status: 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _runs  # noqa: E402

NAME = "server_cpu"
TARGET = "<= 0.05"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.05, help="seconds each worker sleeps a step")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "mpilb-server-cpu"))
    ap.add_argument("--run-timeout", type=float, default=120.0)
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.epochs = 1, 1
    data = _runs.digits_dataset(opts.dir)
    bench = _runs.Bench(argparse.Namespace(dir=opts.dir, samples=0, features=0, shards=8,
                                           run_timeout=opts.run_timeout),
                        ["--model", "softmax", "--batch", "32"])
    bench.data = data
    res = _results.Results(NAME, "Server CPU while workers are slow", opts)
    inject = f"*:delay={opts.delay:g}"
    runs = [bench.train(f"slow-r{r}", "--epochs", opts.epochs, "--inject", inject)
            for r in range(opts.repeats)]
    g = res.group(f"every worker sleeps {opts.delay * 1000:g} ms a step (`--inject \"{inject}\"`)",
                  f"mpiexec -n 4 mpilb train --data digits --model softmax --batch 32 "
                  f"--epochs {opts.epochs} --inject \"{inject}\" --no-progress")
    res.figure(g, "cpu_fraction", "server CPU time ÷ wall time",
               [x.summary["server_cpu_s"] / x.summary["wall_s"] for x in runs], unit="",
               digits=3, target=TARGET)
    res.figure(g, "server_cpu_s", "server CPU s", [x.summary["server_cpu_s"] for x in runs],
               unit="s", digits=2)
    res.figure(g, "wall_s", "wall time s", [x.summary["wall_s"] for x in runs], unit="s", digits=2)
    res.figure(g, "coverage", "runs with exact coverage (1 = exact)",
               [float(x.coverage_exact()) for x in runs], digits=0, target=">= 1", decide="all")
    _runs.print_targets(res.checks())
    res.write(_results.out_path(opts, NAME))
    return 0 if res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
