"""Regression parity: scikit-learn's diabetes data, float targets, a torch user model with MSE
trained by mpilb under `mpiexec -n 4`, against scikit-learn's Ridge on the same split.

    python benchmarks/regression_parity.py [--epochs 60] [--seeds 3] [--hidden 0] [--out FILE]

The data (features and target standardised: R^2 does not change under that) is written to an
npz with float targets and prepared with `mpilb prepare npz`; Ridge is fitted on exactly the
training shards mpilb trains on and scored on its test.h5. Target (issue 12): mpilb's median
test R^2 within 0.05 of Ridge's. Results: benchmarks/results/regression_parity.json (rendered
into docs/benchmarks/models.md by gendocs.py). Exit status: 0 when every target is met, 1 otherwise.
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
from _runs import load_arrays, mpiexec, print_targets  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/mpilb-regression-parity")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=0, help="Regressor hidden units (0: linear)")
    _results.add_output_args(ap, "regression_parity")
    opts = ap.parse_args()
    t_start = time.perf_counter()
    if opts.quick:
        opts.epochs, opts.seeds = 2, 1
    os.makedirs(opts.dir, exist_ok=True)
    from sklearn.datasets import load_diabetes
    from sklearn.linear_model import Ridge
    from sklearn.metrics import r2_score

    from mpilb.data.dataset import open_dataset, prepare_npz
    from mpilb.runfiles.summary import summarize_log

    d = load_diabetes()
    x = (d.data - d.data.mean(0)) / d.data.std(0)
    y = (d.target - d.target.mean()) / d.target.std()
    npz = os.path.join(opts.dir, "diabetes.npz")
    np.savez(npz, x=x.astype(np.float32), y=y.astype(np.float32))
    data_dir = os.path.join(opts.dir, "diabetes")
    ds = prepare_npz(npz, data_dir, shards=4, test_fraction=0.2, seed=0)
    ds = open_dataset(data_dir)
    x_train, y_train, xt, yt = load_arrays(ds)
    ridge = r2_score(yt, Ridge(alpha=1.0).fit(x_train, y_train).predict(xt))
    print(f"diabetes: {ds.total_samples} train / {ds.test_samples} test samples, float targets; "
          f"Ridge(alpha=1) test R^2 {ridge:.4f}; load average {os.getloadavg()[0]:.1f}")
    scores, exact = [], True
    for seed in range(opts.seeds):
        log = os.path.join(opts.dir, f"reg-{seed}.h5")
        cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "mpilb", "train", "--data", data_dir,
               "--model", f"{ROOT / 'examples' / 'regression.py'}:Regressor",
               "--model-arg", f"hidden={opts.hidden}", "--epochs", str(opts.epochs),
               "--lr", str(opts.lr), "--batch", str(opts.batch), "--seed", str(seed),
               "--no-progress", "--log", log, "--overwrite"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            sys.exit(f"mpilb run failed:\n{res.stderr[-3000:]}")
        s = summarize_log(log)
        c = s["coverage"]
        exact &= c["applied"] == c["expected"] and not c["duplicates"] and not c["missing"]
        scores.append(s["final_test_metric"])
        print(f"  seed {seed}: mpilb -n 4 test {s['metric']} {s['final_test_metric']:.4f} "
              f"(best {s['best_test_metric']:.4f}), coverage {c}", flush=True)
    med = float(np.median(scores))
    print(f"median mpilb test R^2 {med:.4f} (spread {min(scores):.4f}-{max(scores):.4f}) vs Ridge "
          f"{ridge:.4f}: difference {med - ridge:+.4f}")
    res = _results.Results("regression_parity", "Regression parity: diabetes, mpilb against Ridge", opts)
    res.t0 = t_start   # the whole script's time, not only the writing
    g = res.group(f"scikit-learn's diabetes ({ds.total_samples} train / {ds.test_samples} test samples, "
                  f"standardised, float targets), `examples/regression.py:Regressor` (hidden "
                  f"{opts.hidden}), MSE, {opts.epochs} epochs, lr {opts.lr:g}, batch {opts.batch}, "
                  f"one run per seed 0..{opts.seeds - 1}",
                  f"mpiexec -n 4 mpilb train --data diabetes --model examples/regression.py:Regressor "
                  f"--model-arg hidden={opts.hidden} --epochs {opts.epochs} --lr {opts.lr:g} "
                  f"--batch {opts.batch} --seed S")
    res.figure(g, "mpilb", "mpilb (3 async workers): final test R²", scores, digits=4)
    res.figure(g, "ridge", "Ridge(alpha=1) on the same training shards: test R²", [ridge], digits=4,
               command="python benchmarks/regression_parity.py (scikit-learn Ridge)")
    res.figure(g, "diff", "|median mpilb R² − Ridge R²|", [abs(med - ridge)], digits=4, target="<= 0.05")
    res.figure(g, "coverage", "runs with exact coverage (1 = exact)", [float(exact)], digits=0,
               target=">= 1", decide="all")
    print_targets(res.checks())
    res.write(_results.out_path(opts, "regression_parity"))
    return 0 if res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
