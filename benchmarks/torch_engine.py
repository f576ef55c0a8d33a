"""Everything else works with a torch model: the engine's modes, corrections, stores,
pipelining, resume onto fewer ranks, and load balancing, each run once with a torch MLP
(examples/torch_mlp.py) on a synthetic dataset.

    python benchmarks/torch_engine.py [--samples 48000] [--features 64] [--shards 24]

Prints one line per configuration (accuracy, coverage) and, for balancing, the mean epoch
time after the first epoch of `--balancer load` against `--balancer static` with
`--inject 3:compute=4` in the same script. Target (issue 12): every run exits 0 with exact
coverage; load <= 0.7 x static.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runs import mpiexec, print_targets  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/mpilb-torch-engine")
    ap.add_argument("--samples", type=int, default=48000)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--shards", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--balance-epochs", type=int, default=5)
    opts = ap.parse_args()
    from mpilb.dataset import prepare_synthetic
    from mpilb.report import summarize_log

    os.makedirs(opts.dir, exist_ok=True)
    data = os.path.join(opts.dir, f"synthetic-{opts.samples}x{opts.features}")
    if not os.path.exists(os.path.join(data, "manifest.json")):
        prepare_synthetic(data, opts.samples, opts.features, 10, shards=opts.shards)
    model = ["--model", f"{ROOT / 'examples' / 'torch_mlp.py'}:MLP", "--model-arg", "hidden=128"]

    def run(label, *args, ranks=4, epochs=None):
        log = os.path.join(opts.dir, f"{label}.h5")
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpilb", "train", "--data", data,
               *model, "--epochs", str(epochs or opts.epochs), "--no-progress", "--log", log,
               *map(str, args)]
        if "--resume" not in args:
            cmd.append("--overwrite")   # a rerun of the script replaces its scratch logs
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            print(f"  {label:<34} FAILED (exit {res.returncode}): {res.stderr.strip()[-500:]}", flush=True)
            return None
        s = summarize_log(log)
        c = s["coverage"]
        exact = c["applied"] == c["expected"] and not c["duplicates"] and not c["missing"]
        epochs_s = s["epoch_s"][1:] or s["epoch_s"]
        print(f"  {label:<34} accuracy {s['final_test_accuracy']:.4f}, coverage {c['applied']}/"
              f"{c['expected']} exact {exact}, mean epoch {np.mean(epochs_s):.2f} s "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        return s if exact else None

    print(f"torch MLP on {data}; {opts.epochs} epochs per run")
    results = {}
    for label, args in [("async (default)", []), ("--mode ssp", ["--mode", "ssp"]),
                        ("--mode sync", ["--mode", "sync"]), ("--correction dc", ["--correction", "dc"]),
                        ("--store local", ["--store", "local"]), ("--pipeline 1", ["--pipeline", "1"])]:
        results[label] = run(label.replace(" ", "_").replace("-", ""), *args)
    ckpt = os.path.join(opts.dir, "resume.ckpt.h5")
    first = run("resume_first_4_ranks", "--checkpoint", ckpt)
    results["--resume, 4 ranks then 3"] = first and run(
        "resume_then_3_ranks", "--checkpoint", ckpt, "--resume", ranks=3, epochs=2 * opts.epochs)
    static = run("static_inject", "--balancer", "static", "--inject", "3:compute=4", epochs=opts.balance_epochs)
    load = run("load_inject", "--balancer", "load", "--inject", "3:compute=4", epochs=opts.balance_epochs)
    checks = [(f"{k}: exit 0, exact coverage", v is not None, "ok" if v else "failed")
              for k, v in results.items()]
    if static and load:
        ratio = np.mean(load["epoch_s"][1:]) / np.mean(static["epoch_s"][1:])
        checks.append(("--balancer load <= 0.7 x static epoch time under --inject 3:compute=4",
                       ratio <= 0.7, f"{ratio:.2f}"))
    print_targets(checks)


if __name__ == "__main__":
    main()
