"""The load balancer's "Must show" scenarios (issue 4), measured in one run.

    python benchmarks/balancing.py [--dir DIR] [--repeats 3] [--epochs 4] [--quick] [--out FILE]

Writes every figure, per repeat, to benchmarks/results/balancing.json (``--out``), from which
``python benchmarks/gendocs.py`` renders the tables of docs/balancing.md.

One server and three workers (``mpiexec -n 4``) train ``mlp --hidden 256,256 --batch 128``
on a synthetic dataset (96000 x 256, 10 classes, 48 shards by default; made once and cached
in ``--dir``). Rank 3 is slowed with ``--inject 3:compute=4`` (each of its steps takes four
times as long). Every figure is measured in this run and set against a baseline measured
in the same run:

  (a) async, slowdown from the start: mean epoch time of static, round-robin, demand, load
      and predictive; ratio to static; utilization; and each run against its own ideal,
      ideal epoch = N / sum of the workers' measured rates (samples per second not idle,
      in that run), so that CPU the slow rank gains when the others idle is counted in
      its favour.
  (b) async, the slowdown starts mid-run (``3:compute=4@T``, T about a third in): the
      logged ``workers/`` rates of rank 3 around T, rank 3's share of each epoch, and when
      epoch utilization was back to within 10% of its level before T (the first epoch that
      starts after T and gets there); the issue asks for at most two rebalance intervals
      after T. Static is run too, as the case that does not recover.
  (c) sync rounds, slowdown from the start: ``--batch-policy proportional`` against
      ``fixed`` (both with the default balancer, load, as the issue's command lines have
      it), and against plain BSP (fixed batches, static split): samples/s ratio and final
      accuracy. These runs use ``--rebalance-interval 0.5`` (``--sync-rebalance-interval``),
      all three alike: the server revises batch sizes when it rebalances, so with the
      default 2 s a slowdown would be answered late in these ~3 s runs.
  (d) time to ``--target-accuracy``: async + load against sync + static, evaluated every
      0.25 s (``--eval-interval``): the run stops at the first evaluation at or above the
      target, so the interval is the resolution of the measurement; at 0.5 s (in practice
      ~0.55 s between evaluations) it is a quarter of the ~2 s async run.
  (e) coverage (duplicates 0, missing 0, applied = expected) in every run.

Runs of one repeat go back to back and ratios are taken within a repeat, then the median
over repeats is shown, so that drifting machine noise hits both sides of a ratio alike.
On a machine with fewer cores than ranks the runs share CPUs; the "ideal" column is the
fair yardstick there. Exit status: 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _runs  # noqa: E402  (the shared run plumbing beside this script)

NAME = "balancing"

WORKERS = _runs.WORKERS
SLOW_RANK = 3
SLOWDOWN = "3:compute=4"
MODEL = ["--model", "mlp", "--hidden", "256,256", "--batch", "128"]
POLICIES = ["static", "round-robin", "demand", "load", "predictive"]


class Run(_runs.Run):
    def rates(self) -> dict[int, float]:
        """Each worker's measured rate: samples per second it was not idle.

        Not idle = the run's training time minus the worker's idle seconds (waiting with
        no shard, at epoch ends). This counts every second the worker spent on its samples,
        its communication included, whether or not the worker's timers saw it.
        """
        out = {}
        train_s = self.summary["train_s"]
        for w in self.summary["per_worker"]:
            active = train_s - w["idle_s"]
            out[w["rank"]] = w["samples"] / active if active > 0 else 0.0
        return out

    def ideal_epoch(self, samples_per_epoch: int) -> float:
        return samples_per_epoch / sum(self.rates().values())


class Bench(_runs.Bench):
    run_class = Run

    def __init__(self, opts):
        super().__init__(opts, MODEL)

    # ---------------------------------------------------------------- (a)
    def scenario_a(self) -> dict:
        policies = self.opts.policies.split(",")
        print(f"(a) async, {SLOWDOWN}: {', '.join(policies)}; {self.opts.epochs} epochs x "
              f"{self.opts.repeats} repeats")
        runs: dict[str, list[Run]] = {p: [] for p in policies}
        for r in range(self.opts.repeats):
            for p in policies:
                runs[p].append(self.train(f"a-{p}-r{r}", "--epochs", self.opts.epochs,
                                          "--inject", SLOWDOWN, "--balancer", p))
        self.a_runs = runs
        n = self.samples_per_epoch
        rows = {}
        for p in policies:
            rs = runs[p]
            rows[p] = {
                "mean_epoch_s": statistics.median(x.mean_epoch() for x in rs),
                "ratio_to_static": statistics.median(
                    x.mean_epoch() / s.mean_epoch() for x, s in zip(rs, runs["static"])),
                "utilization": statistics.median(x.mean_util() for x in rs),
                "ideal_epoch_s": statistics.median(x.ideal_epoch(n) for x in rs),
                "ideal_over_measured": statistics.median(x.ideal_epoch(n) / x.mean_epoch() for x in rs),
                "slow_share": statistics.median(x.share(SLOW_RANK) for x in rs),
                "moves": statistics.median(x.summary["shard_moves"] for x in rs),
                "command": rs[0].command,
            }
        return rows

    # ---------------------------------------------------------------- (b)
    def scenario_b(self, a_rows: dict) -> dict:
        epochs = self.opts.mid_epochs
        start = self.opts.mid_start
        if start is None:
            # A third into the run. Before T the three workers are equally fast, but on a
            # node with fewer cores than ranks they share the CPU, so an epoch then takes
            # about as long as a balanced epoch with the slowdown, measured in (a).
            start = round(epochs / 3 * a_rows["load"]["mean_epoch_s"], 1)
        interval = self.opts.rebalance_interval
        print(f"(b) async, {SLOWDOWN}@{start:g} (mid-run), {epochs} epochs: static, load, predictive")
        out = {"start_s": start, "rebalance_interval_s": interval, "policies": {}}
        self.b_found = {}
        for p in ("static", "load", "predictive"):
            found = self.b_found[p] = []
            for r in range(self.opts.mid_repeats):
                run = self.train(f"b-{p}-r{r}", "--epochs", epochs, "--inject", f"{SLOWDOWN}@{start:g}",
                                 "--balancer", p, "--rebalance-interval", interval)
                found.append(self._recovery(run, start, a_rows[p]["utilization"]))
            keep = found[len(found) // 2] if len(found) > 1 else found[0]
            keep = dict(keep)
            for key in ("detect_s", "recover_s"):
                vals = [f[key] for f in found]
                keep[key] = (None if any(v is None for v in vals) else statistics.median(vals))
            keep["command"] = self.runs[-1].command
            out["policies"][p] = keep
        return out

    def _recovery(self, run: Run, start: float, steady_util: float) -> dict:
        """When the slowdown showed in the logged rate, and when utilization was back."""
        wk, ep, up = run.cols["workers"], run.cols["epochs"], run.cols["updates"]
        mine = wk["worker"] == SLOW_RANK
        t_rows, rate_rows = wk["t"][mine], wk["rate"][mine]
        pred_rows = wk["predicted_rate"][mine]
        before = rate_rows[t_rows < start]
        # Reference: the other workers' rates at the same rows (same CPU contention).
        others = wk["rate"][~mine]
        ref = float(np.median(before)) if before.size else float(np.median(others))
        detect = None
        for t, rate in zip(t_rows, rate_rows):
            if t >= start and rate < 0.5 * ref:
                detect = float(t - start)
                break
        # Per epoch: utilization and the slow rank's share of the epoch's samples.
        shares, utils = [], []
        for e, t0, t1, util in zip(ep["epoch"], ep["t_start"], ep["t_end"], ep["utilization"]):
            m = up["epoch"] == e
            total = up["batch"][m].sum()
            shares.append(float(up["batch"][m & (up["worker"] == SLOW_RANK)].sum() / max(1, total)))
            utils.append(float(util))
        pre = [u for u, t1 in zip(utils, ep["t_end"]) if t1 <= start]
        level = float(np.median(pre)) if pre else steady_util
        recover = None
        for t0, t1, util in zip(ep["t_start"], ep["t_end"], utils):
            if t0 >= start and util >= 0.9 * level:
                recover = float(t1 - start)
                break
        after = [u for u, t0 in zip(utils, ep["t_start"]) if t0 >= start]
        return {
            "rate_before": ref,
            "rows": [(round(float(t), 2), round(float(r)), round(float(p)))
                     for t, r, p in zip(t_rows, rate_rows, pred_rows)],
            "detect_s": detect,
            "recover_s": recover,
            "util_before": float(np.median(pre)) if pre else None,
            "util_after": float(np.median(after)) if after else None,
            "steady_util_a": steady_util,
            "epoch_table": [(int(e), round(float(t0), 2), round(float(t1), 2), round(u, 2), round(s, 3))
                            for e, t0, t1, u, s in zip(ep["epoch"], ep["t_start"], ep["t_end"],
                                                       utils, shares)],
        }

    # ---------------------------------------------------------------- (c)
    def scenario_c(self) -> dict:
        epochs = self.opts.sync_epochs
        variants = {
            "proportional (load)": ["--batch-policy", "proportional", "--balancer", "load"],
            "fixed (load)": ["--batch-policy", "fixed", "--balancer", "load"],
            "fixed (static, BSP)": ["--batch-policy", "fixed", "--balancer", "static"],
        }
        print(f"(c) sync, {SLOWDOWN}, {epochs} epochs: " + ", ".join(variants))
        runs: dict[str, list[Run]] = {v: [] for v in variants}
        for r in range(self.opts.repeats):
            for v, extra in variants.items():
                tag = v.split()[0] + "-" + extra[-1]
                runs[v].append(self.train(f"c-{tag}-r{r}", "--mode", "sync", "--epochs", epochs,
                                          "--inject", SLOWDOWN, "--rebalance-interval",
                                          self.opts.sync_rebalance_interval, *extra))
        self.c_runs = runs
        prop = runs["proportional (load)"]
        rows = {}
        for v, rs in runs.items():
            rows[v] = {
                "samples_per_s": statistics.median(x.summary["samples_per_s"] for x in rs),
                "proportional_over_this": statistics.median(
                    p.summary["samples_per_s"] / x.summary["samples_per_s"] for p, x in zip(prop, rs)),
                "final_accuracy": statistics.median(x.summary["final_test_accuracy"] for x in rs),
                "accuracy_gap_points": statistics.median(
                    100 * (p.summary["final_test_accuracy"] - x.summary["final_test_accuracy"])
                    for p, x in zip(prop, rs)),
                "utilization": statistics.median(x.mean_util() for x in rs),
                "mean_batch": [round(statistics.median(
                    w["mean_batch"] for x in rs for w in x.summary["per_worker"] if w["rank"] == k), 1)
                    for k in range(1, WORKERS + 1)],
                "command": rs[0].command,
            }
        return rows

    # ---------------------------------------------------------------- (d)
    def scenario_d(self) -> dict:
        target = self.opts.target
        variants = {
            "async + load": ["--mode", "async", "--balancer", "load"],
            "sync + static": ["--mode", "sync", "--balancer", "static"],
        }
        print(f"(d) time to --target-accuracy {target}, {SLOWDOWN}: " + ", ".join(variants))
        runs: dict[str, list[Run]] = {v: [] for v in variants}
        for r in range(self.opts.repeats):
            for v, extra in variants.items():
                runs[v].append(self.train(f"d-{extra[1]}-{extra[3]}-r{r}", *extra,
                                          "--epochs", self.opts.target_epochs,
                                          "--target-accuracy", target,
                                          "--eval-interval", self.opts.eval_interval,
                                          "--inject", SLOWDOWN))
        self.d_runs = runs
        base = runs["sync + static"]
        rows = {}
        for v, rs in runs.items():
            times = [x.summary["time_to_target_s"] for x in rs]
            reached = all(t is not None for t in times)
            rows[v] = {
                "time_to_target_s": statistics.median(times) if reached else None,
                "ratio_to_sync_static": (statistics.median(
                    x.summary["time_to_target_s"] / b.summary["time_to_target_s"]
                    for x, b in zip(rs, base)) if reached and all(
                        b.summary["time_to_target_s"] for b in base) else None),
                "samples_to_target": statistics.median(x.summary["samples"] for x in rs),
                "command": rs[0].command,
            }
        return rows


def record(res, bench: Bench, b: dict) -> None:
    """Every figure of the tables, per repeat, with the targets (the issue's "Must show")."""
    o, n = bench.opts, bench.samples_per_epoch
    a_runs, static = bench.a_runs, bench.a_runs["static"]
    g = res.group(f"(a) async, `--inject {SLOWDOWN}` from the start, {o.epochs} epochs of {n:,} "
                  f"samples", a_runs["static"][0].command.replace("static", "POLICY"))
    targets = {"load": "<= 0.65", "predictive": "<= 0.70", "demand": "<= 0.90"}
    for p, rs in a_runs.items():
        if p != "static":
            res.figure(g, f"a.{p}.x_static", f"{p}: mean epoch time ÷ static",
                       [x.mean_epoch() / s.mean_epoch() for x, s in zip(rs, static)], unit="x",
                       target=targets.get(p))
    res.figure(g, "a.load.utilization", "load: utilization", [x.mean_util() for x in a_runs["load"]],
               target=">= 0.75")
    res.figure(g, "a.static.utilization", "static: utilization",
               [x.mean_util() for x in static])
    for p, rs in a_runs.items():
        res.figure(g, f"a.{p}.epoch_s", f"{p}: mean epoch s", [x.mean_epoch() for x in rs],
                   unit="s", digits=3)
    for p, rs in a_runs.items():
        res.figure(g, f"a.{p}.ideal", f"{p}: ideal epoch ÷ measured (1 = no loss to imbalance)",
                   [x.ideal_epoch(n) / x.mean_epoch() for x in rs])
    for p, rs in a_runs.items():
        res.figure(g, f"a.{p}.slow_share", f"{p}: rank 3's share of the samples",
                   [x.share(SLOW_RANK) for x in rs], digits=3)
    interval = b["rebalance_interval_s"]
    g = res.group(f"(b) async, `--inject {SLOWDOWN}@{b['start_s']:g}` (mid-run), {o.mid_epochs} "
                  f"epochs, `--rebalance-interval {interval:g}`",
                  b["policies"]["load"]["command"].replace("--balancer load", "--balancer POLICY"))
    for p, found in bench.b_found.items():
        res.figure(g, f"b.{p}.recover_s", f"{p}: utilization back, seconds after T",
                   [f["recover_s"] for f in found], unit="s",
                   target=None if p == "static" else f"<= {2 * interval:g}")
    for p, found in bench.b_found.items():
        res.figure(g, f"b.{p}.detect_s", f"{p}: rank 3 logged slow, seconds after T",
                   [f["detect_s"] for f in found], unit="s")
    c_runs = bench.c_runs
    prop = c_runs["proportional (load)"]
    g = res.group(f"(c) sync rounds, `--inject {SLOWDOWN}`, {o.sync_epochs} epochs, "
                  f"`--rebalance-interval {o.sync_rebalance_interval:g}`",
                  prop[0].command.replace("proportional", "POLICY").replace(
                      "--balancer load", "--balancer BALANCER"))
    short = {"proportional (load)": "proportional", "fixed (load)": "fixed_load",
             "fixed (static, BSP)": "bsp"}
    for base in ("fixed (load)", "fixed (static, BSP)"):
        res.figure(g, f"c.x_{short[base]}",
                   f"proportional (load) samples/s ÷ {base}",
                   [p.summary["samples_per_s"] / x.summary["samples_per_s"]
                    for p, x in zip(prop, c_runs[base])], unit="x", target=">= 1.8")
    for base in ("fixed (load)", "fixed (static, BSP)"):
        gaps = [100 * (p.summary["final_test_accuracy"] - x.summary["final_test_accuracy"])
                for p, x in zip(prop, c_runs[base])]
        res.figure(g, f"c.acc_{short[base]}",
                   f"final accuracy, proportional − {base}, points (|gap| <= 1)",
                   [abs(x) for x in gaps], unit="points", target="<= 1.0")
    for v, rs in c_runs.items():
        res.figure(g, f"c.{short[v]}.samples_per_s",
                   f"{v}: samples/s", [x.summary["samples_per_s"] for x in rs],
                   unit="samples/s", digits=0)
    d_runs = bench.d_runs
    base = d_runs["sync + static"]
    g = res.group(f"(d) time to `--target-accuracy {o.target:g}`, `--inject {SLOWDOWN}`, "
                  f"`--eval-interval {o.eval_interval:g}`",
                  base[0].command.replace("--mode sync", "--mode MODE").replace(
                      "--balancer static", "--balancer BALANCER"))
    ratios = [None if not (x.summary["time_to_target_s"] and s.summary["time_to_target_s"])
              else x.summary["time_to_target_s"] / s.summary["time_to_target_s"]
              for x, s in zip(d_runs["async + load"], base)]
    res.figure(g, "d.ratio", "async + load time to target ÷ sync + static", ratios, unit="x",
               target="<= 0.6")
    for v, rs in d_runs.items():
        res.figure(g, f"d.{v.replace(' + ', '_')}.seconds", f"{v}: seconds to the target",
                   [x.summary["time_to_target_s"] for x in rs], unit="s")
    g = res.group("(e) coverage in every run above", "")
    res.figure(g, "e.coverage", f"runs with exact coverage (applied = expected, 0 duplicates, "
               f"0 missing; 1 = exact), of {len(bench.runs)}",
               [float(x.coverage_exact()) for x in bench.runs], digits=0, target=">= 1",
               decide="all")


def print_tables(bench: Bench, a, b, c, d, checks) -> None:
    n = bench.samples_per_epoch
    print()
    print(f"(a) async, --inject {SLOWDOWN}, {bench.opts.epochs} epochs of {n} samples, "
          f"median of {bench.opts.repeats}")
    print(f"{'policy':<12} {'epoch s':>8} {'x static':>9} {'util':>6} {'ideal s':>8} "
          f"{'ideal/meas':>10} {'rank3 share':>11} {'moves':>6}")
    for p, row in a.items():
        print(f"{p:<12} {row['mean_epoch_s']:>8.3f} {row['ratio_to_static']:>9.2f} "
              f"{row['utilization']:>6.2f} {row['ideal_epoch_s']:>8.3f} "
              f"{row['ideal_over_measured']:>10.2f} {row['slow_share']:>11.3f} {row['moves']:>6g}")
    print()
    print(f"(b) async, --inject {SLOWDOWN}@{b['start_s']:g}, --rebalance-interval "
          f"{b['rebalance_interval_s']:g}")
    print(f"{'policy':<12} {'rank3 rate before':>17} {'seen slow after':>15} "
          f"{'util back after':>15} {'util before':>11} {'util after':>10}")
    for p, row in b["policies"].items():
        det = "-" if row["detect_s"] is None else f"{row['detect_s']:.2f} s"
        rec = "never" if row["recover_s"] is None else f"{row['recover_s']:.2f} s"
        ub = "-" if row["util_before"] is None else f"{row['util_before']:.2f}"
        ua = "-" if row["util_after"] is None else f"{row['util_after']:.2f}"
        print(f"{p:<12} {row['rate_before']:>17.0f} {det:>15} {rec:>15} {ub:>11} {ua:>10}")
    for p in ("load", "predictive"):
        row = b["policies"][p]
        print(f"  {p}: logged rank-3 rows (t, rate, predicted_rate): {row['rows']}")
        print(f"  {p}: epochs (epoch, t_start, t_end, utilization, rank-3 share): {row['epoch_table']}")
    print()
    print(f"(c) sync, --inject {SLOWDOWN}, {bench.opts.sync_epochs} epochs, --rebalance-interval "
          f"{bench.opts.sync_rebalance_interval:g}, median of {bench.opts.repeats}")
    print(f"{'variant':<22} {'samples/s':>10} {'prop. x':>8} {'accuracy':>9} {'prop. - it':>10} "
          f"{'util':>6} {'mean batch (ranks 1-3)':>24}")
    for v, row in c.items():
        print(f"{v:<22} {row['samples_per_s']:>10.0f} {row['proportional_over_this']:>8.2f} "
              f"{row['final_accuracy']:>9.4f} {row['accuracy_gap_points']:>+10.2f} "
              f"{row['utilization']:>6.2f} {str(row['mean_batch']):>24}")
    print()
    print(f"(d) time to --target-accuracy {bench.opts.target}, --inject {SLOWDOWN}, "
          f"--eval-interval {bench.opts.eval_interval:g}, median of {bench.opts.repeats}")
    for v, row in d.items():
        t = "not reached" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.2f} s"
        r = "-" if row["ratio_to_sync_static"] is None else f"{row['ratio_to_sync_static']:.2f}"
        print(f"{v:<14} {t:>12}  x sync+static {r:>5}  samples {row['samples_to_target']}")
    print()
    _runs.print_targets(checks)
    print()
    print("commands (one per configuration; --data is the cached dataset)")
    seen = set()
    for run in bench.runs:
        key = run.label.rsplit("-r", 1)[0]
        if key not in seen:
            seen.add(key)
            print(f"  {key}: {run.command}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _runs.add_dataset_args(ap, os.path.join(tempfile.gettempdir(), "mpilb-balancing"))
    ap.add_argument("--repeats", type=int, default=3, help="repeats of (a), (c), (d)")
    ap.add_argument("--epochs", type=int, default=4, help="epochs per run in (a)")
    ap.add_argument("--mid-epochs", type=int, default=12, help="epochs per run in (b)")
    ap.add_argument("--mid-repeats", type=int, default=1, help="repeats of (b)")
    ap.add_argument("--mid-start", type=float, default=None,
                    help="T in seconds for (b); default about a third into the run")
    ap.add_argument("--rebalance-interval", type=float, default=2.0, help="used in (b)")
    ap.add_argument("--sync-epochs", type=int, default=4, help="epochs per run in (c)")
    ap.add_argument("--sync-rebalance-interval", type=float, default=0.5, help="used in (c)")
    ap.add_argument("--target", type=float, default=0.80, help="target accuracy in (d)")
    ap.add_argument("--target-epochs", type=int, default=10, help="epoch cap in (d)")
    ap.add_argument("--eval-interval", type=float, default=0.25,
                    help="used in (d): the resolution of the time to target")
    ap.add_argument("--only", default="abcd", help="scenarios besides (a) to run, e.g. 'b'")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="balancers compared in (a) (static is the baseline: keep it)")
    ap.add_argument("--json", help="also write the script's own tables to this JSON file")
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    if opts.quick:
        # the plumbing only: a small dataset, one repeat, two epochs, (b) early
        opts.samples, opts.shards, opts.repeats = 12000, 12, 1
        opts.epochs = opts.mid_epochs = opts.sync_epochs = opts.target_epochs = 2
        opts.mid_start = opts.mid_start or 0.3
        opts.dir = opts.dir + "-quick"

    os.makedirs(opts.dir, exist_ok=True)
    import mpilb
    print(f"mpilb {mpilb.__version__} from {os.path.dirname(mpilb.__file__)}")
    bench = Bench(opts)
    res = _results.Results(NAME, "Load balancing", opts)
    bench.prepare()
    t0 = time.perf_counter()
    a = bench.scenario_a()
    b = bench.scenario_b(a) if "b" in opts.only else None
    c = bench.scenario_c() if "c" in opts.only else None
    d = bench.scenario_d() if "d" in opts.only else None
    if not (b and c and d):
        print(json.dumps({"a": a, "b": b, "c": c, "d": d}, indent=1, default=str))
        return 0
    record(res, bench, b)
    checks = res.checks()
    print_tables(bench, a, b, c, d, checks)
    loads = [r.loadavg for r in bench.runs]
    print(f"\n{len(bench.runs)} runs in {time.perf_counter() - t0:.0f} s on {os.cpu_count()} CPUs; "
          f"1-minute load average after each run: {min(loads):.1f} to {max(loads):.1f} "
          f"(median {statistics.median(loads):.1f}; 4 means this job alone)")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"a": a, "b": b, "c": c, "d": d,
                       "checks": [{"target": n, "met": ok, "value": v} for n, ok, v in checks],
                       "options": vars(opts)}, f, indent=1, default=str)
    res.write(_results.out_path(opts, NAME))
    return 0 if res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
