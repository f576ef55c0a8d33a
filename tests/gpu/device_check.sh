#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU and CuPy (not part of the CPU test suite).
#
#   bash tests/gpu/device_check.sh [OUT_DIR]
#
# 1. CuPy vs NumPy gradients for every model (same parameters and batch, float32 and float64).
# 2. A 3-rank training run with --device gpu (host staging), pipelined, with two parameter
#    stores and a straggler, and with CUDA-aware MPI when the MPI library reports CUDA support.
# 3. Step time of a large MLP on CuPy vs NumPy (loss_and_grad + sgd step), as a ratio.
# 4. The PyTorch adapter on CUDA (needs torch with CUDA): gradients vs the CPU, parameters as
#    DLPack views of the CuPy vector, gradients in the CuPy buffer, device binding, step time
#    vs plain torch,
#    and a 3-rank run of examples/torch_cnn.py on --device gpu.
# Figures go to stdout, OUT_DIR/device_check.json, and OUT_DIR/gpu.json: a result file for
# benchmarks/results/ (tests/gpu/result.py) that docs/gpu.md's table is generated from.
set -euo pipefail
OUT="${1:-${OUT:-/tmp/mpilb-device-check}}"
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export MPILB_CACHE="$OUT/cache"
PY="${PYTHON:-python3}"

echo "== 1. CuPy vs NumPy gradients"
"$PY" - "$OUT" <<'PYEOF'
import json, sys, time
import numpy as np
import cupy as cp
from mpilb.models import build_model
from mpilb.core.optimizers import build_optimizer

out = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "models": {}}
rng = np.random.default_rng(0)
for name, shape in (("softmax", (64,)), ("mlp", (64,)), ("cnn", (1, 8, 8))):
    model = build_model(name, shape, 10, (128, 64))
    x = rng.normal(size=(256, *shape)).astype(np.float32)
    y = rng.integers(0, 10, 256)
    for dtype in (np.float64, np.float32):
        p = model.init_params(1).astype(dtype)
        l_cpu, g_cpu = model.loss_and_grad(p, x, y)
        l_gpu, g_gpu = model.loss_and_grad(cp.asarray(p), cp.asarray(x), cp.asarray(y))
        g_gpu = cp.asnumpy(g_gpu)
        rel = float(np.abs(g_gpu - g_cpu).max() / (np.abs(g_cpu).max() + 1e-30))
        tol = 1e-10 if dtype == np.float64 else 1e-4
        print(f"  {name:8s} {np.dtype(dtype).name}: loss {l_cpu:.6f} vs {l_gpu:.6f}, max rel grad diff {rel:.2e}")
        assert abs(l_cpu - l_gpu) <= tol * max(1, abs(l_cpu)) * 10 and rel < tol, (name, dtype, rel)
        out["models"][f"{name}/{np.dtype(dtype).name}"] = rel

print("== 3. step time, mlp 1024x2048x2048x10, batch 512")
model = build_model("mlp", (1024,), 10, (2048, 2048))
x = rng.normal(size=(512, 1024)).astype(np.float32)
y = rng.integers(0, 10, 512)
def bench(xp, steps):
    p = xp.asarray(model.init_params(0))
    xb, yb = xp.asarray(x), xp.asarray(y)
    opt = build_optimizer("sgd", model.num_params, lr=1e-6, xp=xp)   # summed gradients: keep finite
    g = xp.empty_like(p)
    for _ in range(3):
        model.loss_and_grad(p, xb, yb, g); opt.step(p, g)
    if xp is cp: cp.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        model.loss_and_grad(p, xb, yb, g); opt.step(p, g)
    if xp is cp: cp.cuda.get_current_stream().synchronize()
    return (time.perf_counter() - t0) / steps
t_np, t_cp = bench(np, 5), bench(cp, 50)
print(f"  numpy {t_np*1e3:.1f} ms/step, cupy {t_cp*1e3:.2f} ms/step, speed-up {t_np/t_cp:.1f}x")
out["step_ms"] = {"numpy": t_np * 1e3, "cupy": t_cp * 1e3, "speedup": t_np / t_cp}
json.dump(out, open(sys.argv[1] + "/device_check.json", "w"), indent=2)
PYEOF

echo "== 2. 3-rank GPU training (host staging)"
mpilb prepare synthetic "$OUT/data" --samples 60000 --features 256 --classes 10 --shards 24 >/dev/null
cat > "$OUT/summary.py" <<'PYEOF'
import json, sys
s = json.load(sys.stdin)
c = s["coverage"]
exact = c["applied"] == c["expected"] and not c["duplicates"] and not c["missing"]
acc = s["final_test_accuracy"]
print(f"  {s['samples_per_s']:.0f} samples/s, accuracy {acc:.4f}, coverage {c['applied']}/{c['expected']}, exact: {exact}")
assert exact, c
if len(sys.argv) > 1:
    assert acc > float(sys.argv[1]), f"accuracy {acc} <= {sys.argv[1]}"
PYEOF
run() {
    local log="$1"; shift
    timeout 300 mpiexec -n "${NP:-3}" mpilb train --data "$OUT/data" --model mlp --hidden 512,512 \
        --batch 256 --epochs 3 --device gpu --no-progress --overwrite --log "$log" "$@"
    mpilb report "$log" --json | "$PY" "$OUT/summary.py"
}
run "$OUT/gpu_staged.h5"
echo "   the same with --pipeline 1 (next pull overlapped with the compute)"
run "$OUT/gpu_pipelined.h5" --pipeline 1
echo "   two parameter stores (--servers 2), a straggler (3:compute=3) and the load balancer"
NP=5 run "$OUT/gpu_servers2.h5" --servers 2 --inject 3:compute=3 --balancer load
timeout 300 mpiexec -n 3 mpilb train --data "$OUT/data" --model mlp --hidden 512,512 --batch 256 \
    --epochs 3 --device cpu --no-progress --overwrite --log "$OUT/cpu.h5" >/dev/null
mpilb report --compare "$OUT/cpu.h5" "$OUT/gpu_staged.h5"
if mpilb doctor 2>/dev/null | grep -q "the MPI library reports CUDA support"; then
    echo "== 2b. CUDA-aware MPI"
    MPILB_CUDA_AWARE=1 run "$OUT/gpu_cuda_aware.h5"
else
    echo "== 2b. skipped: the MPI library does not report CUDA support"
fi

echo "== 4. PyTorch adapter on the GPU (CUDA module, DLPack into CuPy, device binding)"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
"$PY" - "$OUT" <<'PYEOF'
import json, sys, time
import numpy as np
import cupy as cp
import torch
from mpilb.backend import select_backend
from mpilb.models import build_model

backend = select_backend("gpu", 0)
spec = "examples/torch_cnn.py:Net"
on_gpu, on_cpu = build_model(spec, (1, 8, 8), 10, seed=0), build_model(spec, (1, 8, 8), 10, seed=0)
rng = np.random.default_rng(0)
x = rng.random((256, 1, 8, 8), dtype=np.float32)
y = rng.integers(0, 10, 256)
p = on_cpu.init_params(0)
l_cpu, g_cpu = on_cpu.loss_and_grad(p, x, y)
pg, xg, yg = cp.asarray(p), cp.asarray(x), cp.asarray(y)
out = cp.zeros_like(pg)
l_gpu, g_gpu = on_gpu.loss_and_grad(pg, xg, yg, out)
cp.cuda.get_current_stream().synchronize()
assert g_gpu is out, "the gradient must land in the caller's CuPy buffer"
# DLPack, no copy: every parameter lives inside pg (the gradient was written into `out`)
for prm in on_gpu.module.parameters():
    assert prm.is_cuda and prm.device.index == backend.device_id, prm.device
    assert pg.data.ptr <= prm.data_ptr() < pg.data.ptr + pg.nbytes, "parameter is not a view of the CuPy vector"
g = cp.asnumpy(out)
rel = float(np.abs(g - g_cpu).max() / (np.abs(g_cpu).max() + 1e-30))
print(f"  loss cpu {l_cpu:.5f} gpu {l_gpu:.5f}, max rel grad diff {rel:.2e} (TF32 convolutions allowed)")
assert abs(l_cpu - l_gpu) < 1e-3 * abs(l_cpu) and rel < 5e-3, rel
pg += 0.5                      # writing the CuPy vector moves the module's weights (shared memory)
first = next(on_gpu.module.parameters())
assert abs(float(first.detach().flatten()[0]) - (float(p[0]) + 0.5)) < 1e-6
# step time: the adapter vs plain torch (forward + backward + gradients read out), batch 256
net = build_model(spec, (1, 8, 8), 10, seed=0).module.cuda()
xt, yt = torch.from_dlpack(xg), torch.from_dlpack(yg)
def plain():
    net.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(net(xt), yt, reduction="sum").backward()
    torch.cat([q.grad.reshape(-1) for q in net.parameters()])
def adapter():
    on_gpu.loss_and_grad(pg, xg, yg, out)
def timed(fn, steps=200):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps
ratios = []
for _ in range(5):
    ratios.append(timed(adapter) / timed(plain))
ratio = float(np.median(ratios))
print(f"  adapter/plain step time on the GPU: median {ratio:.3f} (of {', '.join(f'{r:.3f}' for r in ratios)})")
res = json.load(open(sys.argv[1] + "/device_check.json"))
res["torch_adapter"] = {"grad_rel_diff": rel, "step_ratio": ratio}
json.dump(res, open(sys.argv[1] + "/device_check.json", "w"), indent=2)
PYEOF
mpilb prepare digits "$OUT/digits" >/dev/null
timeout 300 mpiexec -n 3 mpilb train --data "$OUT/digits" --model examples/torch_cnn.py:Net \
    --epochs 10 --device gpu --no-progress --overwrite --log "$OUT/torch_gpu.h5"
mpilb report "$OUT/torch_gpu.h5" --json | "$PY" "$OUT/summary.py" 0.9
else
    echo "== 4. skipped: torch with CUDA is not installed (pip install torch with a CUDA build)"
fi
"$PY" tests/gpu/result.py "$OUT/device_check.json" --out "$OUT/gpu.json" >/dev/null
echo "device check passed; figures in $OUT/device_check.json and $OUT/gpu.json (copy that to"
echo "benchmarks/results/gpu.json and run python benchmarks/gendocs.py to update docs/gpu.md)"
