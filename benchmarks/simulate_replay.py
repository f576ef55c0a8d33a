"""Replays of one-node runs under the other policy: static <-> load, N tries (issue 33).

    python benchmarks/simulate_replay.py [--tries 5] [--dir DIR] [--reuse] [--out FILE]

Each try is a pair of real runs, one server and three workers on this machine
(``mpiexec -n 4 mpilb train``, mlp 256,256 on 96000 x 256 samples, batch 128, 3 epochs,
``--inject 3:compute=4``), with ``--balancer static`` and ``--balancer load``. Each run's log
is replayed with ``mpilb simulate --from RUN.h5 --balancer static,load``, and the predicted
mean epoch times are compared with the measured ones of the same try:

  static from load's log    what static would have taken, predicted from the load run
  load from static's log    what load would have gained, predicted from the static run
  own policy                each run replayed under its own policy (static, load)

Target: every prediction within 15% in every try. The two runs of a try follow each other,
so a machine whose load changes between them (other jobs) moves the measured times apart
and the cross-policy predictions with them; the own-policy replays are immune to that.
``--reuse`` keeps run logs already in ``--dir`` (from the same commands) instead of running
them again. Writes ``benchmarks/results/simulate_replay.json`` (``python benchmarks/gendocs.py``
renders it into docs/simulate.md); exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _runs  # noqa: E402

MODEL = ["--model", "mlp", "--hidden", "256,256", "--batch", "128"]
INJECT = "3:compute=4"
TOL = 0.15


def replay(log: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "mpilb", "simulate", "--from", log, "--balancer",
                          "static,load", "--json"], capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        sys.exit(f"simulate --from {log} failed: {res.stderr.strip()}")
    out = json.loads(res.stdout)
    return {r["balancer"]: r["epoch_s"] for r in out} | {"measured": out[0]["measured_epoch_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _results.add_output_args(ap, "simulate_replay")
    _runs.add_dataset_args(ap, os.path.join(tempfile.gettempdir(), "mpilb-simreplay"))
    ap.add_argument("--tries", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--reuse", action="store_true", help="keep run logs already in --dir")
    opts = ap.parse_args()
    if opts.quick:
        opts.tries, opts.epochs = 1, 1
    results = _results.Results("simulate_replay", "Replays of one-node runs under the other "
                               "policy", opts)
    bench = _runs.Bench(opts, MODEL)
    bench.prepare()
    errors = {k: [] for k in ("static<-load", "load<-static", "static<-static", "load<-load")}
    commands = {}
    for i in range(opts.tries):
        got = {}
        for policy in ("static", "load"):
            label = f"try{i}-{policy}"
            log = os.path.join(bench.logs, f"{label}.h5")
            args = ["--epochs", str(opts.epochs), "--balancer", policy, "--inject", INJECT]
            commands[policy] = (f"mpiexec -n 4 mpilb train --data {bench.data} {' '.join(MODEL)} "
                                f"--no-progress {' '.join(args)} --log RUN.h5")
            if not (opts.reuse and os.path.exists(log)):
                bench.train(label, *args)
            got[policy] = replay(log)
        ms, ml = got["static"]["measured"], got["load"]["measured"]
        pairs = {"static<-load": (got["load"]["static"], ms), "load<-static": (got["static"]["load"], ml),
                 "static<-static": (got["static"]["static"], ms), "load<-load": (got["load"]["load"], ml)}
        line = []
        for key, (pred, meas) in pairs.items():
            errors[key].append(pred / meas - 1)
            line.append(f"{key} {pred:.2f}/{meas:.2f} ({pred / meas - 1:+.0%})")
        print(f"  try {i}: " + ", ".join(line), flush=True)
    g = results.group(f"{opts.tries} tries, each a static and a load run with {INJECT}: "
                      f"|predicted / measured - 1| of the mean epoch time", "",
                      note="Per try, in order: " + "; ".join(
                          f"{k}: {', '.join(f'{e:+.0%}' for e in v)}" for k, v in errors.items())
                      + f". Runs: `{commands['static']}` and the same with `--balancer load`; "
                        f"replays: `mpilb simulate --from RUN.h5 --balancer static,load`.")
    labels = {"static<-load": "static, predicted from the load run's log",
              "load<-static": "load, predicted from the static run's log",
              "static<-static": "static, from its own log", "load<-load": "load, from its own log"}
    for key, vals in errors.items():
        results.figure(g, key, labels[key], [abs(v) for v in vals], digits=2,
                       target=f"<= {TOL:g}", decide="all")
    results.write(_results.out_path(opts, "simulate_replay"))
    _runs.print_targets(results.checks())
    return 0 if results.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
