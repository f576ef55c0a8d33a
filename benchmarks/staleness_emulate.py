"""Staleness policies compared in one process: the statistical efficiency of async training
(samples to a target accuracy, final accuracy) without MPI, ranks or a machine's timing.

    python benchmarks/staleness_emulate.py CASE MODE WORKERS [--slow K] [--correction C]
        [--weight-prediction on|off] [--sync-scaling linear|none] [--noise 0.3] [--seeds 2]
        [--dir DIR]

CASE: recipe (the torch MLP 256-256-256-10 of benchmarks/staleness.py on synthetic
60000x256, batch 128, 6 epochs, target 0.808, stops there), mlp, cnn or tcnn (digits: the
built-in mlp (hidden 64), the built-in cnn, examples/torch_cnn.py:Net; batch 32, 10 epochs,
target 0.9). MODE: sync or async. All with --optimizer momentum (0.9), lr 0.05.

The server's own ParamRing, optimizer and correction apply the gradients; what is emulated
is the arrival order. Each of W workers reads the current parameters, computes a gradient
on its next batch (the batches of one shuffled stream), and delivers it after a
compute time drawn from a lognormal (sigma --noise, 0.3 by default: the scheduling noise of
shared cores) times K for the last worker (--slow K: a K-times straggler). Its staleness is the versions
applied meanwhile, as in the engine with --pipeline 0. Sync sums the W gradients of a round
computed on the same parameters (ParamRing.apply_sum). The test set is read in part (4000
rows of the synthetic set, all 360 of digits) every 4096 (recipe) or 256 samples.

--correction: a registered correction (none, momentum, dynamic, lookahead, gap, dana,
inverse, dc: those that read the parameters a gradient was computed on, dc and gap, are given the
ones the worker computed on, predicted or not), or a rule
tried while choosing one (docs/benchmarks/staleness.md): ``mu=RULE[,lr=out|dyn][,clip=C]``
with RULE ``sub`` (mu0 - tau/(tau+1), as momentum), ``kK`` (1 - (1-mu0)(tau+1)/K: k1 is
dynamic), ``cC`` (1 - (1-mu0)(1 + C tau): c0.7 is lookahead's momentum), ``fixedM``
(momentum M) or ``persub`` (sub of each gradient's own staleness); lr=out multiplies a
gradient's lr by min(1, (tau+1)/(tau_i+1)) (a gradient staler than the mean weighted down),
lr=dyn by 1/(tau_i+1); warm=N ramps the lr up over the first N gradients (n/N: with c0.7
and N = 40, lookahead); clip=C clips each gradient to C times the moving mean of the
norms; prior=X starts the staleness mean at X (as if 10 gradients had shown it);
adapt=ETA (with cC) multiplies the long-run step by a gain between 1 and 1 + C tau that grows
by exp(ETA cos) with the cosine of each gradient and the momentum buffer (the gains at the
50th and 200th gradient and at the end are printed); syncwarm=N runs the first N rounds as
sync rounds before the workers go asynchronous; accum=C sums C gradients as they come and
applies them as one step of their samples (server-side accumulation: a sync round's step,
each gradient computed on the parameters of a step or so before; staleness is then counted
in those steps); steer=B advances the warm=N ramp by 1 + B a gradient while a fast mean of
the gradients' norms is under a slow one, and halves it when the fast one passes 1.5x the
slow. tau: the moving mean staleness (corrections.StalenessMeter).

--weight-prediction on: each worker computes on the parameters it read extrapolated by the
staleness its gradients met (core/prediction.py, as the engine's workers do).
--sync-scaling none: a sync round's mean gradient steps by lr, as PyTorch DDP's averaged
gradient does, instead of the engine's lr x the round's samples / --batch (linear: the same
step per sample as one worker).

Its figures matched the engine's where both were measured (digits mlp and cnn, the recipe
with a straggler: docs/benchmarks/staleness.md), at a fraction of the cost; the engine's
figures are the ones to quote.
"""

from __future__ import annotations

import argparse
import glob
import heapq
import os
import sys

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this tree's mpilb
from mpilb.core.corrections import StalenessMeter, build_correction  # noqa: E402
from mpilb.core.optimizers import build_optimizer  # noqa: E402
from mpilb.core.prediction import WeightPrediction  # noqa: E402
from mpilb.models import build_model  # noqa: E402
from mpilb.server.modes import ParamRing  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MU0, LR = 0.9, 0.05
CASES = {
    "recipe": dict(data="synthetic-60000x256", model=os.path.join(HERE, "examples/torch_mlp.py:MLP"),
                   model_args={"hidden": 256, "layers": 3}, batch=128, epochs=6, target=0.808,
                   every=4096, stop=True, test_rows=4000),
    "mlp": dict(data="digits", model="mlp", hidden=(64,), batch=32, epochs=10, target=0.9, every=256),
    "cnn": dict(data="digits", model="cnn", batch=32, epochs=10, target=0.9, every=256),
    "tcnn": dict(data="digits", model=os.path.join(HERE, "examples/torch_cnn.py:Net"), batch=32,
                 epochs=10, target=0.9, every=256),
}


def load(path: str, test_rows=None):
    xs, ys = [], []
    for name in sorted(glob.glob(os.path.join(path, "shard-*.h5"))):
        with h5py.File(name) as h:
            xs.append(h["x"][:])
            ys.append(h["y"][:])
    with h5py.File(os.path.join(path, "test.h5")) as h:
        tx, ty = h["x"][:test_rows], h["y"][:test_rows]
    return np.concatenate(xs), np.concatenate(ys), tx, ty


class Rule:
    """A ``mu=...`` rule: sets the momentum and scales or clips each gradient before the
    ring applies it (the ring's own correction is then none)."""

    def __init__(self, spec: str):
        self.opts = dict(kv.split("=") for kv in spec.split(","))
        self.norm, self.count = 0.0, 0
        self.gain, self.gains = 1.0, []   # adapt=: the long-run step's gain, and its history
        self.ramp, self.fast, self.slow = 0.0, None, None   # steer=: the ramp, the norms' means

    def momentum(self, tau: float, staleness: int) -> float:
        r = self.opts.get("mu", "sub")
        if r == "sub":
            return max(0.0, MU0 - tau / (tau + 1))
        if r == "persub":
            return max(0.0, MU0 - staleness / (staleness + 1))
        if r.startswith("k"):
            return max(0.0, 1 - (1 - MU0) * (tau + 1) / float(r[1:]))
        if r.startswith("c"):
            return max(0.0, 1 - (1 - MU0) * (1 + float(r[1:]) * tau) / self.gain)
        return float(r[len("fixed"):])

    def adapt(self, g: np.ndarray, velocity: np.ndarray, tau: float) -> None:
        """adapt=ETA: the long-run step's gain grows while each gradient agrees with the
        momentum (cosine > 0) and shrinks when it opposes it, between 1 and 1 + C tau."""
        if "adapt" not in self.opts:
            return
        nv = float(np.linalg.norm(velocity))
        if nv == 0:
            return
        cos = float(np.dot(g, velocity)) / (float(np.linalg.norm(g)) * nv + 1e-30)
        top = 1 + float(self.opts["mu"][1:]) * tau
        gain = self.gain * np.exp(float(self.opts["adapt"]) * cos)
        self.gain = float(np.clip(gain, 1.0, max(1.0, top)))
        self.gains.append(self.gain)

    def steer(self, norm: float) -> None:
        """steer=B: the ramp's position, moved on by the gradients' norms."""
        if self.fast is None:
            self.fast = self.slow = norm
        self.fast += 0.3 * (norm - self.fast)
        self.slow += 0.05 * (norm - self.slow)
        if self.fast > 1.5 * self.slow:
            self.ramp *= 0.5
        self.ramp += 1.0 + (float(self.opts["steer"]) if self.fast < self.slow else 0.0)

    def scale(self, g: np.ndarray, tau: float, staleness: int) -> None:
        lr = self.opts.get("lr")
        if lr == "out":
            g *= min(1.0, (tau + 1) / (staleness + 1))
        elif lr == "dyn":
            g *= 1.0 / (staleness + 1)
        if "steer" in self.opts:
            self.steer(float(np.linalg.norm(g)))
            g *= min(1.0, self.ramp / float(self.opts.get("warm", 40)))
        elif "warm" in self.opts:
            self.applied = getattr(self, "applied", 0) + 1
            g *= min(1.0, self.applied / float(self.opts["warm"]))
        if "clip" in self.opts:
            n = float(np.linalg.norm(g))
            self.count += 1
            self.norm += (n - self.norm) * max(0.01, 1 / self.count)
            limit = float(self.opts["clip"]) * self.norm
            if n > limit:
                g *= limit / n


def run(case: str, mode: str, workers: int, slow: float, correction: str, seed: int, root: str,
        predict: bool = False, sync_scaling: str = "linear", noise: float = 0.3):
    """One emulated run: (samples, accuracy) at each evaluation, and the mean staleness."""
    c = CASES[case]
    x, y, tx, ty = load(os.path.join(root, c["data"]), c.get("test_rows"))
    kw = {"model_args": c["model_args"]} if "model_args" in c else {}
    if "hidden" in c:
        kw["hidden"] = c["hidden"]
    model = build_model(c["model"], x.shape[1:], 10, **kw, seed=0)
    params = np.asarray(model.init_params(0), np.float32).copy()
    opt = build_optimizer("momentum", params.size, lr=LR, momentum=MU0)
    rule = Rule(correction) if "=" in correction else None
    nominal = c["batch"] * (workers if mode == "sync" and sync_scaling == "none" else 1)
    ring = ParamRing(params, opt, build_correction("none" if rule else correction), nominal)
    meter, rng = StalenessMeter(), np.random.default_rng(seed)
    if rule is not None and "prior" in rule.opts:
        meter.mean, meter.count = float(rule.opts["prior"]), 10
    order = np.concatenate([rng.permutation(len(x)) for _ in range(c["epochs"] + 1)])
    state = {"pos": 0, "done": 0, "next": c["every"]}
    evals, stale = [], []

    def batch():
        idx = order[state["pos"]:state["pos"] + c["batch"]]
        state["pos"] += c["batch"]
        return idx

    def counted(n) -> bool:
        """Count n applied samples, evaluating where due; True once the target stops the run."""
        state["done"] += n
        while state["done"] >= state["next"]:
            state["next"] += c["every"]
            evals.append((state["done"], model.evaluate(ring.params, tx, ty)["accuracy"]))
            if c.get("stop") and evals[-1][1] >= c["target"]:
                return True
        return False

    def sync_round() -> int:
        """W gradients on the same parameters, applied as one mean; the samples it took."""
        g, b = np.zeros_like(params), 0
        for _ in range(workers):
            idx = batch()
            g += model.loss_and_grad(ring.params, x[idx], y[idx])[1]
            b += len(idx)
        ring.apply_sum(g, b)
        return b

    total = c["epochs"] * len(x)
    if mode == "sync":
        while state["done"] < total:
            if counted(sync_round()):
                return evals, 0.0
    else:
        speed = [1.0] * workers
        if slow:
            speed[-1] = 1.0 / slow
        heap, reading, pending = [], {}, []
        predictions = [WeightPrediction(params.size) if predict else None for _ in range(workers)]

        def start(w, t):
            p = ring.params.copy()
            if predictions[w] is not None:
                p = predictions[w].params(p, ring.version)   # (a worker's own buffer)
            reading[w] = (p, ring.version, batch())
            heapq.heappush(heap, (t + rng.lognormal(0, noise) / speed[w], w))

        for _ in range(int(rule.opts.get("syncwarm", 0)) if rule is not None else 0):
            if counted(sync_round()):
                return evals, 0.0
        for w in range(workers):
            start(w, rng.uniform(0, 1) / speed[w])
        while state["done"] < total:
            t, w = heapq.heappop(heap)
            p, version, idx = reading[w]
            g = np.asarray(model.loss_and_grad(p, x[idx], y[idx])[1], np.float32) / len(idx)
            s = ring.version - version
            stale.append(s)
            if predictions[w] is not None:
                predictions[w].observe(s)
            if rule is not None:
                tau = meter.add(s)
                rule.adapt(g, opt.velocity, tau)
                opt.momentum = rule.momentum(tau, s)
                rule.scale(g, tau, s)
            if rule is not None and "accum" in rule.opts:
                pending.append((g, len(idx)))
                if len(pending) >= int(rule.opts["accum"]):
                    ring.apply_sum(sum(gi * n for gi, n in pending), sum(n for _, n in pending))
                    pending.clear()
            else:   # dc and gap read the parameters the gradient was computed on
                ring.apply(g, len(idx), s, p if ring.correction.needs_old_params else None,
                           worker=w)   # (dana: the worker's own velocity)
            if not np.all(np.isfinite(ring.params)):
                evals.append((state["done"], 0.0))
                break
            start(w, t)
            if counted(len(idx)):
                return evals, float(np.mean(stale))
    evals.append((state["done"], model.evaluate(ring.params, tx, ty)["accuracy"]))
    if rule is not None and rule.gains:
        gs = rule.gains
        at = [gs[min(k, len(gs) - 1)] for k in (49, 199, -1)]
        print(f"  seed {seed}: gain at 50/200/end {at[0]:.2f}/{at[1]:.2f}/{at[2]:.2f}", file=sys.stderr)
    return evals, float(np.mean(stale)) if stale else 0.0


def first(evals, target):
    return next((n for n, a in evals if a >= target), None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("mode", choices=("sync", "async"))
    ap.add_argument("workers", type=int)
    ap.add_argument("--slow", type=float, default=0.0)
    ap.add_argument("--correction", default="dynamic")
    ap.add_argument("--weight-prediction", choices=("on", "off"), default="off")
    ap.add_argument("--sync-scaling", choices=("linear", "none"), default="linear")
    ap.add_argument("--noise", type=float, default=0.3,
                    help="sigma of the lognormal compute times (the arrival order's noise)")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "mpilb-staleness"),
                    help="where benchmarks/staleness.py made its datasets (made here if missing)")
    o = ap.parse_args(argv)
    import staleness
    import _runs

    os.makedirs(o.dir, exist_ok=True)
    staleness.recipe_dataset(o.dir) if o.case == "recipe" else _runs.digits_dataset(o.dir)
    try:
        import torch

        torch.set_num_threads(1)   # one process: threads only contend on a shared machine
    except ImportError:
        pass
    target = CASES[o.case]["target"]
    predict = o.weight_prediction == "on"
    rows = [run(o.case, o.mode, o.workers, o.slow, o.correction, seed, o.dir, predict,
                o.sync_scaling, o.noise) for seed in range(o.seeds)]
    print(f"{o.case} {o.mode} {o.workers} workers{f', one {o.slow:g}x straggler' if o.slow else ''}"
          f" --correction {o.correction} --weight-prediction {o.weight_prediction}: samples to {target} {[first(e, target) for e, _ in rows]}, "
          f"final {[round(e[-1][1], 4) for e, _ in rows]}, best "
          f"{[round(max(a for _, a in e), 4) for e, _ in rows]}, mean staleness "
          f"{[round(t, 2) for _, t in rows]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
