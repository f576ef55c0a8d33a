"""Parameter stores (--servers K): K=2 against K=1, and one store against the bare loop.

    python benchmarks/servers.py [--repeats 5] [--params 4000000] [--seconds 2] [--quick] [--out FILE]

(a) ``mpiexec -n 5 mpilb bench ps --params 4000000 --servers 2`` against ``--servers 1``: the
    two run back to back in each repeat (null workers, the real server and stores, sgd), and
    the ratios are taken within a repeat: rank 0's CPU seconds per update and bytes per
    update (targets <= 0.6 x), rank 0's CPU seconds over the timed phase, and the aggregate
    updates/s (target >= 1.2 x). The per-store figures of the K=2 runs (updates, bytes in
    and out per update, CPU seconds) show where the time goes.
(b) ``mpiexec -n 4 mpilb bench ps --params 1000000``: the real server (one store) against the
    bare loop in the same run (target >= 0.9), the ratio of each repeat.

Prints medians (min-max) and writes benchmarks/results/servers.json (_results.py's layout).
Exit status: 0 when every target is met, 1 otherwise.
On a machine with fewer cores than ranks the ranks share CPUs: the figures then measure
CPU contention as much as the stores (the notes record the load average).
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

NAME = "servers"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(n: int, *args) -> dict:
    cmd = [_runs.mpiexec(), "-n", str(n), sys.executable, "-m", "mpilb", "bench", "ps", "--json",
           *map(str, args)]
    for attempt in range(2):   # once more if a rank was killed from outside (a shared machine)
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
        if res.returncode == 0:
            break
        print(f"{' '.join(cmd)} failed ({res.returncode}):\n{(res.stdout + res.stderr)[-2000:]}",
              file=sys.stderr, flush=True)
    else:
        sys.exit(1)
    return json.loads(res.stdout.strip().splitlines()[-1])


def rank0(result: dict) -> dict:
    """Rank 0's per-update CPU seconds and bytes, and its CPU seconds, of a one-repeat bench;
    each store's counters."""
    run = result["runs"][0]
    s0 = next(s for s in run["servers"] if s["rank"] == 0)
    updates = max(1, run["updates"])
    return {"cpu_per_update": run["server_cpu_s"] / updates,
            "bytes_per_update": (s0["bytes_in"] + s0["bytes_out"]) / updates,
            "cpu_s": run["server_cpu_s"], "updates_per_s": run["updates_per_s"],
            "stores": [{**s, "per_update_bytes": (s["bytes_in"] + s["bytes_out"]) / updates}
                       for s in run["servers"]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--params", type=int, default=4_000_000)
    ap.add_argument("--seconds", type=float, default=2.0, help="length of each timed phase")
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.params, opts.seconds = 1, 100_000, 0.5
    res = _results.Results(NAME, "Parameter stores (`--servers K`)", opts)
    common = ["--params", opts.params, "--seconds", opts.seconds, "--repeats", 1]
    one, two = [], []
    for i in range(opts.repeats):   # back to back, so both see the same machine load
        one.append(rank0(bench(5, *common, "--servers", 1)))
        two.append(rank0(bench(5, *common, "--servers", 2)))
        print(f"repeat {i + 1} of {opts.repeats}: K=1 {one[-1]['updates_per_s']:.0f} updates/s, "
              f"K=2 {two[-1]['updates_per_s']:.0f} updates/s", flush=True)

    def ratio(key):
        return [b[key] / a[key] for a, b in zip(one, two)]

    cmd = (f"mpiexec -n 5 mpilb bench ps --params {opts.params} --seconds {opts.seconds:g} "
           f"--repeats 1 --json --servers 2 (and --servers 1)")
    g = res.group("(a) two parameter stores against one: 5 ranks, K stores and 5-K workers", cmd)
    res.figure(g, "rank0_cpu_per_update", "rank 0 CPU seconds per update, K=2 / K=1",
               ratio("cpu_per_update"), unit="x", target="<= 0.6")
    res.figure(g, "rank0_bytes_per_update", "rank 0 bytes per update, K=2 / K=1",
               ratio("bytes_per_update"), unit="x", target="<= 0.6")
    res.figure(g, "rank0_cpu_s", "rank 0 CPU seconds in the timed phase, K=2 / K=1",
               ratio("cpu_s"), unit="x")
    res.figure(g, "updates_per_s", "aggregate updates/s, K=2 / K=1", ratio("updates_per_s"),
               unit="x", target=">= 1.2")
    for k, runs in ((1, one), (2, two)):
        res.figure(g, f"k{k}.updates_per_s", f"K={k} updates/s", [r["updates_per_s"] for r in runs],
                   unit="updates/s", digits=0)
        for s in range(k):
            res.figure(g, f"k{k}.store{s}.cpu_s", f"K={k}: store {s} CPU seconds",
                       [r["stores"][s]["cpu_s"] for r in runs], unit="s")
            res.figure(g, f"k{k}.store{s}.mb", f"K={k}: store {s} MB in + out per update",
                       [r["stores"][s]["per_update_bytes"] / 1e6 for r in runs], unit="MB", digits=1)
    p1 = 100_000 if opts.quick else 1_000_000
    reps = 1 if opts.quick else max(5, opts.repeats)
    cmd_b = f"mpiexec -n 4 mpilb bench ps --params {p1} --seconds {opts.seconds:g} --repeats {reps} --json"
    b = bench(4, "--params", p1, "--seconds", opts.seconds, "--repeats", reps)
    g = res.group("(b) the real server (one store) against the bare loop, in the same run", cmd_b)
    res.figure(g, "ps_ratio", "server updates/s / bare loop updates/s", b["ratios"], unit="x",
               target=">= 0.9")
    for grp in res.groups:
        print(f"\n{grp['title']}\n  {grp['command']}")
        for f in grp["figures"]:
            print(f"  {f['label']:<52} {_results.fmt_range(f)} {f['unit']}")
    _runs.print_targets(res.checks())
    res.write(_results.out_path(opts, NAME))
    return 0 if res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
