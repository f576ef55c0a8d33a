"""The parameter server against a bare MPI loop (`mpilb bench ps`), repeated, as a result file.

    python benchmarks/bench_ps.py [--repeats 5] [--params 1000000] [--seconds 1.5]

Each repeat runs ``mpiexec -n 4 mpilb bench ps --json --repeats 1`` once per optimizer
(sgd, adam), alternating: one invocation times the bare loop of docs/cli.md (one preposted
Irecv per worker, Waitany, ``w -= lr*g``, Isend back) and then the real server against
workers that compute nothing, so its ratio is measured within one run. The figures are the
medians over the repeats, with their ranges; the targets are ratios of at least 0.9 for sgd
and 0.5 for adam.
Exit status: 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _runs  # noqa: E402

NAME = "bench_ps"
TARGETS = {"sgd": ">= 0.9", "adam": ">= 0.5"}


def bench(optimizer: str, params: int, seconds: float, timeout: float) -> dict:
    cmd = [_runs.mpiexec(), "-n", "4", sys.executable, "-m", "mpilb", "bench", "ps", "--json",
           "--repeats", "1", "--params", str(params), "--seconds", str(seconds),
           "--optimizer", optimizer]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        sys.exit(f"bench ps --optimizer {optimizer} failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"  {optimizer:<8} ratio {out['ratio']:.2f}: {out['updates_per_s']:.0f} updates/s, bare "
          f"loop {out['baseline_updates_per_s']:.0f}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--params", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=1.5, help="length of each timed loop")
    ap.add_argument("--optimizers", default="sgd,adam")
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.params, opts.seconds = 1, 100_000, 0.3
    optimizers = opts.optimizers.split(",")
    res = _results.Results(NAME, "Parameter server vs a bare MPI loop (`mpilb bench ps`)", opts)
    runs = {o: [] for o in optimizers}
    for r in range(opts.repeats):
        print(f"repeat {r + 1} of {opts.repeats}")
        for o in optimizers:
            runs[o].append(bench(o, opts.params, opts.seconds, 60 + 10 * opts.seconds))
    for o in optimizers:
        command = (f"mpiexec -n 4 mpilb bench ps --optimizer {o} --params {opts.params} "
                   f"--seconds {opts.seconds:g} --repeats 1 --json")
        g = res.group(f"{o}, {runs[o][0]['params']:,} float32 parameters, 3 workers", command)
        rs = runs[o]
        res.figure(g, f"{o}.ratio", "server updates/s ÷ bare loop updates/s", [x["ratio"] for x in rs],
                   unit="x", target=TARGETS.get(o))
        res.figure(g, f"{o}.server", "server updates/s", [x["updates_per_s"] for x in rs],
                   unit="updates/s", digits=0)
        res.figure(g, f"{o}.bare", "bare loop updates/s", [x["baseline_updates_per_s"] for x in rs],
                   unit="updates/s", digits=0)
        res.figure(g, f"{o}.gbps", "server GB/s in + out", [x["gb_per_s"] for x in rs],
                   unit="GB/s", digits=2)
    _runs.print_targets(res.checks())
    res.write(_results.out_path(opts, NAME))
    return 0 if res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
