"""The shard stores' "Must show" scenarios (issue 5), measured in one run.

    python benchmarks/stores.py [--dir DIR] [--repeats 5] [--epochs 5] [--quick] [--out FILE]

Writes every figure, per repeat, to benchmarks/results/stores.json (``--out``), from which
``python benchmarks/gendocs.py`` renders the tables of docs/data.md.

One server and three workers (``mpiexec -n 4``), async, train ``mlp --hidden 128 --batch
128`` on a synthetic dataset (96000 x 256, 10 classes, 48 shards by default, of which 80 %
train; made once and cached in ``--dir``). Every figure is measured in this run and set
against a baseline measured in the same run:

  (a) ``--store shared --inject 2:readbw=10`` (rank 2's shard reads deliver at most
      10 MB/s): mean epoch time of ``load`` against ``static`` (target <= 0.5 x), and
      against ``load`` on the same store with no injection (target <= 1.4 x). Also rank 2's
      share of the samples, its waited read time (``io_s``) and its logged rate against the
      other workers', which show that slow reads are seen in the rates.
  (b) ``--store local --inject 3:compute=4``: ``load`` against ``static`` (target <= 0.65 x),
      with ``bytes_moved`` > 0 and bytes moved in every epoch no more than the dataset's
      size (x + y bytes of every shard file, read from the files). ``load`` on the shared
      store is run too, as the same balancing with no bytes to move.
  (c) ``--store local --replicas 2 --inject 2:readbw=10``: ``load`` against ``load`` with
      two replicas and no injection. The issue asks for "close to"; this script holds it to
      the bound (a) uses for the shared store, <= 1.4 x: with two copies every shard has a
      holder other than rank 2, so the store allows what the shared store allows. ``static``
      is run too, as the case that reads where it is told.
  (d) coverage exact (applied = expected, duplicates 0, missing 0) in every run.

Runs of one repeat go back to back and ratios are taken within a repeat, then the median
over repeats is shown, so that drifting machine noise hits both sides of a ratio alike.
Mean epoch time is over every epoch, the first included (the balancer learns the rates
there); the "epochs 2+" column leaves the first out, for reading only. On a machine with
fewer cores than ranks the runs share CPUs, and a rank that sleeps in an injected read
gives its CPU to the others. Exit status: 0 when every target is met, 1 otherwise.
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

NAME = "stores"

WORKERS = _runs.WORKERS
MODEL = ["--model", "mlp", "--hidden", "128", "--batch", "128"]
SLOW_READ = "2:readbw=10"
SLOW_READ_RANK = 2
SLOW_COMPUTE = "3:compute=4"
SLOW_COMPUTE_RANK = 3

# label -> (store options, injection or None, balancer). One repeat runs them all in turn.
CONFIGS = {
    "a-static": (["--store", "shared"], SLOW_READ, "static"),
    "a-load": (["--store", "shared"], SLOW_READ, "load"),
    "a-load-noinj": (["--store", "shared"], None, "load"),
    "b-static": (["--store", "local"], SLOW_COMPUTE, "static"),
    "b-load": (["--store", "local"], SLOW_COMPUTE, "load"),
    "b-load-shared": (["--store", "shared"], SLOW_COMPUTE, "load"),
    "c-load": (["--store", "local", "--replicas", "2"], SLOW_READ, "load"),
    "c-load-noinj": (["--store", "local", "--replicas", "2"], None, "load"),
    "c-static": (["--store", "local", "--replicas", "2"], SLOW_READ, "static"),
}


class Run(_runs.Run):
    def worker(self, rank: int) -> dict:
        return next(w for w in self.summary["per_worker"] if w["rank"] == rank)

    def rate_ratio(self, rank: int) -> float:
        """Median logged rate of ``rank`` over the median logged rate of the other workers.

        The rate is what the balancer plans with (the ``workers/`` rows of the log), so this
        says whether a slowdown was seen.
        """
        wk = self.cols["workers"]
        mine = wk["worker"] == rank
        if not mine.any() or mine.all():
            return float("nan")
        return float(np.median(wk["rate"][mine]) / np.median(wk["rate"][~mine]))

    def bytes_from(self, rank: int) -> int:
        """Bytes of shard rows that ``rank`` sent to other workers (it read them to send them)."""
        sh = self.cols["shards"]
        return int(sh["bytes"][(sh["event"] == "move") & (sh["src"] == rank)].sum())

    def others_io(self, rank: int) -> float:
        """Waited read time of the workers other than ``rank``, summed (their ``io_s``)."""
        return float(sum(w["io_s"] for w in self.summary["per_worker"] if w["rank"] != rank))

    def bytes_per_epoch(self) -> list[int]:
        """Bytes of shard rows sent between workers, per epoch (``move`` rows of ``shards/``)."""
        sh = self.cols["shards"]
        moves = sh["event"] == "move"
        epochs = range(int(self.summary["epochs_completed"]))
        return [int(sh["bytes"][moves & (sh["epoch"] == e)].sum()) for e in epochs]


class Bench(_runs.Bench):
    run_class = Run

    def __init__(self, opts):
        super().__init__(opts, MODEL + ["--mode", "async"])

    def prepare(self):
        import h5py

        ds = super().prepare()
        # The dataset's size as the shard files hold it: every x and y, in bytes.
        self.dataset_bytes = 0
        for i in range(len(ds.shards)):
            with h5py.File(ds.shard_path(i), "r", locking=False) as f:
                for name in ("x", "y"):
                    self.dataset_bytes += int(f[name].size) * f[name].dtype.itemsize
        print(f"  {self.samples_per_epoch} training samples in {len(ds.shards)} shards, "
              f"{self.dataset_bytes} bytes of x + y")
        return ds

    def run_note(self, run) -> str:
        return f", bytes moved {run.summary['bytes_moved']:>11,}"

    def measure(self) -> dict[str, list[Run]]:
        print(f"{len(CONFIGS)} configurations x {self.opts.repeats} repeats, "
              f"{self.opts.epochs} epochs each")
        runs: dict[str, list[Run]] = {k: [] for k in CONFIGS}
        for r in range(self.opts.repeats):
            for key, (store, inject, balancer) in CONFIGS.items():
                extra = list(store) + ["--balancer", balancer, "--epochs", self.opts.epochs]
                if inject:
                    extra += ["--inject", inject]
                runs[key].append(self.train(f"{key}-r{r}", *extra))
        return runs


def med(values) -> float:
    return float(statistics.median(values))


def ratio(num: list[Run], den: list[Run]) -> float:
    """Median over repeats of the within-repeat ratio of mean epoch times."""
    return med(a.mean_epoch() / b.mean_epoch() for a, b in zip(num, den))


def row(rs: list[Run], rank: int, dataset_bytes: int) -> dict:
    """The figures shown for one configuration, medians over repeats."""
    per_epoch = [x.bytes_per_epoch() for x in rs]
    return {
        "mean_epoch_s": med(x.mean_epoch() for x in rs),
        "later_epochs_s": med(x.later_epochs() for x in rs),
        "utilization": med(x.mean_util() for x in rs),
        "rank": rank,
        "share": med(x.share(rank) for x in rs),
        "io_s": med(x.worker(rank)["io_s"] for x in rs),
        "rate_ratio": med(x.rate_ratio(rank) for x in rs),
        "others_io_s": med(x.others_io(rank) for x in rs),
        "moves": med(x.summary["shard_moves"] for x in rs),
        "bytes_moved": med(x.summary["bytes_moved"] for x in rs),
        "bytes_per_epoch": med(x.summary["bytes_moved"] / max(1, x.summary["epochs_completed"])
                               for x in rs),
        "from_rank_per_epoch": med(x.bytes_from(rank) / max(1, x.summary["epochs_completed"])
                                   for x in rs),
        "max_epoch_bytes": max((max(p) if p else 0) for p in per_epoch),
        "max_epoch_fraction": max((max(p) if p else 0) for p in per_epoch) / dataset_bytes,
        "command": rs[0].command,
    }


def figures(bench: Bench, runs: dict[str, list[Run]]) -> dict:
    n = bench.dataset_bytes
    rows = {}
    for key in CONFIGS:
        rank = SLOW_COMPUTE_RANK if key.startswith("b-") else SLOW_READ_RANK
        rows[key] = row(runs[key], rank, n)
    rows["a-load"]["x_static"] = ratio(runs["a-load"], runs["a-static"])
    rows["a-load"]["x_noinj"] = ratio(runs["a-load"], runs["a-load-noinj"])
    rows["a-static"]["x_noinj"] = ratio(runs["a-static"], runs["a-load-noinj"])
    rows["b-load"]["x_static"] = ratio(runs["b-load"], runs["b-static"])
    rows["b-load-shared"]["x_static"] = ratio(runs["b-load-shared"], runs["b-static"])
    rows["c-load"]["x_noinj"] = ratio(runs["c-load"], runs["c-load-noinj"])
    rows["c-static"]["x_noinj"] = ratio(runs["c-static"], runs["c-load-noinj"])
    rows["c-load"]["x_static"] = ratio(runs["c-load"], runs["c-static"])
    # Every local-store load run's bytes: the smallest total (must be > 0) and the largest
    # single epoch (must be <= the dataset).
    b = runs["b-load"]
    rows["b-load"]["min_bytes_moved"] = min(x.summary["bytes_moved"] for x in b)
    return rows


def record(res, bench: Bench, runs: dict[str, list[Run]]) -> None:
    """Every figure of the tables, per repeat, with the targets (the issue's "Must show")."""
    o, n = bench.opts, bench.dataset_bytes

    def ratios(num: str, den: str) -> list[float]:
        return [a.mean_epoch() / b.mean_epoch() for a, b in zip(runs[num], runs[den])]

    def command(key: str) -> str:
        return runs[key][0].command

    g = res.group(f"(a) `--store shared --inject {SLOW_READ}`, {o.epochs} epochs",
                  command("a-load").replace("--balancer load", "--balancer POLICY"))
    res.figure(g, "a.x_static", "load: mean epoch time ÷ static", ratios("a-load", "a-static"),
               unit="x", target="<= 0.5")
    res.figure(g, "a.x_noinj", "load: mean epoch time ÷ load with no injection",
               ratios("a-load", "a-load-noinj"), unit="x", target="<= 1.4")
    res.figure(g, "a.static_x_noinj", "static: mean epoch time ÷ load with no injection",
               ratios("a-static", "a-load-noinj"), unit="x")
    res.figure(g, "a.share", "load: rank 2's share of the samples",
               [x.share(SLOW_READ_RANK) for x in runs["a-load"]], digits=3)
    res.figure(g, "a.rate_ratio", "load: rank 2's logged rate ÷ the others'",
               [x.rate_ratio(SLOW_READ_RANK) for x in runs["a-load"]], digits=3)
    g = res.group(f"(b) `--store local --inject {SLOW_COMPUTE}`, {o.epochs} epochs",
                  command("b-load").replace("--balancer load", "--balancer POLICY"))
    res.figure(g, "b.x_static", "load: mean epoch time ÷ static", ratios("b-load", "b-static"),
               unit="x", target="<= 0.65")
    res.figure(g, "b.shared_x_static", "load on `--store shared` (no bytes to move) ÷ static",
               ratios("b-load-shared", "b-static"), unit="x")
    res.figure(g, "b.bytes_moved_mb", "load: MB of shard rows sent between workers, whole run "
               "(> 0 in every run)", [x.summary["bytes_moved"] / 1e6 for x in runs["b-load"]],
               unit="MB", digits=1, target=">= 0.001", decide="all")
    res.figure(g, "b.max_epoch_fraction", f"load: the most bytes moved in one epoch ÷ the "
               f"dataset's {n / 1e6:.1f} MB", [max(x.bytes_per_epoch() or [0]) / n
                                                 for x in runs["b-load"]],
               digits=3, target="<= 1.0", decide="all")
    res.figure(g, "b.share", "load: rank 3's share of the samples",
               [x.share(SLOW_COMPUTE_RANK) for x in runs["b-load"]], digits=3)
    g = res.group(f"(c) `--store local --replicas 2 --inject {SLOW_READ}`, {o.epochs} epochs",
                  command("c-load").replace("--balancer load", "--balancer POLICY"))
    res.figure(g, "c.x_noinj", "load: mean epoch time ÷ load with no injection",
               ratios("c-load", "c-load-noinj"), unit="x", target="<= 1.4")
    res.figure(g, "c.static_x_noinj", "static: mean epoch time ÷ load with no injection",
               ratios("c-static", "c-load-noinj"), unit="x")
    res.figure(g, "c.others_io_s", "load: the other workers' waited read time, s (summed)",
               [x.others_io(SLOW_READ_RANK) for x in runs["c-load"]], unit="s")
    g = res.group("(d) coverage in every run above", "")
    res.figure(g, "d.coverage", f"runs with exact coverage (applied = expected, 0 duplicates, "
               f"0 missing; 1 = exact), of {len(bench.runs)}",
               [float(x.coverage_exact()) for x in bench.runs], digits=0, target=">= 1",
               decide="all")


def print_tables(bench: Bench, rows: dict, checks) -> None:
    o = bench.opts
    n = bench.samples_per_epoch
    print()
    print(f"{o.epochs} epochs of {n} samples ({bench.dataset_bytes:,} bytes of shard data), "
          f"median of {o.repeats} repeats.")
    print("share, io_s, rate: the injected rank's share of the samples, its waited read time, and "
          "its logged rate over the others' (medians of workers/ rows); others io_s: the other "
          "workers' waited read time, summed; MB/epoch: shard rows sent between workers "
          "(mean, and the largest single epoch of any repeat); MB/ep from: rows the injected "
          "rank sent (it read them to send them)")
    head = (f"{'run':<40} {'epoch s':>8} {'epochs 2+':>9} {'ratio':>13} {'util':>5} "
            f"{'share':>6} {'io_s':>5} {'rate':>5} {'others io_s':>11} {'moves':>5} {'MB/epoch':>8} "
            f"{'max MB/ep':>9} {'MB/ep from':>10}")

    def line(key: str, name: str, ratio_text: str) -> None:
        r = rows[key]
        print(f"{name:<40} {r['mean_epoch_s']:>8.3f} {r['later_epochs_s']:>9.3f} {ratio_text:>13} "
              f"{r['utilization']:>5.2f} {r['share']:>6.3f} {r['io_s']:>5.2f} {r['rate_ratio']:>5.3f} "
              f"{r['others_io_s']:>11.2f} {r['moves']:>5g} {r['bytes_per_epoch'] / 1e6:>8.2f} "
              f"{r['max_epoch_bytes'] / 1e6:>9.2f} {r['from_rank_per_epoch'] / 1e6:>10.2f}")

    print()
    print(f"(a) --store shared --inject {SLOW_READ}")
    print(head)
    line("a-static", "static", f"{rows['a-static']['x_noinj']:.2f} x no-inj")
    line("a-load", "load", f"{rows['a-load']['x_static']:.2f} x static")
    line("a-load", "", f"{rows['a-load']['x_noinj']:.2f} x no-inj")
    line("a-load-noinj", "load, no injection", "1.00")
    print()
    print(f"(b) --store local --inject {SLOW_COMPUTE}")
    print(head)
    line("b-static", "static", "1.00")
    line("b-load", "load", f"{rows['b-load']['x_static']:.2f} x static")
    line("b-load-shared", "load, --store shared (no bytes to move)",
         f"{rows['b-load-shared']['x_static']:.2f} x static")
    print()
    print(f"(c) --store local --replicas 2 --inject {SLOW_READ}")
    print(head)
    line("c-load", "load", f"{rows['c-load']['x_noinj']:.2f} x no-inj")
    line("c-load-noinj", "load, no injection", "1.00")
    line("c-static", "static", f"{rows['c-static']['x_noinj']:.2f} x no-inj")
    print()
    _runs.print_targets(checks)
    print()
    print("commands (one per configuration; --data is the cached dataset)")
    for key in CONFIGS:
        print(f"  {key}: {rows[key]['command']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _runs.add_dataset_args(ap, os.path.join(tempfile.gettempdir(), "mpilb-stores"))
    ap.add_argument("--repeats", type=int, default=5, help="repeats of every configuration")
    ap.add_argument("--epochs", type=int, default=5, help="epochs per run")
    ap.add_argument("--json", help="also write the script's own tables to this JSON file")
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    if opts.quick:   # the plumbing only: a small dataset, one repeat, two epochs
        opts.samples, opts.shards, opts.repeats, opts.epochs = 12000, 12, 1, 2
        opts.dir = opts.dir + "-quick"

    os.makedirs(opts.dir, exist_ok=True)
    import mpilb
    print(f"mpilb {mpilb.__version__} from {os.path.dirname(mpilb.__file__)}")
    load_before = os.getloadavg()[0]
    print(f"1-minute load average before: {load_before:.1f} on {os.cpu_count()} CPUs")
    bench = Bench(opts)
    res = _results.Results(NAME, "Shard stores", opts)
    bench.prepare()
    t0 = time.perf_counter()
    runs = bench.measure()
    rows = figures(bench, runs)
    record(res, bench, runs)
    checks = res.checks()
    print_tables(bench, rows, checks)
    loads = [r.loadavg for r in bench.runs]
    elapsed = time.perf_counter() - t0
    print(f"\n{len(bench.runs)} runs in {elapsed:.0f} s on {os.cpu_count()} CPUs; 1-minute load "
          f"average before {load_before:.1f}, after each run {min(loads):.1f} to {max(loads):.1f} "
          f"(median {statistics.median(loads):.1f}); other jobs on the machine raise it and slow "
          f"both sides of a ratio")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"rows": rows, "dataset_bytes": bench.dataset_bytes,
                       "samples_per_epoch": bench.samples_per_epoch,
                       "checks": [{"target": n, "met": ok, "value": v} for n, ok, v in checks],
                       "elapsed_s": elapsed, "load_before": load_before, "loads": loads,
                       "options": vars(opts)}, f, indent=1, default=str)
    res.write(_results.out_path(opts, NAME))
    return 0 if res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
