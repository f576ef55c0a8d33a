"""Cost of the PyTorch adapter's gradient step against plain torch, in one process.

    python benchmarks/torch_overhead.py [--repeats 7] [--steps 30] [--threads 1]

Plain torch: forward, backward, and reading the gradients out into one flat host vector
(what any data-parallel engine has to send; `torch.cat` of the .grad tensors into a
preallocated numpy buffer). Adapter: `TorchModel.loss_and_grad(params, x, y, out)` with the
parameters as views of a flat vector and the gradients accumulated straight into `out`.
Both on the same module, batch and data, alternated REPEATS times; prints the median ratio
and its spread per case. Target (issue 12): adapter / plain <= 1.1 for the digits CNN and a
1M-parameter MLP at batch 64 and 256.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runs import print_targets  # noqa: E402


def cases():
    import torch
    from torch_cnn import Net

    def mlp():   # 784 -> 1000 -> 200 -> 10: 1,000,210 parameters
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 1000), torch.nn.ReLU(),
                                   torch.nn.Linear(1000, 200), torch.nn.ReLU(), torch.nn.Linear(200, 10))

    return [("digits CNN", Net, (1, 8, 8)), ("MLP 1M", mlp, (784,))]


def timed(fn, steps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a worker rank "
                    "of an MPI job runs with 1)")
    opts = ap.parse_args()
    import torch

    from mpilb.models.torch_adapter import TorchModel

    torch.set_num_threads(opts.threads)
    print(f"torch {torch.__version__}, {opts.threads} thread(s), {opts.repeats} repeats of "
          f"{opts.steps} steps; load average {os.getloadavg()[0]:.1f}")
    checks = []
    for name, make, shape in cases():
        for batch in (64, 256):
            torch.manual_seed(0)
            plain_net = make()
            torch.manual_seed(0)
            adapter = TorchModel(make(), num_classes=10, input_shape=shape, where=name)
            rng = np.random.default_rng(0)
            x = rng.random((batch, *shape), dtype=np.float32)
            y = rng.integers(0, 10, batch)
            xt, yt = torch.from_numpy(x), torch.from_numpy(y)
            flat = np.empty(adapter.num_params, dtype=np.float32)
            flat_t = torch.from_numpy(flat)
            params = adapter.init_params(0)
            out = np.empty(adapter.num_params, dtype=np.float32)

            def plain():
                plain_net.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(plain_net(xt), yt, reduction="sum").backward()
                torch.cat([p.grad.reshape(-1) for p in plain_net.parameters()], out=flat_t)

            def ours():
                adapter.loss_and_grad(params, x, y, out)

            ratios = []
            for _ in range(opts.repeats):
                t_plain = timed(plain, opts.steps)
                t_ours = timed(ours, opts.steps)
                ratios.append(t_ours / t_plain)
            med = float(np.median(ratios))
            print(f"  {name:<10} batch {batch:>3}: plain {t_plain * 1e3:7.2f} ms, adapter "
                  f"{t_ours * 1e3:7.2f} ms (last repeat); ratio median {med:.3f}, spread "
                  f"{min(ratios):.3f}-{max(ratios):.3f}", flush=True)
            checks.append((f"{name} batch {batch}: adapter / plain <= 1.1", med <= 1.1, f"{med:.3f}"))
    print_targets(checks)


if __name__ == "__main__":
    main()
