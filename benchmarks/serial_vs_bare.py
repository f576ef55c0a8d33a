"""Serial training loop vs a bare NumPy loop over the same arrays and model code.

    python benchmarks/serial_vs_bare.py [--samples 32000] [--features 256] [--repeats 5]

The serial loop is `mpilb train` on one rank (shards read from HDF5 with prefetch, coverage
counting, the run log), timed as the run log's train_s less the time spent evaluating the
test set at epoch ends (eval_s; the bare loop does no evaluation). The bare loop holds the
same training samples in memory and runs only loss_and_grad + the optimizer step. Runs alternate and the
median of the per-pair ratios is the figure, so both see the same machine noise. Run it with
``OPENBLAS_NUM_THREADS=1`` too (``--blas-threads 1``): the result file records the setting.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402

NAME = "serial_vs_bare"

MODEL = dict(model="mlp", hidden="256,256", batch=128, lr=0.05)


def bare_loop(data_dir: str, epochs: int) -> float:
    from mpilb.data.dataset import open_dataset
    from mpilb.models import build_model
    from mpilb.core.optimizers import build_optimizer

    ds = open_dataset(data_dir)
    import h5py

    xs, ys = [], []
    for i in range(len(ds.shards)):
        with h5py.File(ds.shard_path(i), "r") as f:
            xs.append(f["x"][()])
            ys.append(f["y"][()])
    x, y = np.concatenate(xs), np.concatenate(ys)
    model = build_model("mlp", tuple(ds.sample_shape), ds.num_classes, (256, 256))
    params = model.init_params(0)
    opt = build_optimizer("sgd", model.num_params, lr=MODEL["lr"])
    grad = np.empty_like(params)
    b = MODEL["batch"]
    t0 = time.perf_counter()
    for _ in range(epochs):
        for lo in range(0, len(y), b):
            _, g = model.loss_and_grad(params, x[lo:lo + b], y[lo:lo + b], grad)
            g /= len(y[lo:lo + b])
            opt.step(params, g)
    return epochs * len(y) / (time.perf_counter() - t0)


def bare_loop_process(data_dir: str, epochs: int) -> float:
    """The bare loop in a fresh process, like the serial one: no BLAS threads of this
    process linger (OpenBLAS workers keep spinning for a while after a call) to compete."""
    out = subprocess.run([sys.executable, __file__, "--bare-only", data_dir, "--epochs", str(epochs)],
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def serial_loop(data_dir: str, epochs: int, log: str) -> float:
    cmd = [sys.executable, "-m", "mpilb", "train", "--data", data_dir, "--epochs", str(epochs),
           "--no-progress", "--log", log, "--overwrite", "--eval-interval", "1000"]
    for k, v in MODEL.items():
        cmd += [f"--{k}", str(v)]
    subprocess.run(cmd, check=True, capture_output=True)
    import h5py

    with h5py.File(log, "r") as f:   # the loop itself: training time less test-set evaluation
        train_s, eval_s = float(f.attrs["train_s"]), float(f.attrs["eval_s"])
        samples = int(f["updates/batch"][()].sum())
    return samples / (train_s - eval_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=32000)
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blas-threads", default=None,
                    help="OPENBLAS_NUM_THREADS for both loops (default: the library's own)")
    ap.add_argument("--bare-only", metavar="DATA", help=argparse.SUPPRESS)
    _results.add_output_args(ap, NAME)
    args = ap.parse_args(argv)
    if args.bare_only:
        print(bare_loop(args.bare_only, args.epochs))
        return 0
    if args.blas_threads:
        os.environ["OPENBLAS_NUM_THREADS"] = args.blas_threads   # both child processes
    if args.quick:
        args.samples, args.epochs, args.repeats = 4000, 1, 1
    name = NAME if not args.blas_threads else f"{NAME}_blas{args.blas_threads}"
    res = _results.Results(name, "Serial training loop vs a bare NumPy loop", args)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        subprocess.run([sys.executable, "-m", "mpilb", "prepare", "synthetic", data, "--samples",
                        str(args.samples), "--features", str(args.features), "--classes", "10",
                        "--shards", "16"], check=True, capture_output=True)
        serial, bare = [], []
        for _ in range(args.repeats):
            bare.append(bare_loop_process(data, args.epochs))
            serial.append(serial_loop(data, args.epochs, os.path.join(tmp, "run.h5")))
        # each pair ran back to back, so its ratio sees the same machine load
        ratios = [x / y for x, y in zip(serial, bare)]
    threads = args.blas_threads or "default"
    env = f"OPENBLAS_NUM_THREADS={args.blas_threads} " if args.blas_threads else ""
    g = res.group(f"`mlp --hidden 256,256 --batch {MODEL['batch']}`, {args.samples:,} x "
                  f"{args.features} samples, {args.epochs} epochs, BLAS threads: {threads}",
                  f"{env}python benchmarks/serial_vs_bare.py --samples {args.samples} "
                  f"--features {args.features} --epochs {args.epochs} --repeats {args.repeats}")
    res.figure(g, "ratio", "serial loop ÷ bare loop samples/s", ratios, unit="x")
    res.figure(g, "serial", "serial loop (`mpilb train` on one rank) samples/s", serial,
               unit="samples/s", digits=0)
    res.figure(g, "bare", "bare NumPy loop samples/s", bare, unit="samples/s", digits=0)
    for f in g["figures"]:
        print(f"  {f['label']:<52} {_results.fmt_range(f)}")
    res.write(_results.out_path(args, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
