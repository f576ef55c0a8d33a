"""The Python API (mpilb.train / mpilb.load) and trained weights out (mpilb export/evaluate)."""

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpirun

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def python(code: str, *args, n: int = 0, cwd=None, timeout=240, **env):
    cmd = [sys.executable, "-c", code, *map(str, args)]
    if n:
        cmd = [mpirun.mpiexec(), "-n", str(n), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=mpirun.env(**env))


def test_api_raises_usage_error_instead_of_exiting(tmp_path, digits_dir):
    code = ("import mpilb, sys\n"
            "try:\n    mpilb.train(model='mlp', data=sys.argv[1], lr=-1)\n"
            "except mpilb.UsageError as e:\n    print('caught', e)\n")
    res = python(code, digits_dir, cwd=tmp_path)
    assert res.returncode == 0 and "caught --lr = -1.0: must be a number > 0" in res.stdout, res.stderr


def test_numpy_model_object_through_the_api_then_load(tmp_path, digits_dir):
    code = ("import sys, mpilb\nsys.path.insert(0, sys.argv[2])\nfrom mymodels import Linear\n"
            "s = mpilb.train(model=Linear, data=sys.argv[1], epochs=2, lr=0.2, "
            "log='a.h5', checkpoint='a.ckpt.h5', progress=False, model_args={'scale': 0.0})\n"
            "if s: print('SUMMARY', s['final_test_accuracy'], s['coverage']['missing'])\n")
    res = python(code, digits_dir, EXAMPLES, n=3, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("SUMMARY")]
    assert len(line) == 1, res.stdout           # rank 0 alone gets the summary
    acc, missing = float(line[0].split()[1]), int(line[0].split()[2])
    assert acc > 0.8 and missing == 0
    load = ("import sys, mpilb, h5py\nsys.path.insert(0, sys.argv[2])\nm = mpilb.load('a.ckpt.h5', model='mymodels:Linear')\n"
            "f = h5py.File(sys.argv[1] + '/test.h5')\n"
            "print(type(m).__name__, m.evaluate(m.params, f['x'][()], f['y'][()])['accuracy'])\n")
    res = python(load, digits_dir, EXAMPLES, cwd=tmp_path, PYTHONPATH=f"{ROOT}:{EXAMPLES}")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["Linear", str(acc)]
    res = mpirun.run(0, "evaluate", tmp_path / "a.ckpt.h5", "--data", digits_dir, "--json",
                     "--model", "mymodels:Linear", PYTHONPATH=f"{ROOT}:{EXAMPLES}")
    assert res.returncode == 0 and json.loads(res.stdout)["accuracy"] == acc, res.stderr
    res = mpirun.run(0, "export", tmp_path / "a.ckpt.h5", tmp_path / "w.npz")
    with np.load(tmp_path / "w.npz") as w:
        assert list(w) == ["params"] and w["params"].size == 64 * 10 + 10


def test_torch_script_under_mpiexec_export_reproduces_accuracy(tmp_path, digits_dir):
    """Issue 12's API check: a short script trains a torch module under mpiexec -n 4; the
    exported state_dict in a fresh Net reproduces the logged final test accuracy exactly."""
    pytest.importorskip("torch")
    res = subprocess.run([mpirun.mpiexec(), "-n", "4", sys.executable, EXAMPLES / "train_api.py",
                          digits_dir, "2"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=mpirun.env())
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("coverage {'expected'") == 1 and "Net 6186 parameters" in res.stdout
    with h5py.File(tmp_path / "api.h5", "r") as f:
        logged = json.loads(f["summary"].attrs["json"])["final_test_accuracy"]
    res = mpirun.run(0, "export", tmp_path / "api.ckpt.h5", tmp_path / "net.pt",
                     PYTHONPATH=f"{ROOT}:{EXAMPLES}")
    assert res.returncode == 0, res.stderr
    code = ("import sys, torch, h5py\nsys.path.insert(0, sys.argv[2])\nfrom torch_cnn import Net\n"
            "net = Net(); net.load_state_dict(torch.load(sys.argv[3])); net.eval()\n"
            "f = h5py.File(sys.argv[1] + '/test.h5')\n"
            "x, y = torch.from_numpy(f['x'][()]), torch.from_numpy(f['y'][()])\n"
            "print((net(x).argmax(1) == y).double().mean().item())\n")
    res = python(code, digits_dir, EXAMPLES, tmp_path / "net.pt")
    assert res.returncode == 0, res.stderr
    assert float(res.stdout) == logged


def test_a_run_log_given_as_a_checkpoint_names_the_checkpoint(tmp_path):
    """`mpilb evaluate RUN.h5` (or export): the file is a run log, and its run's
    checkpoint, when it exists, is named; another HDF5 file is said not to be one."""
    from mpilb.errors import UsageError
    from mpilb.runfiles.export import read_checkpoint

    log = tmp_path / "run.h5"
    with h5py.File(log, "w") as f:
        f.attrs["status"] = "finished"
        f.attrs["config"] = json.dumps({"checkpoint": str(tmp_path / "elsewhere.ckpt.h5")})
    with pytest.raises(UsageError) as err:
        read_checkpoint(log)
    assert str(err.value).startswith(f"{log}: an mpilb run log, not a checkpoint; ")
    assert "run.ckpt.h5 by default) was not found" in str(err.value)
    (tmp_path / "run.ckpt.h5").write_bytes(b"")
    with pytest.raises(UsageError, match="use its run's checkpoint .*run.ckpt.h5$"):
        read_checkpoint(log)
    shard = tmp_path / "shard.h5"
    with h5py.File(shard, "w") as f:
        f["x"] = np.zeros((2, 3), np.float32)
    with pytest.raises(UsageError, match="not an mpilb checkpoint: an HDF5 file without"):
        read_checkpoint(shard)


def test_an_unknown_keyword_is_named_as_written():
    import mpilb

    with pytest.raises(mpilb.UsageError, match=r"mpilb.train: unknown keyword 'epochz' \(did you mean 'epochs'\?\)"):
        mpilb.train(model="mlp", data="unused", epochz=3)
