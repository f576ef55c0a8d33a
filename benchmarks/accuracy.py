"""Final test accuracy on scikit-learn's digits: one rank and four, every training mode.

    python benchmarks/accuracy.py [--repeats 3] [--epochs 20]

``mpilb prepare digits``, then ``--model M --hidden 64 --epochs 20`` with the defaults
(sgd, lr 0.1, batch 32), on one rank (in-process) and on four (1 server + 3 workers) in
each mode and correction. Asynchronous runs are not bitwise reproducible (the arrival
order varies), so each configuration is repeated and shown as median and range. Every run
must have exact coverage. Exit status: 0 when coverage was exact in every run, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _runs  # noqa: E402

NAME = "accuracy"
# label -> (ranks, model, extra options)
CONFIGS = {
    "1 rank, mlp": (1, "mlp", []),
    "1 rank, softmax": (1, "softmax", []),
    "1 rank, cnn": (1, "cnn", []),
    "4 ranks, mlp, async": (4, "mlp", ["--mode", "async"]),
    "4 ranks, mlp, ssp --staleness-bound 2": (4, "mlp", ["--mode", "ssp", "--staleness-bound", "2"]),
    "4 ranks, mlp, sync": (4, "mlp", ["--mode", "sync"]),
    "4 ranks, mlp, --correction inverse": (4, "mlp", ["--correction", "inverse"]),
    "4 ranks, mlp, --correction dc": (4, "mlp", ["--correction", "dc"]),
    "4 ranks, mlp, --pipeline 1": (4, "mlp", ["--pipeline", "1"]),
}


def hidden_args(model: str) -> list[str]:
    """--hidden applies to the mlp only (mpilb refuses an option that has no effect)."""
    return ["--hidden", "64"] if model == "mlp" else []


def train(data: str, log: str, ranks: int, model: str, extra: list[str], epochs: int,
          timeout: float) -> dict:
    from mpilb.runfiles.summary import summarize_log

    args = ["train", "--data", data, "--model", model, *hidden_args(model), "--epochs",
            str(epochs), "--no-progress", *extra, "--log", log,
            "--overwrite"]   # one scratch log (and checkpoint) for every run
    cmd = [sys.executable, "-m", "mpilb", *args]
    if ranks > 1:
        cmd = [_runs.mpiexec(), "-n", str(ranks), *cmd]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        sys.exit(f"{' '.join(args)} failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    return summarize_log(log)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "mpilb-accuracy"))
    ap.add_argument("--run-timeout", type=float, default=300.0)
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.epochs = 1, 1
    data = _runs.digits_dataset(opts.dir)
    res = _results.Results(NAME, "Accuracy on scikit-learn's digits", opts)
    acc = {k: [] for k in CONFIGS}
    exact = []
    for r in range(opts.repeats):
        for label, (ranks, model, extra) in CONFIGS.items():
            s = train(data, os.path.join(opts.dir, "run.h5"), ranks, model, extra, opts.epochs,
                      opts.run_timeout)
            acc[label].append(s["final_test_accuracy"])
            cov = s["coverage"]
            exact.append(cov["applied"] == cov["expected"] > 0 and cov["duplicates"] == 0
                         and cov["missing"] == 0)
            print(f"  {label:<40} accuracy {acc[label][-1]:.4f}, coverage "
                  f"{'exact' if exact[-1] else cov}", flush=True)
    g = res.group(f"digits, `--hidden 64 --epochs {opts.epochs}`, sgd, lr 0.1, batch 32: final "
                  f"test accuracy", f"mpilb prepare digits digits; [mpiexec -n 4] mpilb train "
                  f"--data digits --model M --hidden 64 --epochs {opts.epochs} OPTIONS")
    for label, (ranks, model, extra) in CONFIGS.items():
        launch = "mpiexec -n 4 " if ranks > 1 else ""
        res.figure(g, label, label, acc[label], digits=4,
                   command=f"{launch}mpilb train --data digits --model {model} "
                           f"{' '.join(hidden_args(model) + ['--epochs', str(opts.epochs), *extra])}")
    res.figure(g, "coverage", "runs with exact coverage (1 = exact)", [float(e) for e in exact],
               digits=0, target=">= 1", decide="all")
    _runs.print_targets(res.checks())
    res.write(_results.out_path(opts, NAME))
    return 0 if res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
