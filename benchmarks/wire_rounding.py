"""What --wire bf16's rounding does to accuracy, without the noise of asynchronous runs.

    python benchmarks/wire_rounding.py [--seeds 16] [--epochs 30] [--model mlp]

Asynchronous runs of one seed end a test sample or two apart whatever the wire, so a bias
of a fraction of a point hides in their noise. This runs digits in one process (one BLAS
thread: bitwise reproducible for a seed) and rounds there what the wire would: the
parameters a worker computes on (a reply), the mean gradient it pushes, or both, as
mpilb.mpi.wire_format does, and compares each seed's final test accuracy and test loss
with the same seed's float32 run. Variants:

- params: the parameters rounded to nearest (a reply), the gradient float32;
- grads: the gradient rounded to nearest alone (a push before error feedback);
- both: both rounded to nearest (the wire before error feedback);
- feedback: the parameters rounded, the gradient with error feedback (the wire now).

Prints one line per seed and variant, then the means; times nothing. Measured:
docs/cluster.md, "Fewer bytes on the wire".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # before numpy: reproducible sums
os.environ.setdefault("OMP_NUM_THREADS", "1")

import h5py  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _runs  # noqa: E402
from mpilb.core.batches import GradientStep  # noqa: E402
from mpilb.mpi import wire_format  # noqa: E402

# variant -> (the parameters rounded, the gradient: None, "nearest" or "feedback")
VARIANTS = {"params": (True, None), "grads": (False, "nearest"), "both": (True, "nearest"),
            "feedback": (True, "feedback")}


def rounded_step(fmt, round_params: bool, grads):
    """A GradientStep that sees and pushes what the wire would carry."""

    class Rounded(GradientStep):
        def __init__(self, model, backend, injector=None):
            super().__init__(model, backend, injector)
            n = model.num_params
            self.wire = np.empty(n, fmt.wire_dtype)
            self.seen = np.empty(n, np.float32)
            self.residual = wire_format.Residual(fmt, n)

        def __call__(self, params, batch, out=None):
            if round_params:
                fmt.encode(params, self.wire, np, self.residual.scratch)
                fmt.decode(self.wire, self.seen)
                params = self.seen
            loss, grad, compute_s = super().__call__(params, batch, out=out)
            if grads is not None:
                grad /= batch.size
                if grads == "feedback":
                    self.residual.encode(grad, self.wire)
                else:
                    fmt.encode(grad, self.wire, np, self.residual.scratch)
                fmt.decode(self.wire, grad)
                grad *= batch.size
            return loss, grad, compute_s

    return Rounded


def run(data: str, work: str, seed: int, variant: str | None, epochs: int, model: str) -> tuple:
    """(final test accuracy, final test loss) of one in-process run."""
    from mpilb.cli.main import main
    from mpilb.run import serial

    original = serial.GradientStep
    if variant is not None:
        serial.GradientStep = rounded_step(wire_format.wire_format("bf16"), *VARIANTS[variant])
    log = os.path.join(work, f"{variant}-{seed}.h5")
    try:
        rc = main(["train", "--data", data, "--model", model, "--epochs", str(epochs), "--seed",
                   str(seed), "--no-progress", "--log", log, "--overwrite"])
    finally:
        serial.GradientStep = original
    if rc != 0:
        sys.exit(f"seed {seed}, {variant}: exit {rc}")
    with h5py.File(log, "r") as f:
        return float(f["eval/test_accuracy"][-1]), float(f["eval/test_loss"][-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--model", default="mlp")
    opts = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="mpilb-wire-rounding-")
    data = _runs.digits_dataset(work)
    gaps = {v: [] for v in VARIANTS}
    for seed in range(1, opts.seeds + 1):
        acc, loss = run(data, work, seed, None, opts.epochs, opts.model)
        for v in VARIANTS:
            a, lo = run(data, work, seed, v, opts.epochs, opts.model)
            gaps[v].append((100 * (a - acc), 100 * (lo / loss - 1)))
            print(f"seed {seed} {v}: accuracy {100 * a:.2f} % ({gaps[v][-1][0]:+.2f} points), "
                  f"test loss {gaps[v][-1][1]:+.2f} %", flush=True)
    means = {v: {"accuracy_points": float(np.mean([g[0] for g in gs])),
                 "test_loss_percent": float(np.mean([g[1] for g in gs])),
                 "seeds": len(gs)} for v, gs in gaps.items()}
    print(json.dumps(means))
    return 0


if __name__ == "__main__":
    sys.exit(main())
