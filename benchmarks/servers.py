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

Prints medians (min-max) and writes benchmarks/results/servers.json: {name, title, argv,
quick, machine, groups: [{title, command, figures: [{id, label, unit, digits, command,
repeats, values, median, min, max, target, result}]}], elapsed_s}.
On a machine with fewer cores than ranks the ranks share CPUs: the figures then measure
CPU contention as much as the stores (the notes record the load average).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from _runs import mpiexec

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def bench(n: int, *args) -> dict:
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpilb", "bench", "ps", "--json", *map(str, args)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def rank0(result: dict) -> dict:
    """Rank 0's per-update CPU seconds and bytes, and its CPU seconds, of a one-repeat bench."""
    run = result["runs"][0]
    s0 = next(s for s in run["servers"] if s["rank"] == 0)
    updates = max(1, run["updates"])
    return {"cpu_per_update": run["server_cpu_s"] / updates,
            "bytes_per_update": (s0["bytes_in"] + s0["bytes_out"]) / updates,
            "cpu_s": run["server_cpu_s"], "updates_per_s": run["updates_per_s"],
            "stores": [{**s, "per_update_bytes": (s["bytes_in"] + s["bytes_out"]) / updates}
                       for s in run["servers"]]}


def figure(fid, label, values, unit="x", digits=2, target=None, command=""):
    med = statistics.median(values)
    result = None
    if target is not None:
        op, bound = target.split()
        result = "PASS" if (med <= float(bound) if op == "<=" else med >= float(bound)) else "MISS"
    return {"id": fid, "label": label, "unit": unit, "digits": digits, "command": command,
            "repeats": len(values), "values": values, "median": med, "min": min(values),
            "max": max(values), "target": target, "result": result}


def show(group):
    print(f"\n{group['title']}\n  {group['command']}")
    for f in group["figures"]:
        d = f["digits"]
        mark = f"  target {f['target']}: {f['result']}" if f["target"] else ""
        print(f"  {f['label']:<52} {f['median']:.{d}f} {f['unit']} "
              f"({f['min']:.{d}f}-{f['max']:.{d}f}, n={f['repeats']}){mark}")


def machine(load_start):
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=REPO).stdout.strip()
    load_end = os.getloadavg()[0]
    cores = os.cpu_count()
    notes = ("other processes were loading the machine (load average above the core count)"
             if max(load_start, load_end) > cores else "")
    return {"cpu": platform.processor() or platform.machine(), "cores": cores,
            "python": platform.python_version(), "commit": commit,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_start": load_start,
            "load_end": load_end, "notes": notes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--params", type=int, default=4_000_000)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--quick", action="store_true", help="tiny runs, one repeat (checks the script)")
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    if opts.quick:
        opts.repeats, opts.params, opts.seconds = 1, 100_000, 0.5
    out = opts.out or (os.path.join("/tmp", "mpilb-bench-servers.quick.json") if opts.quick
                       else os.path.join(HERE, "results", "servers.json"))
    t0, load_start = time.monotonic(), os.getloadavg()[0]
    common = ["--params", opts.params, "--seconds", opts.seconds, "--repeats", 1]
    one, two = [], []
    for i in range(opts.repeats):   # back to back, so both see the same machine load
        one.append(rank0(bench(5, *common, "--servers", 1)))
        two.append(rank0(bench(5, *common, "--servers", 2)))
        print(f"repeat {i + 1}: K=1 {one[-1]['updates_per_s']:.0f} updates/s, "
              f"K=2 {two[-1]['updates_per_s']:.0f} updates/s", flush=True)
    ratio = lambda key: [b[key] / a[key] for a, b in zip(one, two)]   # noqa: E731
    cmd_a = f"mpiexec -n 5 mpilb bench ps --params {opts.params} --servers 2 (and --servers 1)"
    per_store = []
    for s in range(2):
        per_store.append(figure(f"k2_store{s}_cpu_s", f"K=2: store {s} CPU seconds",
                                [r["stores"][s]["cpu_s"] for r in two], "s", 2, command=cmd_a))
        per_store.append(figure(f"k2_store{s}_bytes", f"K=2: store {s} MB per update (in+out)",
                                [r["stores"][s]["per_update_bytes"] / 1e6 for r in two], "MB", 1,
                                command=cmd_a))
    groups = [{
        "title": "(a) two parameter stores against one (5 ranks: K stores, 5-K workers)",
        "command": cmd_a,
        "figures": [
            figure("rank0_cpu_per_update", "rank 0 CPU seconds per update, K=2 / K=1",
                   ratio("cpu_per_update"), target="<= 0.6", command=cmd_a),
            figure("rank0_bytes_per_update", "rank 0 bytes per update, K=2 / K=1",
                   ratio("bytes_per_update"), target="<= 0.6", command=cmd_a),
            figure("rank0_cpu_s", "rank 0 CPU seconds (timed phase), K=2 / K=1",
                   ratio("cpu_s"), command=cmd_a),
            figure("updates_per_s", "aggregate updates/s, K=2 / K=1", ratio("updates_per_s"),
                   target=">= 1.2", command=cmd_a),
            figure("k1_updates_per_s", "K=1 updates/s", [r["updates_per_s"] for r in one],
                   "1/s", 0, command=cmd_a),
            figure("k2_updates_per_s", "K=2 updates/s", [r["updates_per_s"] for r in two],
                   "1/s", 0, command=cmd_a),
            *per_store,
        ]}]
    p1 = 100_000 if opts.quick else 1_000_000
    cmd_b = f"mpiexec -n 4 mpilb bench ps --params {p1} --repeats {max(5, opts.repeats)}"
    b = bench(4, "--params", p1, "--seconds", opts.seconds, "--repeats", 1 if opts.quick else max(5, opts.repeats))
    groups.append({"title": "(b) the real server (one store) against the bare loop, same run",
                   "command": cmd_b,
                   "figures": [figure("ps_ratio", "real server / bare loop updates/s",
                                      b["ratios"], target=">= 0.9", command=cmd_b)]})
    for g in groups:
        show(g)
    doc = {"name": "servers", "title": "Parameter stores (--servers K)", "argv": sys.argv[1:],
           "quick": opts.quick, "machine": machine(load_start), "groups": groups,
           "elapsed_s": time.monotonic() - t0}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
