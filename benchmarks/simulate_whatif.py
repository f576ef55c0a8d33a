"""What-if tables for 8, 64 and 256 nodes from `mpilb simulate`'s network model (issue 33).

    python benchmarks/simulate_whatif.py [--quick] [--out benchmarks/results/simulate_whatif.json]

Each node count is one cluster: 9 ranks per node (with one store per node: a store and 8
workers), 10 Gbit/s links, workers computing lognormal rates (mean 200 samples/s, sigma
0.3) with 10% of the ranks 4x slow, a 10M-parameter model, batch 64, 1 epoch of 24 steps per
worker on average. Every combination of store layout (1 store, N/8 stores, one per node),
wire format (fp32, bf16) and balancer (static, load) is simulated (at 256 nodes without the
single store: its link cannot serve 2048 workers, as the 64-node rows show); the figure is the epoch
time, with updates/s, the busiest link's load and the store's busy fraction beside it.

The speed targets are timed here too: the per-node what-if at 64 nodes (512 workers) in
<= 60 s and at 256 nodes (2048 workers) in <= 300 s, wall clock of the whole command (two
wires x two balancers), measured once (see the machine's load in the notes).

Writes ``benchmarks/results/simulate_whatif.json``; ``python benchmarks/gendocs.py`` renders it
into docs/simulate.md. Exit 1 when a speed target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402

RANKS_PER_NODE = 9
STEPS = 24          # per worker and epoch, on average
BATCH = 64


def command(nodes: int, servers: str, quick: bool = False) -> list[str]:
    ranks = nodes * RANKS_PER_NODE
    slow = max(1, ranks // 10)
    samples = (ranks - nodes) * STEPS * BATCH // (4 if quick else 1)
    return ["--nodes", str(nodes), "--ranks-per-node", str(RANKS_PER_NODE),
            "--link-rate", "10gbit", "--params", "10000000", "--batch", str(BATCH),
            "--rates", "lognormal:mean=200,sigma=0.3", "--inject", f"1-{slow}:compute=4",
            "--samples", str(samples), "--shards", str(4 * ranks), "--epochs", "1",
            "--servers", servers, "--wire", "fp32,bf16", "--balancer", "static,load"]


def simulate(args: list[str]) -> tuple[list[dict], float, float]:
    """The results, the wall seconds and the CPU seconds of one command."""
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run([sys.executable, "-m", "mpilb", "simulate", *args, "--json"],
                         capture_output=True, text=True, timeout=3600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        sys.exit(f"mpilb simulate {shlex.join(args)} failed: {res.stderr.strip()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(res.stdout), time.perf_counter() - t0, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _results.add_output_args(ap, "simulate_whatif")
    ap.add_argument("--nodes", default="8,64,256", help="node counts (default 8,64,256)")
    opts = ap.parse_args()
    results = _results.Results("simulate_whatif", "What-if tables of the network model", opts)
    speed = {}
    for nodes in [int(n) for n in opts.nodes.split(",")]:
        # one store for 2048 workers is hopeless (the 64-node rows show it) and slow to
        # simulate: the task ledger splits tasks for idle workers all the time
        layouts = (["1"] if nodes < 256 else []) + [str(max(2, nodes // 8)), "per-node"]
        rows = []
        for servers in layouts:
            args = command(nodes, servers, opts.quick)
            out, wall, cpu = simulate(args)
            print(f"{wall:7.1f} s ({cpu:.1f} s CPU)  mpilb simulate {shlex.join(args)}", flush=True)
            rows.append((servers, args, out))
            if servers == "per-node":
                speed[nodes] = (args, wall, cpu)
        for servers, args, out in rows:
            workers = out[0]["workers"]
            what = ("a store per node" if servers == "per-node" else
                    f"{servers} store{'s' if servers != '1' else ''}")
            g = results.group(f"{nodes} nodes, {what} ({workers} workers): epoch seconds",
                              "mpilb simulate " + shlex.join(args))
            for r in out:
                net = r["network"]
                label = (f"{net['wire']}, {r['balancer']} ({r['updates_per_s']:.0f} updates/s, "
                         f"busiest link {net['busiest_link']:.2f}, store {r['server_busy']:.2f})")
                results.figure(g, f"n{nodes}.{servers}.{net['wire']}.{r['balancer']}", label,
                               [r["epoch_s"]], unit="s", digits=1)
    g = results.group("Speed: the per-node what-if, wall seconds of the whole command "
                      "(4 configurations)", "")
    targets = {64: "<= 60", 256: "<= 300"}
    for nodes, (args, wall, cpu) in speed.items():
        results.figure(g, f"speed.n{nodes}", f"{nodes} nodes ({cpu:.1f} s of CPU)", [wall],
                       unit="s", digits=1, target=None if opts.quick else targets.get(nodes),
                       command="time mpilb simulate " + shlex.join(args))
    results.write(_results.out_path(opts, "simulate_whatif"))
    return 0 if results.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
