"""The recipe basics of PyTorch on mpilb's parameter stores: --optimizer adamw, --clip-norm,
a torch.optim class by name (--optimizer torch.optim.NAME, --optimizer-arg).

The end-to-end checks train the same torch module serially with mpilb and in a plain
PyTorch loop with the same optimizer, and compare final test accuracy. The plain loop
replays the batches the mpilb run applied (its updates/ rows: shard, positions, learning-rate
scale), so what differs between the two is the optimizer and nothing else.
"""

import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpirun
from mpilb.config.build import build_config
from mpilb.errors import UsageError
from mpilb.server.modes import ParamRing
from mpilb.core.optimizers import clip_grad_norm
from mpilb.config.validate import check_optimizer
from mpilb.run.components import config_optimizer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MODEL = ("--model", f"{EXAMPLES}/torch_mlp.py:MLP", "--model-arg", "hidden=32",
         "--model-arg", "layers=1")


# ----------------------------------------------------------------- units (no training)

def test_clip_grad_norm_scales_as_torch():
    torch = pytest.importorskip("torch")
    g = np.array([3.0, -4.0, 12.0], np.float32)          # norm 13
    for max_norm in (1.0, 13.0, 50.0):
        ours = g.copy()
        clip_grad_norm(ours, max_norm)
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = torch.from_numpy(g.copy())
        torch.nn.utils.clip_grad_norm_([p], max_norm)
        np.testing.assert_allclose(ours, p.grad.numpy(), rtol=1e-6)
    ours = g.copy()
    clip_grad_norm(ours, None)
    np.testing.assert_array_equal(ours, g)


class _Sgd:
    into_grad = False

    def step(self, params, grad, lr_scale=1.0, out=None):
        out = params if out is None else out
        out[...] = params - lr_scale * grad


def test_a_sync_round_clips_its_mean_gradient_not_each_push():
    from mpilb.core.corrections import build_correction

    store = ParamRing(np.zeros(2, np.float32), _Sgd(), build_correction("none", 0.0), 1,
                       clip_norm=1.0)
    # pushes (10, 0) and (-6, 0) of batch 1: their mean (2, 0) is clipped to (1, 0), then
    # applied with lr scale 2 (the round's batch over --batch 1); clipping each push first
    # would have given a mean of (0, 0)
    store.apply_sum(np.array([10.0 - 6.0, 0.0], np.float32), batch=2)
    np.testing.assert_allclose(store.params, [-2.0, 0.0], rtol=1e-5)


def test_torch_optimizer_state_round_trip_and_checkpoint_form(tmp_path):
    pytest.importorskip("torch")
    cfg = build_config({}, {"optimizer": "torch:RMSprop", "lr": 0.01,
                            "optimizer_arg": ["momentum=0.5", "centered=true"]})
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((5, 40)).astype(np.float32)
    a = config_optimizer(cfg.optim, 40)
    pa = rng.standard_normal(40).astype(np.float32)
    for g in grads[:3]:
        a.step(pa, g.copy(), 0.5)
    state = a.state_dict()
    assert state["name"] == "torch.optim.RMSprop" and state["steps"] == 3
    assert {"state.square_avg", "state.momentum_buffer", "state.grad_avg"} <= set(state)
    with h5py.File(tmp_path / "s.h5", "w") as f:   # as checkpoint.save writes it, and reads
        for k, v in state.items():
            (f.create_dataset(k, data=v) if isinstance(v, np.ndarray) else f.attrs.__setitem__(k, v))
    with h5py.File(tmp_path / "s.h5", "r") as f:
        loaded = {k: f[k][()] for k in f}
        loaded.update({k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()})
    b = config_optimizer(cfg.optim, 40)
    b.load_state_dict(loaded)
    pb = pa.copy()
    for g in grads[3:]:
        a.step(pa, g.copy())
        out = np.empty_like(pb)
        b.step(pb, g.copy(), out=out)   # out of place: the same floats
        pb = out
    np.testing.assert_array_equal(pa, pb)
    with pytest.raises(UsageError, match="RMSprop.*'adam'"):
        config_optimizer(build_config({}, {"optimizer": "adam"}).optim, 40).load_state_dict(state)


@pytest.mark.parametrize("values,message", [
    ({"optimizer": "torch.optim.RMSProp"}, "no optimizer class 'RMSProp' \\(did you mean 'RMSprop'"),
    ({"optimizer": "torch.optim.LBFGS"}, "closure"),
    ({"optimizer": "torch:SGD", "optimizer_arg": ["lr=0.1"]}, "--lr"),
    ({"optimizer": "torch:SGD", "optimizer_arg": ["bogus=1"]}, "bogus"),
    ({"optimizer": "torch:Adam", "servers": 2}, "not sliced over parameter stores"),
    ({"optimizer": "adam", "optimizer_arg": ["momentum=0.9"]}, "takes only betas, eps"),
    ({"optimizer": "adamw", "optimizer_arg": ["betas=0.9"]}, "two numbers"),
    ({"optimizer": "sgd", "optimizer_arg": ["eps=1"]}, "takes none"),
    ({"clip_norm": 1.0, "mode": "sync", "servers": 2, "pipeline": 0}, "--servers 1"),
])
def test_optimizer_mistakes_are_one_line(values, message):
    if str(values.get("optimizer", "")).startswith("torch"):
        pytest.importorskip("torch")
    with pytest.raises(UsageError, match=message):
        check_optimizer(build_config({}, values), world_size=4)


def test_builtin_betas_and_eps_reach_adam():
    opt = config_optimizer(build_config({}, {"optimizer": "adamw", "optimizer_arg":
                                             ["betas=[0.8, 0.99]", "eps=1e-6"]}).optim, 4)
    assert (opt.beta1, opt.beta2, opt.eps, opt.decay) == (0.8, 0.99, 1e-6, 0.01)


# ----------------------------------------------------------------- mpilb vs plain PyTorch

def _plain_torch(digits_dir, log, make_optimizer, lr, clip=None, seed=0):
    """Final test accuracy of the MLP trained in a plain PyTorch loop on the batches the
    mpilb run in `log` applied, in its order, with its learning-rate scales."""
    import torch

    sys.path.insert(0, str(EXAMPLES))
    try:
        from torch_mlp import MLP
    finally:
        sys.path.remove(str(EXAMPLES))
    from mpilb.data.dataset import open_dataset

    torch.manual_seed(seed)
    net = MLP((1, 8, 8), 10, hidden=32, layers=1)
    opt = make_optimizer(net.parameters())
    data = open_dataset(digits_dir)
    shards = [data.load_file(s.file, s.samples) for s in data.shards]
    with h5py.File(log, "r") as f:
        u = {k: f["updates"][k][()] for k in ("epoch", "shard", "lo", "hi", "lr_scale")}
    perms = {}
    for epoch, shard, lo, hi, scale in zip(*u.values()):
        key = (int(epoch), int(shard))
        if key not in perms:   # mpilb's per-epoch shard permutation (shards.py)
            perms[key] = np.random.default_rng([seed, *key]).permutation(len(shards[shard][1]))
        rows = perms[key][lo:hi]
        x = torch.from_numpy(shards[shard][0][rows])
        y = torch.from_numpy(shards[shard][1][rows].astype(np.int64))
        for group in opt.param_groups:
            group["lr"] = lr * float(scale)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    x, y = data.load_test()
    with torch.no_grad():
        return float((net(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def _mpilb(digits_dir, tmp_path, *args):
    import json

    log = tmp_path / "run.h5"
    res = mpirun.run(0, "train", "--data", digits_dir, *MODEL, "--epochs", "3", "--no-progress",
                     "--log", log, *args, timeout=300)
    assert res.returncode == 0, res.stderr
    with h5py.File(log, "r") as f:
        return log, json.loads(f["summary"].attrs["json"])["final_test_accuracy"]


@pytest.mark.parametrize("args,torch_class,kwargs,clip", [
    (("--optimizer", "adamw", "--lr", "0.003"), "AdamW", {}, None),
    (("--optimizer", "momentum", "--lr", "0.05", "--clip-norm", "0.5"), "SGD",
     {"momentum": 0.9}, 0.5),
    (("--optimizer", "torch.optim.RMSprop", "--lr", "0.001", "--optimizer-arg", "alpha=0.9"),
     "RMSprop", {"alpha": 0.9}, None),
])
def test_same_accuracy_as_plain_pytorch(digits_dir, tmp_path, args, torch_class, kwargs, clip):
    torch = pytest.importorskip("torch")
    log, ours = _mpilb(digits_dir, tmp_path, *args)
    lr = float(args[args.index("--lr") + 1])
    cls = getattr(torch.optim, torch_class)
    theirs = _plain_torch(digits_dir, log, lambda p: cls(p, lr=lr, **kwargs), lr, clip)
    assert ours > 0.85 and abs(ours - theirs) <= 0.01, (ours, theirs)


@pytest.mark.parametrize("mode", [("--mode", "sync"), ("--mode", "async", "--pipeline", "0")])
def test_clip_norm_under_mpiexec_equals_serial(digits_dir, tmp_path, mode):
    """One worker: a sync round's mean (clipped on rank 0) and an async push (clipped by the
    worker) are the serial run's batch gradient, clipped the same way."""
    args = ("--data", digits_dir, "--hidden", "32", "--epochs", "2", "--no-progress",
            "--optimizer", "adamw", "--lr", "0.003", "--clip-norm", "0.3", "--seed", "7")
    runs = {}
    for name, n, extra in [("serial", 0, ()), ("mpi", 2, mode),
                           ("unclipped", 0, ("--clip-norm", "100"))]:
        res = mpirun.run(n, "train", *args, *extra, "--log", tmp_path / f"{name}.h5", timeout=300)
        assert res.returncode == 0, res.stderr
        with h5py.File(tmp_path / f"{name}.ckpt.h5", "r") as f:
            runs[name] = f["params"][()]
    np.testing.assert_allclose(runs["mpi"], runs["serial"], rtol=1e-4, atol=1e-6)
    assert np.abs(runs["unclipped"] - runs["serial"]).max() > 1e-3   # the clip did something


def test_torch_optimizer_resumes_from_its_checkpointed_state(digits_dir, tmp_path):
    """Two epochs straight, or one then --resume for the second: the same parameters (the
    torch optimizer's state went through the checkpoint)."""
    pytest.importorskip("torch")
    args = ("--data", digits_dir, "--hidden", "32", "--no-progress", "--batch", "64",
            "--optimizer", "torch:RMSprop", "--lr", "0.001", "--optimizer-arg", "momentum=0.5")
    for extra in (("--epochs", "2", "--log", tmp_path / "straight.h5"),
                  ("--epochs", "1", "--log", tmp_path / "split.h5"),
                  ("--epochs", "2", "--log", tmp_path / "split.h5", "--resume")):
        # one OpenMP thread: with torch's default (the cores) two straight serial runs of
        # this case ended a few ulps apart in about 1 of 6 (2026-12-07, 2-core VM; 24 of 24
        # identical with one thread), which is not what this test is about
        res = mpirun.run(0, "train", *args, *extra, timeout=300, OMP_NUM_THREADS="1")
        assert res.returncode == 0, res.stderr
    with h5py.File(tmp_path / "straight.ckpt.h5", "r") as f, \
            h5py.File(tmp_path / "split.ckpt.h5", "r") as g:
        assert "state.momentum_buffer" in g["optimizer"] and g["optimizer"].attrs["steps"] > 0
        np.testing.assert_array_equal(f["params"][()], g["params"][()])
