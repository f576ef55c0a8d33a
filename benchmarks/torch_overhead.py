"""Cost of the PyTorch adapter's gradient step against plain torch, in one process.

    python benchmarks/torch_overhead.py [--repeats 9] [--steps 30] [--threads 1] [--out FILE]

Plain torch: forward, backward, and reading the gradients out into one flat host vector
(what any data-parallel engine has to send; `torch.cat` of the .grad tensors into a
preallocated numpy buffer). Adapter: `TorchModel.loss_and_grad(params, x, y, out)` with the
parameters as views of a flat vector and the gradients accumulated straight into `out`.
Both on the same module, batch and data, alternated REPEATS times (which goes first swaps
from one repeat to the next, so that neither always runs on the other's warm caches); prints
the median ratio and its spread per case and writes them to
benchmarks/results/torch_overhead.json, from which ``python benchmarks/gendocs.py`` renders
the table in docs/benchmarks/models.md. Target (issue 12): adapter / plain <= 1.1 for the digits CNN and
a 1M-parameter MLP at batch 64 and 256. Exit status: 0 when every target is met, 1 otherwise.
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

import _results  # noqa: E402
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
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a worker rank "
                    "of an MPI job runs with 1)")
    _results.add_output_args(ap, "torch_overhead")
    opts = ap.parse_args()
    if opts.quick:
        opts.repeats, opts.steps = 1, 2
    import torch

    from mpilb.models.torch_adapter import TorchModel

    torch.set_num_threads(opts.threads)
    print(f"torch {torch.__version__}, {opts.threads} thread(s), {opts.repeats} repeats of "
          f"{opts.steps} steps; load average {os.getloadavg()[0]:.1f}")
    res = _results.Results("torch_overhead", "The PyTorch adapter's gradient step against plain torch", opts)
    g = res.group(f"adapter ÷ plain torch (forward + backward + gradients into one flat vector), "
                  f"torch {torch.__version__}, {opts.threads} thread(s), {opts.steps} steps per timing",
                  f"python benchmarks/torch_overhead.py --repeats {opts.repeats} --steps {opts.steps} "
                  f"--threads {opts.threads}")
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
            for r in range(opts.repeats):
                if r % 2:
                    t_ours = timed(ours, opts.steps)
                    t_plain = timed(plain, opts.steps)
                else:
                    t_plain = timed(plain, opts.steps)
                    t_ours = timed(ours, opts.steps)
                ratios.append(t_ours / t_plain)
            med = float(np.median(ratios))
            print(f"  {name:<10} batch {batch:>3}: plain {t_plain * 1e3:7.2f} ms, adapter "
                  f"{t_ours * 1e3:7.2f} ms (last repeat); ratio median {med:.3f}, spread "
                  f"{min(ratios):.3f}-{max(ratios):.3f}", flush=True)
            res.figure(g, f"{name.split()[0].lower()}.b{batch}", f"{name}, batch {batch}: adapter ÷ plain",
                       ratios, unit="x", digits=3, target="<= 1.1")
    print_targets(res.checks())
    res.write(_results.out_path(opts, "torch_overhead"))
    return 0 if res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
