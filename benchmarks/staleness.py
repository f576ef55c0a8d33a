"""Async that converges like sync: a DDP recipe (SGD momentum 0.9, its lr, its batch)
unchanged under async's staleness policy, against sync; and how staleness grows.

    python benchmarks/staleness.py [--repeats 3] [--only recipe,digits,table]

Each group writes its own result file, benchmarks/results/staleness_GROUP.json.

Groups:
- recipe: a torch MLP 256-256-256-10 (examples/torch_mlp.py, hidden=256, layers=3) on
  `mpilb prepare synthetic --samples 60000 --features 256 --classes 10 --shards 24 --seed 7`,
  `--optimizer momentum --lr 0.05 --batch 128`, up to 6 epochs, stopping at test accuracy
  0.808: samples to 0.808 as a multiple of sync's (median of sync's runs), on 4 and 8 workers
  (8 = 9 ranks, oversubscribed here), with and without one 4x straggler (`--inject
  3:compute=4`); time to target with the straggler against sync's; the first behaviour
  (`--correction none`, 4 workers) and the previous policy (`--correction momentum`, 8
  workers) alongside.
- digits: the mlp, the cnn and examples/torch_cnn.py:Net on `mpilb prepare digits`, 4
  workers, the same recipe (momentum 0.9, lr 0.05, batch 32), 10 epochs: final accuracy
  against sync's, samples to 0.9 as a multiple of sync's; each also under the previous
  policy (`--correction momentum`), which trades with dynamic on these models
  (docs/benchmarks/staleness.md). Repeat i of every case runs with --seed i: the runs
  compared share their orders of the data, and the figures span several.
The default policy with a momentum recipe is `dana` (a momentum per worker on the stores,
stepped Nesterov's way, with the workers' weight prediction); each case also runs the
default before it beside it (`lookahead` for the recipe's MLP, `gap` for the digits models),
and `--weight-prediction off` (dynamic alone, the default before weight prediction,
core/prediction.py); digits also `--correction lookahead` and `--correction dynamic`. With
the straggler, rank 0's CPU per update.
- box (asked for by name, as root: the cluster in a box, mpilb.clusterbox): the recipe on 4
  workers on two nodes, rank 0 on a third, 1 Gbit/s links, up to 12 epochs: sync, the
  default and `lookahead` in turn; samples and time to 0.808 against sync's.
- table: mean staleness of the applied gradients against workers (2, 4, 6: 7 ranks,
  oversubscribed) and --pipeline 0/1 (digits mlp, 2 epochs).

Samples to an accuracy count the gradients applied up to the version each evaluation read,
so they do not depend on the machine's speed; staleness does depend on the scheduling
(which rank's push arrives first), and times are wall clock on whatever machine this runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this tree's mpilb
import _results  # noqa: E402
import _runs  # noqa: E402

NAME = "staleness"
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = ["--model", os.path.join(HERE, "examples/torch_mlp.py:MLP"), "--model-arg", "hidden=256",
       "--model-arg", "layers=3"]
RECIPE = ["--optimizer", "momentum", "--lr", "0.05"]
TARGET = 0.808
STRAGGLER = ["--inject", "3:compute=4"]
DIGITS_MODELS = {"mlp": ["--model", "mlp", "--hidden", "64"], "cnn": ["--model", "cnn"],
                 "torch cnn": ["--model", os.path.join(HERE, "examples/torch_cnn.py:Net")]}
DIGITS_TARGET = 0.9
NO_PREDICTION = ["--weight-prediction", "off"]
DYNAMIC = ["--correction", "dynamic"]
GAP = ["--correction", "gap"]
LOOKAHEAD = ["--correction", "lookahead"]


def train(data: str, log: str, ranks: int, args: list[str], timeout: float, box=None,
          hosts: str = "") -> dict:
    """One run; returns its summary with the report's efficiency entry. With `box` (a
    ClusterBox), on its nodes as mpiexec's -hosts `hosts` says (`ranks` unused)."""
    from mpilb.runfiles.efficiency import efficiency
    from mpilb.runfiles.summary import open_log, run_config, summarize

    cmd = [sys.executable, "-m", "mpilb", "train", "--data", data, "--no-progress", *args,
           "--log", log, "--overwrite"]
    if box is None:
        cmd = [_runs.mpiexec(), "-n", str(ranks), *cmd]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    else:
        cmd = ["-hosts", hosts, *cmd]
        res = box.mpiexec(cmd, timeout=timeout, cwd=HERE)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    attrs, cols = open_log(log)
    s = summarize(attrs, cols)
    s["efficiency"] = efficiency(run_config(attrs), cols["updates"], cols["eval"])
    s["eval_accuracy"] = [float(a) for a in cols["eval"]["test_accuracy"]]
    return s


def recipe_dataset(root: str) -> str:
    """The issue's synthetic dataset under `root`, made once and reused."""
    data = os.path.join(root, "synthetic-60000x256")
    if not os.path.exists(os.path.join(data, "manifest.json")):
        subprocess.run([sys.executable, "-m", "mpilb", "prepare", "synthetic", data, "--samples",
                        "60000", "--features", "256", "--classes", "10", "--shards", "24",
                        "--seed", "7"], check=True, capture_output=True, text=True)
    return data


class Bench:
    def __init__(self, opts):
        self.opts = opts
        self.log = os.path.join(opts.dir, "run.h5")

    def runs(self, data, ranks, args, repeats=None, seeded=False):
        """`seeded`: repeat i runs with --seed i (another order of the data each time; the
        cases compared share the seeds), else every repeat with the default seed."""
        out = []
        for i in range(repeats or self.opts.repeats):
            run = args + (["--seed", str(i)] if seeded else [])
            s = train(data, self.log, ranks, run, self.opts.run_timeout)
            out.append(s)
            print(f"    {' '.join(run[-8:]):<60} best {s['best_test_accuracy']:.4f} "
                  f"staleness {s['staleness']['mean']:.1f} "
                  f"samples to target {s['efficiency']['samples_to_target']} "
                  f"t {s['time_to_target_s']}", flush=True)
        return out


def _samples(runs):
    return [r["efficiency"]["samples_to_target"] for r in runs]


def _cpu_ms(s: dict) -> float:
    """Rank 0's CPU time per update applied, in ms (its receives, steps and replies)."""
    return 1e3 * s["server_cpu_s"] / max(1, s["updates"])


def _ratio(values, ref):
    """Each of `values` over the median of `ref`, where a reference run that never got there
    counts as infinitely many (a sync run that diverged: seed 9 of the built-in cnn once
    ended at 0.632); None for all when half of them or more never did. A value of None (an
    async run that never got there) stays None, and its figure has no median: a miss."""
    inf = float("inf")
    m = statistics.median([inf if v is None else v for v in ref]) if ref else inf
    if m == inf:
        return [None for _ in values]
    return [None if v is None else v / m for v in values]


def recipe(b: Bench, res) -> None:
    data = recipe_dataset(b.opts.dir)
    # evaluations every 0.1 s: on a fast machine an epoch takes ~0.6 s, so at 1 s the samples
    # to the target were known to an epoch (48,000 samples, a third of sync's count)
    stop = ["--epochs", "6", "--target-accuracy", str(TARGET), "--eval-interval", "0.1", "--batch", "128"]
    for workers in (4, 8):
        for slow in (False, True):
            where = f"{workers} workers" + (", one 4x straggler" if slow else "")
            g = res.group(f"torch MLP 256-256-256-10, synthetic 60000x256, {where}: samples to "
                          f"accuracy {TARGET} / sync's", f"mpiexec -n {workers + 1} mpilb train "
                          f"--data synth --model examples/torch_mlp.py:MLP --model-arg hidden=256 "
                          f"--model-arg layers=3 --optimizer momentum --lr 0.05 --batch 128 "
                          f"--epochs 6 --target-accuracy {TARGET}" + (" --inject 3:compute=4" if slow else ""))
            extra = STRAGGLER if slow else []
            sync = b.runs(data, workers + 1, MLP + RECIPE + stop + extra + ["--mode", "sync"])
            new = b.runs(data, workers + 1, MLP + RECIPE + stop + extra)
            la = b.runs(data, workers + 1, MLP + RECIPE + stop + extra + LOOKAHEAD)
            unpredicted = b.runs(data, workers + 1, MLP + RECIPE + stop + extra + NO_PREDICTION)
            res.figure(g, f"sync-{workers}{'s' if slow else ''}", "--mode sync: samples to target",
                       _samples(sync), digits=0, command=g["command"] + " --mode sync")
            res.figure(g, f"async-{workers}{'s' if slow else ''}",
                       "async, the defaults (dana, weight prediction): samples to target / sync's",
                       _ratio(_samples(new), _samples(sync)), target="<= 1.3")
            res.figure(g, f"stale-{workers}{'s' if slow else ''}", "async: mean staleness",
                       [r["staleness"]["mean"] for r in new])
            res.figure(g, f"la-{workers}{'s' if slow else ''}", "async --correction lookahead (the "
                       "default before dana): samples to target / sync's",
                       _ratio(_samples(la), _samples(sync)))
            res.figure(g, f"nopred-{workers}{'s' if slow else ''}", "async --weight-prediction off "
                       "(dynamic alone, the default before it): samples to target / sync's",
                       _ratio(_samples(unpredicted), _samples(sync)))
            if slow:
                t_sync = [r["time_to_target_s"] for r in sync]
                res.figure(g, f"time-{workers}s", "async: time to target / sync's "
                           "(wall clock, on this machine)",
                           _ratio([r["time_to_target_s"] for r in new], t_sync), target="<= 0.5")
                res.figure(g, f"la-time-{workers}s", "async --correction lookahead: time to "
                           "target / sync's", _ratio([r["time_to_target_s"] for r in la], t_sync))
                res.figure(g, f"nopred-time-{workers}s", "async --weight-prediction off: time to "
                           "target / sync's", _ratio([r["time_to_target_s"] for r in unpredicted], t_sync))
                res.figure(g, f"cpu-{workers}s", "async: rank 0's CPU per update (ms)",
                           [_cpu_ms(r) for r in new])
                res.figure(g, f"la-cpu-{workers}s", "async --correction lookahead: rank 0's CPU "
                           "per update (ms)", [_cpu_ms(r) for r in la])
            if workers == 4 and not slow:
                old = b.runs(data, workers + 1, MLP + RECIPE + stop + ["--correction", "none"])
                res.figure(g, "old-4", "async --correction none (the old default): samples to "
                           "target / sync's", _ratio(_samples(old), _samples(sync)))
                res.figure(g, "old-4-best", "async --correction none: best accuracy",
                           [r["best_test_accuracy"] for r in old], digits=4)
            if workers == 8 and not slow:
                prev = b.runs(data, workers + 1, MLP + RECIPE + stop + ["--correction", "momentum"])
                res.figure(g, "prev-8", "async --correction momentum (the default before dynamic): "
                           "samples to target / sync's", _ratio(_samples(prev), _samples(sync)))


def digits(b: Bench, res) -> None:
    data = _runs.digits_dataset(b.opts.dir)
    # an evaluation after every 128 samples (a sync round of 4 x 32): 10 epochs of digits
    # take well under a second, and evaluations by time (every 5 ms) came where rank 0 had
    # time for them, mostly at the epochs' ends: samples to 0.9 known to 400-1,400 samples
    common = RECIPE + ["--epochs", "10", "--eval-every", "128", "--eval-interval", "1000"]
    for name, model in DIGITS_MODELS.items():
        g = res.group(f"digits, {name}, 4 workers, momentum 0.9, lr 0.05, batch 32, 10 epochs",
                      f"mpiexec -n 5 mpilb train --data digits {' '.join(model)} "
                      f"--optimizer momentum --lr 0.05 --epochs 10 --eval-every 128 --seed I")
        sync = b.runs(data, 5, model + common + ["--mode", "sync"], seeded=True)
        new = b.runs(data, 5, model + common, seeded=True)
        first = [_first(r, DIGITS_TARGET) for r in sync]
        res.figure(g, f"{name}-sync", "--mode sync: final accuracy",
                   [r["final_test_accuracy"] for r in sync], digits=4)
        res.figure(g, f"{name}-sync-samples", f"--mode sync: samples to {DIGITS_TARGET} (none: "
                   "a run that never got there)", first, digits=0)
        res.figure(g, f"{name}-async", "async, the defaults (dana, weight prediction): final "
                   "accuracy",
                   [r["final_test_accuracy"] for r in new], digits=4)
        sync_med = statistics.median(r["final_test_accuracy"] for r in sync)
        res.figure(g, f"{name}-gap", "async final accuracy - sync's median (points)",
                   [100 * (r["final_test_accuracy"] - sync_med) for r in new], target=">= -0.5")
        res.figure(g, f"{name}-samples", f"async: samples to {DIGITS_TARGET} / sync's",
                   _ratio([_first(r, DIGITS_TARGET) for r in new], first), target="<= 1.3")
        beside = (("gap", GAP, "async --correction gap (the default before dana for a model "
                   "this small)", "async --correction gap"),
                  ("lookahead", LOOKAHEAD, "async --correction lookahead", "async --correction lookahead"),
                  ("dynamic", DYNAMIC, "async --correction dynamic (the previous default)",
                   "async --correction dynamic"),
                  ("nopred", NO_PREDICTION, "async --weight-prediction off (dynamic alone)",
                   "async --weight-prediction off"),
                  ("prev", ["--correction", "momentum"],
                   "async --correction momentum (the default before dynamic)",
                   "async --correction momentum"))
        for key, extra, label, short in beside:
            runs = b.runs(data, 5, model + common + extra, seeded=True)
            res.figure(g, f"{name}-{key}-gap", f"{label}: final accuracy - sync's median (points)",
                       [100 * (r["final_test_accuracy"] - sync_med) for r in runs])
            res.figure(g, f"{name}-{key}-samples", f"{short}: samples to {DIGITS_TARGET} / sync's",
                       _ratio([_first(r, DIGITS_TARGET) for r in runs], first))


def _first(s: dict, target: float):
    acc, samples = s["eval_accuracy"], s["efficiency"]["samples_at_eval"]
    for a, n in zip(acc, samples):
        if a >= target:
            return n
    return None


def table(b: Bench, res) -> None:
    data = _runs.digits_dataset(b.opts.dir)
    g = res.group("mean staleness of applied gradients, digits mlp, 2 epochs",
                  "mpiexec -n W+1 mpilb train --data digits --model mlp --epochs 2 --pipeline P")
    for workers in (2, 4, 6):
        for pipeline in (0, 1):
            runs = b.runs(data, workers + 1, ["--model", "mlp", "--epochs", "2", "--pipeline",
                                              str(pipeline)])
            res.figure(g, f"w{workers}p{pipeline}", f"{workers} workers, --pipeline {pipeline}"
                       + (" (oversubscribed)" if workers + 1 > (os.cpu_count() or 1) else ""),
                       [r["staleness"]["mean"] for r in runs])


def box(b: Bench, res) -> None:
    """The recipe where the issue saw async stall: on the cluster in a box (root only)."""
    from mpilb.clusterbox import ClusterBox, missing

    why = missing()
    if why:
        sys.exit(f"no cluster box here: {why}")
    data = recipe_dataset(b.opts.dir)
    hosts = "n0:1,n1:2,n2:2"
    stop = ["--epochs", "12", "--target-accuracy", str(TARGET), "--eval-interval", "0.25",
            "--batch", "128"]
    g = res.group(f"torch MLP 256-256-256-10, synthetic 60000x256, 4 workers on 2 nodes of the "
                  f"cluster in a box (rank 0 on a third; 1 Gbit/s links): samples and time to "
                  f"{TARGET}", f"mpiexec -hosts {hosts} mpilb train --data synth --model "
                  f"examples/torch_mlp.py:MLP --model-arg hidden=256 --model-arg layers=3 "
                  f"--optimizer momentum --lr 0.05 --batch 128 --epochs 12 --target-accuracy "
                  f"{TARGET}", note="sync, the default (dana) and lookahead in turn, each repeat")
    runs = {"sync": [], "dana": [], "lookahead": []}
    with ClusterBox(nodes=3, link_rate="1gbit") as cb:
        res.box(cb)
        for _ in range(b.opts.repeats):
            for key, extra in (("sync", ["--mode", "sync"]), ("dana", []), ("lookahead", LOOKAHEAD)):
                s = train(data, b.log, 0, MLP + RECIPE + stop + extra, b.opts.run_timeout, box=cb,
                          hosts=hosts)
                runs[key].append(s)
                print(f"    {key:<10} samples to target {s['efficiency']['samples_to_target']} "
                      f"t {s['time_to_target_s']}", flush=True)
    sync = runs["sync"]
    t_sync = [r["time_to_target_s"] for r in sync]
    res.figure(g, "box-sync", "--mode sync: samples to target", _samples(sync), digits=0,
               command=g["command"] + " --mode sync")
    res.figure(g, "box-sync-time", "--mode sync: time to target (s)", t_sync)
    for key, label, target in (("dana", "async, the defaults (dana, weight prediction)", "<= 1.3"),
                               ("lookahead", "async --correction lookahead", None)):
        rs = runs[key]
        res.figure(g, f"box-{key}", f"{label}: samples to target / sync's",
                   _ratio(_samples(rs), _samples(sync)), target=target)
        res.figure(g, f"box-{key}-time", f"{label}: time to target / sync's",
                   _ratio([r["time_to_target_s"] for r in rs], t_sync))
        res.figure(g, f"box-{key}-rate", f"{label}: samples/s", [r["samples_per_s"] for r in rs],
                   digits=0)
    res.figure(g, "box-sync-rate", "--mode sync: samples/s", [r["samples_per_s"] for r in sync],
               digits=0)


GROUPS = {"recipe": recipe, "digits": digits, "table": table, "box": box}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="recipe,digits,table",
                    help="groups: recipe, digits, table, and box (the cluster in a box: root only)")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "mpilb-staleness"))
    ap.add_argument("--run-timeout", type=float, default=900.0)
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.repeats = 1
    os.makedirs(opts.dir, exist_ok=True)
    b = Bench(opts)
    met = True
    for group in opts.only.split(","):
        name = f"{NAME}_{group}"
        print(group, flush=True)
        res = _results.Results(name, "Async with the DDP recipe: samples and time to target", opts)
        GROUPS[group](b, res)
        _runs.print_targets(res.checks())
        res.write(_results.out_path(opts, name))
        met = met and res.all_met()
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
