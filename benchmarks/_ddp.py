"""PyTorch DDP (gloo, ring allreduce) training the same MLP on an mpilb dataset: the anchor a
user knows, for benchmarks/cluster.py. Started by `mpiexec` (inside the cluster box), which
only places the processes: each reads its rank from the launcher's PMI variables and joins
gloo's process group over TCP at MASTER_ADDR (the first process's node).

    mpiexec -hosts n1:2,n2:2 python benchmarks/_ddp.py DATA EPOCHS BATCH HIDDEN LAYERS

Each process trains on its own contiguous share of every epoch (DistributedSampler's split,
shuffled per epoch); prints one JSON line from rank 0: samples/s over the timed epochs (the
first is warm-up), test accuracy.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _runs  # noqa: E402
from torch_mlp import MLP  # noqa: E402


def load(data: str):
    from mpilb.data.dataset import open_dataset

    ds = open_dataset(data)
    return (*_runs.load_arrays(ds), tuple(ds.sample_shape), ds.num_classes)


def main() -> int:
    data, epochs, batch, hidden, layers = sys.argv[1], *map(int, sys.argv[2:6])
    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, y, xt, yt, shape, classes = load(data)
    torch.manual_seed(0)
    net = MLP(shape, classes, hidden=hidden, layers=layers)
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    n = len(y) // world
    times = []
    for e in range(epochs):
        order = np.random.default_rng([e, 7]).permutation(len(y))[rank * n:(rank + 1) * n]
        dist.barrier()
        t0 = time.perf_counter()
        for lo in range(0, n - batch + 1, batch):
            idx = order[lo:lo + batch]
            xb, yb = torch.from_numpy(x[idx]), torch.from_numpy(y[idx]).long()
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    with torch.no_grad():
        acc = float((net(torch.from_numpy(xt)).argmax(1).numpy() == yt).mean())
    steps = n // batch
    if rank == 0:
        timed = times[1:] or times
        print(json.dumps({"samples_per_s": steps * batch * world / (sum(timed) / len(timed)),
                          "epoch_s": times, "test_accuracy": acc, "world": world}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
