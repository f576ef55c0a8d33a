"""Cost of the run log: the same training with the real log and with a log that drops rows.

    python benchmarks/logging_overhead.py [--repeats 5] [--epochs 4]

Both variants run `mpiexec -n 4 mpilb train` on the same data, alternating; the null variant
replaces RunLog.append with a no-op (root attributes, and so train_s, are still written). A
small model makes updates frequent, the worst case for logging. Prints the median of the
per-pair ratios of training time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import h5py

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _runs  # noqa: E402

NAME = "logging_overhead"

# mpilb.cli.main first: it limits BLAS threads per rank before numpy is imported
DROP_ROWS = (
    "import sys\n"
    "from mpilb.cli.main import main\n"
    "from mpilb.runfiles import runlog\n"
    "runlog.RunLog.append = lambda self, group, **row: None\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


COMMAND = ("mpiexec -n 4 mpilb train --data DATA --model mlp --hidden 64 --batch 32 --epochs {epochs} "
           "--no-progress")


def run(data: str, log: str, epochs: int, null_log: bool) -> tuple[float, int]:
    code = ["-c", DROP_ROWS] if null_log else ["-m", "mpilb"]
    cmd = [_runs.mpiexec(), "-n", "4", sys.executable, *code, "train", "--data", data,
           "--model", "mlp", "--hidden", "64", "--batch", "32", "--epochs", str(epochs),
           "--no-progress", "--log", log, "--overwrite"]   # a scratch log per repeat
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    with h5py.File(log, "r") as f:
        return float(f.attrs["train_s"]), int(f["updates/t"].shape[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--epochs", type=int, default=4)
    _results.add_output_args(ap, NAME)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.epochs = 1, 1
    res = _results.Results(NAME, "Logging overhead", args)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "d")
        subprocess.run([sys.executable, "-m", "mpilb", "prepare", "synthetic", data, "--samples",
                        "30000", "--features", "64", "--classes", "10", "--shards", "12"],
                       check=True, capture_output=True)
        logged, dropped, ratios, updates = [], [], [], []
        for _ in range(args.repeats):
            t_log, n = run(data, os.path.join(tmp, "with.h5"), args.epochs, False)
            t_null, _ = run(data, os.path.join(tmp, "without.h5"), args.epochs, True)
            logged.append(t_log)
            dropped.append(t_null)
            ratios.append(t_log / t_null)
            updates.append(n)
    g = res.group(f"`mlp --hidden 64 --batch 32`, 24,000 samples x {args.epochs} epochs, 3 workers "
                  f"(small steps: the worst case for logging); with the run log and with "
                  f"`RunLog.append` a no-op, alternating", COMMAND.format(epochs=args.epochs))
    res.figure(g, "ratio", "training time with the log ÷ without", ratios, unit="x", digits=3)
    res.figure(g, "with_log_s", "training time with the run log, s", logged, unit="s", digits=3)
    res.figure(g, "without_s", "training time with rows dropped, s", dropped, unit="s", digits=3)
    res.figure(g, "updates_per_s", "updates/s with the run log",
               [n / t for n, t in zip(updates, logged)], unit="updates/s", digits=0)
    for f in g["figures"]:
        print(f"  {f['label']:<40} {_results.fmt_range(f)}")
    res.write(_results.out_path(args, NAME))
    return 0


if __name__ == "__main__":
    sys.exit(main())
