"""The GPU check's figures as a benchmark result file (benchmarks/results/gpu.json), so that
`python benchmarks/gendocs.py` renders docs/gpu.md's table from them.

    python tests/gpu/result.py OUT_DIR/device_check.json [--out benchmarks/results/gpu.json]

device_check.sh runs it at its end, on the GPU machine, whose facts it records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))
import _results  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", help="device_check.json written by tests/gpu/device_check.sh")
    _results.add_output_args(ap, "gpu")
    opts = ap.parse_args()
    with open(opts.check) as f:
        check = json.load(f)
    res = _results.Results("gpu", f"GPU check ({check['gpu']})", opts)
    res.machine["gpu"] = check["gpu"]
    cmd = "bash tests/gpu/device_check.sh"
    g = res.group("CuPy against NumPy: the same parameters and batch, max relative gradient "
                  "difference", cmd)
    for dtype, scale, target in (("float64", 1e-16, "<= 1e6"), ("float32", 1e-7, "<= 1e3")):
        for model in ("softmax", "mlp", "cnn"):
            res.figure(g, f"grad.{model}.{dtype}", f"{model}, {dtype} (×{scale:.0e})",
                       [check["models"][f"{model}/{dtype}"] / scale], target=target)
    step = check["step_ms"]
    g = res.group("One step (loss_and_grad + sgd) of mlp 1024-2048-2048-10, batch 512", cmd)
    res.figure(g, "step.numpy_ms", "NumPy, ms per step", [step["numpy"]], digits=1)
    res.figure(g, "step.cupy_ms", "CuPy, ms per step", [step["cupy"]])
    res.figure(g, "step.speedup", "CuPy speed-up", [step["speedup"]], digits=1)
    if "torch_adapter" in check:
        t = check["torch_adapter"]
        g = res.group("The PyTorch adapter on the GPU (examples/torch_cnn.py:Net, batch 256)", cmd)
        res.figure(g, "torch.grad", "gradient vs the CPU, max relative difference (×1e-07)",
                   [t["grad_rel_diff"] / 1e-7], target="<= 5e4")
        res.figure(g, "torch.step_ratio", "step time, adapter ÷ plain torch (median of 5)",
                   [t["step_ratio"]])
    res.write(_results.out_path(opts, "gpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
