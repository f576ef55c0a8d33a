"""--servers K: slices, the zero-copy parameter ring, and K stores end to end (the same
parameters as one store under sync, the same accuracy and exact coverage in every mode,
resume across K, a lost worker, bad input)."""

from __future__ import annotations


import h5py
import numpy as np
import pytest

import mpirun
from mpilb.mpi import wire
from mpilb.core.corrections import build_correction
from mpilb.errors import UsageError
from mpilb.core.optimizers import build_optimizer
from mpilb.runfiles.summary import summarize_log
from mpilb.server.modes import ParamRing
from mpilb.config.validate import check_servers


# ------------------------------------------------------------------ slices
def test_slices_are_balanced_and_prefer_layer_boundaries():
    assert wire.cut_slices(10, 1) == [0, 10]
    assert wire.cut_slices(10, 3) == [0, 3, 7, 10]
    # layers of 480 and 520 floats: the boundary is 2 % off the middle: cut there
    assert wire.cut_slices(1000, 2, [480, 520]) == [0, 480, 1000]
    # 400/600 would cost 20 % imbalance: cut evenly inside the layer instead
    assert wire.cut_slices(1000, 2, [400, 600]) == [0, 500, 1000]
    for n, k in [(7, 7), (1001, 4), (5, 2)]:
        b = wire.cut_slices(n, k, [n])
        sizes = np.diff(b)
        assert b[0] == 0 and b[-1] == n and sizes.min() >= 1 and sizes.max() - sizes.min() <= 1
    with pytest.raises(ValueError):
        wire.cut_slices(3, 4)


def test_check_servers_names_the_problem():
    cfg = mpirun.config_stub(servers=4, inject=[])
    with pytest.raises(UsageError, match="--servers 4 leaves no worker"):
        check_servers(cfg, 4, 1000)
    with pytest.raises(UsageError, match="exceeds the model's 3 parameters"):
        check_servers(cfg, 8, 3)
    with pytest.raises(UsageError, match="more than 4 ranks"):
        check_servers(cfg, 1, 1000)
    check_servers(cfg, 5, 1000)
    with pytest.raises(UsageError, match="rank 2 is a parameter store"):
        check_servers(mpirun.config_stub(servers=3, inject=["2:compute=2"]), 5, 1000)
    check_servers(mpirun.config_stub(servers=3, inject=["3:compute=2", "*:delay=0.1"]), 5, 1000)


# ------------------------------------------------------------------ the parameter ring
class FakeSend:
    def __init__(self):
        self.done = False

    def Test(self):
        return self.done


@pytest.mark.parametrize("into", ["other", "grad"])
@pytest.mark.parametrize("name,wd,nesterov", [("sgd", 0.0, False), ("sgd", 0.01, False),
                                              ("momentum", 0.0, False), ("momentum", 0.01, True),
                                              ("adam", 0.0, False), ("adam", 0.01, False)])
def test_out_of_place_step_is_the_same_floats(name, wd, nesterov, into):
    """Into another vector or into the gradient's own buffer (which the step consumes):
    the same floats as in place."""
    rng = np.random.default_rng(0)
    n = 70000   # more than one block of the host step
    p = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    a, b = (build_optimizer(name, n, lr=0.1, weight_decay=wd, nesterov=nesterov) for _ in range(2))
    pa, pb = p.copy(), p.copy()
    for g in grads:
        a.step(pa, g, 0.5)
        out = g.copy() if into == "grad" else np.empty_like(pb)
        b.step(pb, out if into == "grad" else g, 0.5, out=out)
        pb = out
    assert np.array_equal(pa, pb)
    for buf in a._buffers:
        assert np.array_equal(getattr(a, buf), getattr(b, buf))


def test_a_send_in_flight_keeps_its_parameters():
    n = 64
    store = ParamRing(np.zeros(n, np.float32), build_optimizer("sgd", n, lr=1.0),
                       build_correction("none"), nominal_batch=1)
    g = np.ones(n, np.float32)
    store.apply(g, 1, 0)
    first = store.params
    send = FakeSend()
    store.sending(send, rank=3)
    store.apply(g, 1, 0)      # the send still reads `first`: the step goes elsewhere
    assert store.params is not first and np.all(first == -1) and np.all(store.params == -2)
    assert store.version == 2 and store.params_of(1) is first
    send.done = True
    store.apply(g, 1, 0)      # nothing reads the current buffer: in place, no new buffer
    assert len(store.ring) == 2 and np.all(store.params == -3)
    assert store.updates == 3 and store.apply_s > 0


def test_dc_keeps_the_version_a_worker_computed_on():
    n = 8
    store = ParamRing(np.zeros(n, np.float32), build_optimizer("sgd", n, lr=1.0),
                       build_correction("dc"), nominal_batch=1, keep_sent=1)
    store.sending(FakeSend(), rank=5)   # worker 5 got version 0 (its send never completes)
    done = FakeSend()
    done.done = True
    for _ in range(3):
        store.apply(np.ones(n, np.float32), 1, 0)
        store.sending(done, rank=6)     # worker 6 always gets the latest
    assert np.all(store.params_of(0) == 0)


def test_ctrl_messages_round_trip():
    buf = np.zeros(wire.CTRL_FIELDS)
    wire.encode_ctrl(buf, wire.Op.APPLY, rank=4, batch=32, staleness=2, version=17)
    assert wire.decode_ctrl(buf) == (wire.Op.APPLY, 4, 32, 2, 17, 1.0, (0.0, -1))   # no schedule
    assert buf.tolist()[:5] == [1, 4, 32, 2, 17]


# ------------------------------------------------------------------ end to end
pytestmark_mpi = pytest.mark.mpi


def train(n, data, tmp_path, name, servers, *extra, timeout=90):
    log, ck = tmp_path / f"{name}.h5", tmp_path / f"{name}.ckpt.h5"
    args = ["train", "--data", data, "--no-progress", "--balancer", "static", "--servers",
            servers, "--log", log, "--checkpoint", ck, *extra]
    res = mpirun.run(n, *args, timeout=timeout)
    return res, log, ck


def params(ck):
    with h5py.File(ck, "r") as f:
        return f["params"][()]


def exact(s):
    cov = s["coverage"]
    return cov["applied"] == cov["expected"] and cov["duplicates"] == 0 and cov["missing"] == 0


SYNC = ["--model", "mlp", "--hidden", "32", "--optimizer", "adam", "--lr", "0.01", "--mode", "sync"]


@pytest.mark.mpi
def test_two_stores_follow_rank0s_lr_schedule(digits_dir, tmp_path):
    """--lr-schedule/--warmup with K=2: rank 0 sends its factor with each APPLY/ROUND, so the
    other store's slice steps with the same learning rate (sync: the same parameters)."""
    sched = [*SYNC, "--lr-schedule", "cosine", "--warmup", "20", "--epochs", "2"]
    res, _, one = train(4, digits_dir, tmp_path, "one", 1, *sched)
    assert res.returncode == 0, res.stderr
    res, _, two = train(5, digits_dir, tmp_path, "two", 2, *sched)
    assert res.returncode == 0, res.stderr
    ref = params(one)
    assert np.abs(params(two) - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


@pytest.mark.mpi
def test_sync_two_stores_same_parameters_and_resume_across_k(digits_dir, tmp_path):
    """Three workers, fixed batches, sync: 2 stores give one store's parameters, also when
    the run goes K=2 -> K=1 -> K=2 through checkpoints."""
    res, _, one = train(4, digits_dir, tmp_path, "one", 1, *SYNC, "--epochs", "3")
    assert res.returncode == 0, res.stderr
    res, log, two = train(5, digits_dir, tmp_path, "two", 2, *SYNC, "--epochs", "3")
    assert res.returncode == 0, res.stderr
    ref = params(one)
    assert np.abs(params(two) - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    s = summarize_log(str(log))
    assert [v["rank"] for v in s["servers"]] == [0, 1] and s["workers"] == 3
    assert sum(v["params"] for v in s["servers"]) == ref.size
    assert all(v["updates"] == s["servers"][0]["updates"] > 0 for v in s["servers"])
    for n, k, epochs in [(5, 2, 1), (4, 1, 2), (5, 2, 3)]:
        res, log, ck = train(n, digits_dir, tmp_path, "hop", k, *SYNC, "--epochs", epochs,
                             *(["--resume"] if epochs > 1 else []))
        assert res.returncode == 0, res.stderr
    assert np.abs(params(ck) - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    assert exact(summarize_log(str(log)))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["async", "ssp", "sync"])
def test_two_stores_reach_one_stores_accuracy(digits_dir, tmp_path, mode):
    acc = {}
    for n, k in [(4, 1), (5, 2)]:
        res, log, _ = train(n, digits_dir, tmp_path, f"{mode}{k}", k, "--model", "softmax",
                            "--mode", mode, "--epochs", "4",
                            *(("--staleness-bound", "1") if mode == "ssp" else ()))
        assert res.returncode == 0, res.stderr
        s = summarize_log(str(log))
        assert exact(s) and s["epochs_completed"] == 4
        acc[k] = s["final_test_accuracy"]
    assert acc[1] > 0.85 and abs(acc[2] - acc[1]) <= 0.03, acc


@pytest.mark.mpi
def test_a_lost_worker_is_dropped_by_every_store(digits_dir, tmp_path):
    res, log, _ = train(5, digits_dir, tmp_path, "lost", 2, "--model", "mlp", "--hidden", "32",
                        "--epochs", "30", "--inject", "3:hang@0.3", "--worker-timeout", "1.5",
                        "--balancer", "load", timeout=120)
    assert res.returncode == 3, res.stderr
    s = summarize_log(str(log))
    assert s["status"] == "degraded" and s["lost_workers"] == [3] and exact(s)


@pytest.mark.mpi
@pytest.mark.parametrize("n,servers,needle", [(4, 0, "--servers"), (4, 4, "--servers 4 leaves no worker"),
                                              (3, 5, "--servers 5 leaves no worker")])
def test_bad_servers_exit_2_one_line(digits_dir, tmp_path, n, servers, needle):
    res, _, _ = train(n, digits_dir, tmp_path, "bad", servers, "--epochs", "1", timeout=60)
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and needle in errors[0], res.stderr


@pytest.mark.mpi
def test_per_node_on_one_node_is_one_store_and_says_so(digits_dir, tmp_path):
    res, log, _ = train(4, digits_dir, tmp_path, "pernode", "per-node", "--model", "softmax",
                        "--epochs", "1")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == ("mpilb: --servers per-node: the job is on one node, "
                                          "so one parameter store (rank 0)")
    with h5py.File(log, "r") as f:
        assert f.attrs["nodes"] == "[0, 0, 0, 0]" and f.attrs["stores"] == "[0]"
    s = summarize_log(str(log))
    assert [v["rank"] for v in s["servers"]] == [0] and s["workers"] == 3 and exact(s)
