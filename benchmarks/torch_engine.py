"""Everything else works with a torch model: the engine's modes, corrections, stores,
pipelining, resume onto fewer ranks, and load balancing, each run once with a torch MLP
(examples/torch_mlp.py) on a synthetic dataset.

    python benchmarks/torch_engine.py [--samples 48000] [--features 64] [--shards 24] [--out FILE]

Prints one line per configuration (accuracy, coverage) and, for balancing, the mean epoch
time after the first epoch of `--balancer load` against `--balancer static` with
`--inject 3:compute=4` in the same script. Target (issue 12): every run exits 0 with exact
coverage; load <= 0.7 x static. Results: benchmarks/results/torch_engine.json (rendered into
docs/benchmarks/models.md by gendocs.py). Exit status: 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
from _runs import mpiexec, print_targets  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/mpilb-torch-engine")
    ap.add_argument("--samples", type=int, default=48000)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--shards", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--balance-epochs", type=int, default=5)
    _results.add_output_args(ap, "torch_engine")
    opts = ap.parse_args()
    t_start = time.perf_counter()
    if opts.quick:
        opts.samples, opts.epochs, opts.balance_epochs = 4800, 1, 2
    from mpilb.data.dataset import prepare_synthetic
    from mpilb.runfiles.summary import summarize_log

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
    res = _results.Results("torch_engine", "The engine with a torch model", opts)
    res.t0 = t_start   # the whole script's time, not only the writing
    base = (f"mpiexec -n 4 mpilb train --data synthetic-{opts.samples}x{opts.features} --model "
            f"examples/torch_mlp.py:MLP --model-arg hidden=128 --epochs {opts.epochs}")
    g = res.group(f"torch MLP (hidden 128), synthetic {opts.samples} x {opts.features}, "
                  f"{opts.shards} shards, {opts.epochs} epochs a run: each run exits 0 with exact "
                  f"coverage (1), its final test accuracy beside it", base)
    for k, v in results.items():
        opt = {"async (default)": ""}.get(k, " " + k.replace("--resume, 4 ranks then 3",
                                                              "--resume (4 ranks, then 3)"))
        res.figure(g, f"ok.{k}", f"{k}: exit 0 and exact coverage", [float(v is not None)],
                   digits=0, target=">= 1", decide="all", command=base + opt)
        res.figure(g, f"acc.{k}", f"{k}: final test accuracy",
                   [v["final_test_accuracy"] if v else None], digits=4, command=base + opt)
    if static and load:
        ratio = np.mean(load["epoch_s"][1:]) / np.mean(static["epoch_s"][1:])
        g2 = res.group(f"load balancing with the torch model: `--inject 3:compute=4`, "
                       f"{opts.balance_epochs} epochs, mean epoch time after the first",
                       base.replace(f"--epochs {opts.epochs}", f"--epochs {opts.balance_epochs}")
                       + " --balancer load|static --inject 3:compute=4")
        res.figure(g2, "balance", "load ÷ static, mean epoch time", [ratio], target="<= 0.7")
    print_targets(res.checks())
    res.write(_results.out_path(opts, "torch_engine"))
    return 0 if res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
