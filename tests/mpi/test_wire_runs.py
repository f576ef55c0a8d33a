"""--wire bf16 / fp16 end to end: the same accuracy as fp32 with exact coverage (one store,
two stores, a torch model, sync rounds), half the bytes on the wire, float32 checkpoints that
resume, non-finite pushes still rejected, and an unknown format refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpirun
from mpilb.runfiles.summary import summarize_log

pytestmark = pytest.mark.mpi

ROOT = str(Path(__file__).resolve().parents[2])   # this tree's mpilb, for the script
TORCH_MLP = "examples/torch_mlp.py:MLP"
# Asynchronous runs differ from run to run (arrival order), whatever the wire: the bound
# leaves room for that noise (measured: docs/cluster.md, "Fewer bytes on the wire"). The
# accuracy compared is the mean of the last LAST evaluations (one an epoch here), not the
# last alone, which swings from epoch to epoch on 360 test samples: one torch MLP pair of a
# full-suite run ended 3.06 points apart (bf16 0.933, fp32 0.964); 8 pairs of it run two
# at a time by hand ended 0.3-1.1 points apart, and their last five 0-0.9.
ACCURACY_BOUND = 0.03
LAST = 5


def train(n, digits_dir, tmp_path, name, *args, timeout=240):
    log = tmp_path / f"{name}.h5"
    res = mpirun.run(n, "train", "--data", digits_dir, "--seed", "1", "--no-progress",
                     "--log", str(log), *args, timeout=timeout)
    return res, str(log)


def finished(res, log, wire):
    assert res.returncode == 0, res.stderr
    s = summarize_log(log)
    cov = s["coverage"]
    assert s["status"] == "finished" and cov["duplicates"] == cov["missing"] == 0, cov
    with h5py.File(log, "r") as f:
        assert json.loads(f.attrs["config"])["wire"] == wire   # recorded as every option
    return s


def ending_accuracy(log) -> float:
    """The mean test accuracy of the run's last LAST evaluations."""
    with h5py.File(log, "r") as f:
        acc = f["eval/test_accuracy"][:]
    assert len(acc) >= LAST, acc
    return float(np.mean(acc[-LAST:]))


def bytes_in_per_update(s) -> float:
    return s["servers"][0]["bytes_in"] / s["servers"][0]["updates"]


@pytest.mark.parametrize("n,servers,model,wires", [
    (3, 1, "mlp", ("bf16",)),   # (fp16 with two stores, next: one run fewer for the suite)
    (4, 2, "mlp", ("bf16", "fp16")),
    (3, 1, TORCH_MLP, ("bf16",)),
])
def test_16_bit_wires_reach_fp32s_accuracy_with_half_the_bytes(digits_dir, tmp_path, n, servers,
                                                               model, wires):
    common = ["--model", model, "--epochs", "30", "--servers", str(servers)]
    res, ref_log = train(n, digits_dir, tmp_path, "fp32", *common)
    ref = finished(res, ref_log, "fp32")
    for wire in wires:
        res, log = train(n, digits_dir, tmp_path, wire, *common, "--wire", wire)
        s = finished(res, log, wire)
        ends = ending_accuracy(log), ending_accuracy(ref_log)
        assert abs(ends[0] - ends[1]) <= ACCURACY_BOUND, (wire, ends)
        # rank 0 receives [header | its slice] per push: half the payload bytes
        header = 384
        ratio = (bytes_in_per_update(s) - header) / (bytes_in_per_update(ref) - header)
        assert 0.49 <= ratio <= 0.51, ratio
        assert all(v["updates"] == s["servers"][0]["updates"] for v in s["servers"])


def test_sync_rounds_with_bf16(digits_dir, tmp_path):
    common = ["--model", "mlp", "--mode", "sync", "--epochs", "10"]
    res, log = train(3, digits_dir, tmp_path, "fp32", *common)
    ref = finished(res, log, "fp32")
    res, log = train(3, digits_dir, tmp_path, "bf16", *common, "--wire", "bf16")
    s = finished(res, log, "bf16")
    assert abs(s["final_test_accuracy"] - ref["final_test_accuracy"]) <= ACCURACY_BOUND


def test_a_bf16_run_checkpoints_float32_and_resumes(digits_dir, tmp_path):
    common = ["--model", "mlp", "--wire", "bf16", "--checkpoint", str(tmp_path / "run.ckpt.h5")]
    res, log = train(3, digits_dir, tmp_path, "run", *common, "--epochs", "3")
    finished(res, log, "bf16")
    with h5py.File(tmp_path / "run.ckpt.h5", "r") as f:
        params = f["params"][...]
    # the stores keep float32: the checkpoint is not rounded to bf16 (low half-words set)
    assert params.dtype == np.float32 and np.any(params.view(np.uint32) & 0xFFFF)
    res, log = train(3, digits_dir, tmp_path, "run", *common, "--epochs", "6", "--resume")
    s = finished(res, log, "bf16")
    assert s["epochs_completed"] == 6
    # it went on from the checkpoint: the resumed epochs (4-6) read 0.925-0.946 on average
    # in 8 runs by hand, where a first epoch from scratch reads 0.38-0.84 (one full-suite
    # run's last evaluation alone read 0.883: the mean, not the last)
    with h5py.File(log, "r") as f:
        acc = f["eval/test_accuracy"][:]
    assert len(acc) == 6 and np.mean(acc[3:]) > 0.88, acc


POISON = """
import sys
import numpy as np
from mpilb.core import batches
kind = sys.argv.pop(1)
step = batches.GradientStep.__call__
calls = [0]

def poisoned(self, params, batch, out=None):
    loss, grad, compute_s = step(self, params, batch, out=out)
    calls[0] += 1
    if calls[0] == 5:   # once, in the gradient the model computed (before the wire)
        grad[0] = np.nan if kind == "nan" else 1e6 * batch.size
    return loss, grad, compute_s

batches.GradientStep.__call__ = poisoned
from mpilb.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("wire,kind", [("bf16", "nan"), ("fp16", "nan"), ("fp16", "huge")])
def test_a_non_finite_push_is_rejected_on_a_16_bit_wire(digits_dir, tmp_path, wire, kind):
    """A NaN stays NaN through the conversion and the push says so; fp16 makes a gradient
    past 65504 infinite, and that push says so too: the server rejects both (and the
    worker recomputes the batch once)."""
    script = tmp_path / "poison.py"
    script.write_text(POISON)
    log = tmp_path / "run.h5"
    cmd = [mpirun.mpiexec(), "-n", "3", sys.executable, str(script), kind, "train", "--data",
           digits_dir, "--epochs", "2", "--hidden", "32", "--no-progress", "--wire", wire,
           "--log", str(log)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env=mpirun.env(PYTHONPATH=ROOT))
    assert res.returncode == 0, res.stderr
    with h5py.File(log, "r") as f:
        assert int(f.attrs.get("rejected_gradients", 0)) == 2   # one per worker
    finished(res, str(log), wire)


TINY = """
import sys
from mpilb.core import batches
step = batches.GradientStep.__call__

def tiny(self, params, batch, out=None):
    loss, grad, compute_s = step(self, params, batch, out=out)
    grad[-1] = 2e-8 * batch.size   # the last bias's mean gradient: 2e-8, below fp16's 3e-8
    return loss, grad, compute_s

batches.GradientStep.__call__ = tiny
from mpilb.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_fp16_pushes_deliver_a_gradient_below_its_smallest_value(digits_dir, tmp_path):
    """fp16's smallest value is 6e-8: a gradient of 2e-8 rounds to 0 push after push. Each
    push's rounding goes with the next (error feedback), so the store applies the sum of
    what the workers computed: the last bias (zero at the start) moves by lr x the sum of
    the updates' lr_scale x 2e-8, as with fp32 (rounded alone, it would stay 0)."""
    from mpilb.models import build_model

    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    log, ckpt = tmp_path / "run.h5", tmp_path / "run.ckpt.h5"
    cmd = [mpirun.mpiexec(), "-n", "3", sys.executable, str(script), "train", "--data",
           digits_dir, "--model", "softmax", "--epochs", "3", "--seed", "1", "--no-progress",
           "--wire", "fp16", "--log", str(log), "--checkpoint", str(ckpt)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env=mpirun.env(PYTHONPATH=ROOT))
    finished(res, str(log), "fp16")
    with h5py.File(ckpt, "r") as f:
        bias = float(f["params"][-1])
    with h5py.File(log, "r") as f:
        applied = float(np.sum(f["updates/lr_scale"][...]))
    model = build_model("softmax", (64,), 10, seed=1)
    assert model.init_params(1)[-1] == 0.0
    want = -0.1 * applied * 2e-8   # plain sgd, --lr 0.1
    # within the carry left on the workers (a few fp16 values), float32's own rounding, and
    # the carry being applied at a later push's lr_scale (6% off in one CI run; rounded
    # alone, the bias stays 0.0)
    assert bias == pytest.approx(want, rel=0.25), (bias, want)


def test_an_unknown_wire_is_one_line_exit_2(digits_dir, tmp_path):
    res, _ = train(2, digits_dir, tmp_path, "bad", "--wire", "bf8", "--epochs", "1", timeout=60)
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "--wire" in errors[0] and "bf16" in errors[0], res.stderr


def test_bench_ps_moves_16_bit_values_with_wire_bf16():
    """`bench ps --wire bf16`: the real server's pushes and replies carry half the payload
    bytes of fp32's (the rate is not asserted: timings mean nothing on a shared machine)."""
    per_update = {}
    for wire in ("fp32", "bf16"):
        res = mpirun.run(3, "bench", "ps", "--params", "20000", "--seconds", "0.3", "--repeats",
                         "1", "--json", "--wire", wire, timeout=120)
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["wire"] == wire and out["updates_per_s"] > 0 and out["baseline_updates_per_s"] > 0
        store = out["runs"][0]["servers"][0]
        per_update[wire] = (store["bytes_in"] / store["updates"] - 384,
                            store["bytes_out"] / store["updates"])
    # control messages (hello, stats, the end) are spread over the updates too: a few hundred
    # bytes an update when a loaded machine makes few of them, hence 5%, not exactly half
    assert per_update["bf16"][0] == pytest.approx(per_update["fp32"][0] / 2, rel=0.05)
    assert per_update["bf16"][1] < 0.6 * per_update["fp32"][1]
    res = mpirun.run(2, "bench", "ps", "--wire", "bf17", timeout=60)
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(errors) == 1 and "--wire 'bf17'" in errors[0], res.stderr


def test_batchnorm_state_follows_a_bf16_gradient_as_float32(digits_dir, tmp_path):
    """The torch CNN's BatchNorm statistics travel after the bf16 gradient in float32: the
    server's (checkpointed) state is the workers' running means and variances, not bf16
    bits read at the wrong offset (garbage) nor the initial zeros and ones."""
    pytest.importorskip("torch")
    res, log = train(3, digits_dir, tmp_path, "cnn", "--model", "examples/torch_cnn.py:Net",
                     "--epochs", "1", "--wire", "bf16")
    finished(res, log, "bf16")
    with h5py.File(tmp_path / "cnn.ckpt.h5", "r") as f:
        state = f["state"][...]
    assert state.dtype == np.float32 and np.isfinite(state).all()
    assert np.abs(state).max() < 1e4
    assert not np.isin(state, [0.0, 1.0]).all()   # the statistics moved


NO_FP16 = """
import sys
from mpilb.mpi import wire_format

def cannot(self, src, dst, xp=None, scratch=None, finite=False):
    raise TypeError("no float16 on this device")

wire_format.Float16.encode = cannot   # a device without half precision
from mpilb.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_device_that_cannot_convert_is_one_line_exit_2(digits_dir, tmp_path):
    script = tmp_path / "nofp16.py"
    script.write_text(NO_FP16)
    cmd = [mpirun.mpiexec(), "-n", "3", sys.executable, str(script), "train", "--data", digits_dir,
           "--epochs", "1", "--no-progress", "--wire", "fp16", "--log", str(tmp_path / "run.h5")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env=mpirun.env(PYTHONPATH=ROOT))
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, res.stderr
    assert errors[0].startswith("mpilb: error: rank 1: --wire fp16: device cpu cannot convert "
                                "float32 to fp16 (TypeError: no float16 on this device)"), errors
