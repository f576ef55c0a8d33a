"""Does `mpilb simulate --from RUN.h5` predict what real runs measured? (issue 14)

    python benchmarks/simulate_validation.py [--dir DIR] [--epochs 3] [--json OUT]

One server and three workers (``mpiexec -n 4``) train ``mlp --hidden 256,256 --batch 128``
on a synthetic dataset (96000 x 256, 48 shards; cached in ``--dir``) under three kinds of
heterogeneity, each with the static, load and predictive balancers:

  compute   ``--inject 3:compute=4``      rank 3 computes 4x slower from the start
  readbw    ``--inject 2:readbw=10``      rank 2 reads its shards at 10 MB/s
  late      ``--inject 3:compute=4@T``    rank 3 slows down a third of the way in

plus sync rounds with proportional batches under ``3:compute=4``. For each run,
``mpilb simulate --from`` its own log predicts its mean epoch time; the targets are within
15% for every async run (20% for sync + proportional), and the same order of the three
policies within each scenario as measured. As a what-if, the static run's log is also
replayed under load and predictive (how much would balancing have gained?).

The simulator replays each worker's measured compute, I/O and per-step communication
(from the log's ``workers/`` rows): the machine's contention is in those traces, so a
loaded machine moves measured and predicted figures together, but not exactly. Exit
status 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _runs  # noqa: E402

MODEL = ["--model", "mlp", "--hidden", "256,256", "--batch", "128"]
POLICIES = ["static", "load", "predictive"]
ASYNC_TOL, SYNC_TOL = 0.15, 0.20
TIE = 0.05   # policies measured closer than this are within run-to-run noise


def simulate(log: str, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "mpilb", "simulate", "--from", log, "--json", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        sys.exit(f"simulate --from {log} failed: {res.stderr.strip()}")
    return json.loads(res.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _runs.add_dataset_args(ap, os.path.join(tempfile.gettempdir(), "mpilb-simval"))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--late", type=float, default=None,
                    help="when the late slowdown starts (default: a third of the static run)")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--doc", help="put the table into this markdown file (docs/simulate.md), "
                    "between <!-- validation:begin --> and <!-- validation:end -->")
    opts = ap.parse_args()
    bench = _runs.Bench(opts, MODEL)
    bench.prepare()
    epochs = str(opts.epochs)
    scenarios = {"compute": ["--inject", "3:compute=4"], "readbw": ["--inject", "2:readbw=10"]}
    rows, checks = [], []
    print("runs")
    for name in ["compute", "readbw", "late"]:
        if name == "late":
            start = opts.late
            if start is None:   # a third of the way into a balanced run (compute, load)
                ref = next(r for r in rows if r["scenario"] == "compute" and r["policy"] == "load")
                start = round(ref["measured_epoch_s"] * opts.epochs / 3, 1)
            scenarios[name] = ["--inject", f"3:compute=4@{start:g}"]
        for policy in POLICIES:
            run = bench.train(f"{name}-{policy}", "--epochs", epochs, "--balancer", policy,
                              *scenarios[name])
            pred = simulate(run.log)[0]
            rows.append({"scenario": name, "policy": policy, "mode": "async",
                         "inject": scenarios[name][1], "command": run.command,
                         "measured_epoch_s": run.mean_epoch(),
                         "predicted_epoch_s": pred["epoch_s"],
                         "measured_utilization": run.mean_util(),
                         "predicted_utilization": pred["utilization"]})
        if name == "compute":
            whatif = simulate(os.path.join(bench.logs, "compute-static.h5"),
                              "--balancer", ",".join(POLICIES))
            for res in whatif:
                rows.append({"scenario": "compute (what-if from static's log)", "policy": res["balancer"],
                             "mode": "async", "inject": "3:compute=4", "command": "",
                             "measured_epoch_s": None, "predicted_epoch_s": res["epoch_s"],
                             "measured_utilization": None, "predicted_utilization": res["utilization"]})
    run = bench.train("sync-proportional", "--epochs", epochs, "--mode", "sync", "--batch-policy",
                      "proportional", "--rebalance-interval", "0.5", "--inject", "3:compute=4")
    pred = simulate(run.log)[0]
    rows.append({"scenario": "sync proportional", "policy": "load", "mode": "sync",
                 "inject": "3:compute=4", "command": run.command,
                 "measured_epoch_s": run.mean_epoch(), "predicted_epoch_s": pred["epoch_s"],
                 "measured_utilization": run.mean_util(), "predicted_utilization": pred["utilization"]})

    print("\nscenario                              policy      measured s  predicted s   error   util meas/pred")
    for r in rows:
        if r["measured_epoch_s"] is None:
            print(f"{r['scenario']:<37} {r['policy']:<11} {'':>10} {r['predicted_epoch_s']:>11.3f}"
                  f" {'':>7}   {'':>4} /{r['predicted_utilization']:.2f}")
            continue
        r["error"] = r["predicted_epoch_s"] / r["measured_epoch_s"] - 1.0
        tol = SYNC_TOL if r["mode"] == "sync" else ASYNC_TOL
        print(f"{r['scenario']:<37} {r['policy']:<11} {r['measured_epoch_s']:>10.3f} "
              f"{r['predicted_epoch_s']:>11.3f} {r['error']:>+7.1%}   "
              f"{r['measured_utilization']:.2f}/{r['predicted_utilization']:.2f}")
        checks.append((f"{r['scenario']} {r['policy']}: predicted within {tol:.0%}",
                       abs(r["error"]) <= tol, f"{r['error']:+.1%}"))
    for name in ["compute", "readbw", "late"]:
        mine = [r for r in rows if r["scenario"] == name]
        measured = [r["policy"] for r in sorted(mine, key=lambda r: r["measured_epoch_s"])]
        predicted = [r["policy"] for r in sorted(mine, key=lambda r: r["predicted_epoch_s"])]
        # a pair measured within TIE of each other is a tie: either order is right
        swapped = [(a["policy"], b["policy"]) for a in mine for b in mine
                   if a["measured_epoch_s"] < b["measured_epoch_s"]
                   and a["predicted_epoch_s"] > b["predicted_epoch_s"]]
        ties = all(abs(dict((r["policy"], r["measured_epoch_s"]) for r in mine)[a]
                       / dict((r["policy"], r["measured_epoch_s"]) for r in mine)[b] - 1) < TIE
                   for a, b in swapped)
        order = f"measured {' < '.join(measured)}; predicted {' < '.join(predicted)}"
        checks.append((f"{name}: policies ranked as measured (pairs measured within {TIE:.0%} "
                       f"are ties)", ties, order + ("" if measured == predicted else
                                                     f"; swapped {swapped}")))
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} (other processes share this machine)")
    _runs.print_targets(checks)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"rows": rows, "checks": [{"name": n, "ok": ok, "value": v} for n, ok, v in checks],
                       "loadavg": os.getloadavg()[0]}, fh, indent=1)
    if opts.doc:
        write_doc(opts.doc, rows, checks)
    return 0 if all(ok for _, ok, _ in checks) else 1


def write_doc(path: str, rows: list[dict], checks) -> None:
    """The validation table and targets into docs/simulate.md's marked block."""
    import re

    md = ["| scenario | policy | measured epoch s | predicted epoch s | error | utilization measured / predicted |",
          "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["measured_epoch_s"] is None:
            md.append(f"| {r['scenario']} | {r['policy']} | | {r['predicted_epoch_s']:.3f} | | "
                      f"/ {r['predicted_utilization']:.2f} |")
        else:
            md.append(f"| {r['scenario']} | {r['policy']} | {r['measured_epoch_s']:.3f} | "
                      f"{r['predicted_epoch_s']:.3f} | {r['error']:+.1%} | "
                      f"{r['measured_utilization']:.2f} / {r['predicted_utilization']:.2f} |")
    md += ["", "Targets:", ""] + [f"- {'PASS' if ok else 'MISS'} {n}: {v}" for n, ok, v in checks]
    md += ["", f"Measured with `python benchmarks/simulate_validation.py`; load average "
           f"{os.getloadavg()[0]:.1f} at the end (other jobs shared the 2 cores). Runs:", ""]
    md += [f"    {r['command']}" for r in rows if r["command"]]
    with open(path) as fh:
        doc = fh.read()
    block = "<!-- validation:begin -->\n" + "\n".join(md) + "\n<!-- validation:end -->"
    doc, n = re.subn(r"<!-- validation:begin -->.*?<!-- validation:end -->", lambda _: block, doc,
                     flags=re.S)
    if n != 1:
        sys.exit(f"{path}: no <!-- validation:begin --> ... <!-- validation:end --> block")
    with open(path, "w") as fh:
        fh.write(doc)


if __name__ == "__main__":
    sys.exit(main())
