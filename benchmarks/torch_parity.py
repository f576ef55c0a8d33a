"""Accuracy parity: the digits CNN (examples/torch_cnn.py) trained by mpilb under
`mpiexec -n 4` against a plain serial torch loop over the same module, lr, batch and epochs.

    python benchmarks/torch_parity.py [--epochs 20] [--seeds 3] [--out FILE]

Both sides start from `Net()` built after `torch.manual_seed(seed)`, use SGD at --lr on mean
cross entropy over batches of --batch, and see each training sample once per epoch (mpilb:
its shards, balanced over 3 workers, asynchronous; torch: one shuffled pass). Prints both
test accuracies per seed and the difference of the medians, and writes them to
benchmarks/results/torch_parity.json (rendered into docs/benchmarks/models.md by gendocs.py); targets
(issue 12): mpilb's median >= 0.97 with exact coverage, within 1 point of the serial loop's.
Exit status: 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
from _runs import digits_dataset, load_arrays, mpiexec, print_targets  # noqa: E402


def serial_torch(data, seed: int, epochs: int, lr: float, batch: int) -> float:
    import torch
    from torch_cnn import Net

    # one thread, as on an mpilb worker rank (and spinning OpenMP threads on a shared
    # machine make torch many times slower)
    torch.set_num_threads(1)
    x, y, xt, yt = (torch.from_numpy(a) for a in data)
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for lo in range(0, len(y), batch):
            idx = order[lo:lo + batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    net.eval()
    with torch.no_grad():
        return float((net(xt).argmax(1) == yt).double().mean())


def mpilb_run(data_dir: str, seed: int, epochs: int, lr: float, batch: int, workdir: str):
    from mpilb.runfiles.summary import summarize_log

    log = os.path.join(workdir, f"parity-{seed}.h5")
    cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "mpilb", "train", "--data", data_dir,
           "--model", f"{ROOT / 'examples' / 'torch_cnn.py'}:Net", "--epochs", str(epochs),
           "--lr", str(lr), "--batch", str(batch), "--seed", str(seed), "--no-progress",
           "--log", log, "--overwrite"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        sys.exit(f"mpilb run failed:\n{res.stderr[-3000:]}")
    s = summarize_log(log)
    c = s["coverage"]
    return s["final_test_accuracy"], c["applied"] == c["expected"] and not c["duplicates"] and not c["missing"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/mpilb-torch-parity")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=32)
    _results.add_output_args(ap, "torch_parity")
    opts = ap.parse_args()
    t_start = time.perf_counter()
    if opts.quick:
        opts.epochs, opts.seeds = 1, 1
    os.makedirs(opts.dir, exist_ok=True)
    from mpilb.data.dataset import open_dataset

    data_dir = digits_dataset(opts.dir)
    data = load_arrays(open_dataset(data_dir))
    ours, theirs, exact = [], [], True
    print(f"digits CNN, {opts.epochs} epochs, lr {opts.lr}, batch {opts.batch}; "
          f"load average {os.getloadavg()[0]:.1f}")
    for seed in range(opts.seeds):
        t0 = time.perf_counter()
        acc, cov = mpilb_run(data_dir, seed, opts.epochs, opts.lr, opts.batch, opts.dir)
        t1 = time.perf_counter()
        ref = serial_torch(data, seed, opts.epochs, opts.lr, opts.batch)
        t2 = time.perf_counter()
        ours.append(acc)
        theirs.append(ref)
        exact &= cov
        print(f"  seed {seed}: mpilb -n 4 {acc:.4f} ({t1 - t0:.0f} s, coverage exact {cov}), "
              f"serial torch {ref:.4f} ({t2 - t1:.0f} s)", flush=True)
    m_ours, m_theirs = float(np.median(ours)), float(np.median(theirs))
    print(f"median test accuracy: mpilb {m_ours:.4f} (spread {min(ours):.4f}-{max(ours):.4f}), "
          f"serial torch {m_theirs:.4f} (spread {min(theirs):.4f}-{max(theirs):.4f}), "
          f"difference {100 * (m_ours - m_theirs):+.2f} points")
    res = _results.Results("torch_parity", "Accuracy parity: the digits CNN, mpilb against serial torch", opts)
    res.t0 = t_start   # the whole script's time, not only the writing
    g = res.group(f"digits CNN (`examples/torch_cnn.py:Net`), {opts.epochs} epochs, lr {opts.lr:g}, "
                  f"batch {opts.batch}, one run per seed 0..{opts.seeds - 1}",
                  f"mpiexec -n 4 mpilb train --data digits --model examples/torch_cnn.py:Net "
                  f"--epochs {opts.epochs} --lr {opts.lr:g} --batch {opts.batch} --seed S")
    res.figure(g, "mpilb", "mpilb (3 async workers): final test accuracy", ours, digits=4, target=">= 0.97")
    res.figure(g, "serial", "serial torch loop, same Net, lr, batch, epochs: final test accuracy",
               theirs, digits=4, command="python benchmarks/torch_parity.py (its serial_torch)")
    res.figure(g, "diff", "mpilb − serial torch, per seed (points)",
               [100 * (a - b) for a, b in zip(ours, theirs)], digits=2)
    res.figure(g, "absdiff", "|difference of the medians| (points)", [100 * abs(m_ours - m_theirs)],
               digits=2, target="<= 1")
    res.figure(g, "coverage", "runs with exact coverage (1 = exact)", [float(exact)], digits=0,
               target=">= 1", decide="all")
    print_targets(res.checks())
    res.write(_results.out_path(opts, "torch_parity"))
    return 0 if res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
