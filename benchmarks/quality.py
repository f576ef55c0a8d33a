"""Balancing quality (issue 17): the straggler case against its ideal, node-local stores,
a silent slow reader that recovers, and a lost holder with two replicas, in one run.

    python benchmarks/quality.py [--dir DIR] [--repeats 3] [--only a,b,c,d] [--out FILE] [--quick]

One server and three workers (``mpiexec -n 4``), async, ``load`` unless said otherwise:

  (a) the straggler: synthetic 120000 x 784 (48 shards), ``mlp --hidden 256,256 --batch
      512``, ``--inject 3:compute=4``, 2 epochs, with ``--pipeline 0`` and ``--pipeline 1``
      back to back. Also when the first plan on measured rates was made (the first
      ``workers/`` row: the first rebalance), target about 0.5 s, and the share of the
      machine's CPUs the job kept busy during an epoch (the default run's CPU seconds,
      from the launcher's child usage, less those of the same command for 1 epoch, over
      the CPUs times the difference in training time). Efficiency = samples applied per second of the epochs ÷ the ideal, the
      sum over workers of samples / (compute_s + io_s) from the run's summary (each
      worker's own rate while busy). Target >= 0.85 with the default pipeline setting; the
      samples/s ratio pipeline 1 ÷ pipeline 0 says which should be the default for async.
  (b) ``--store local --inject 3:compute=4``: synthetic 96000 x 256 (48 shards), ``mlp
      --hidden 128 --batch 128``, 2 epochs: mean epoch time of ``load`` ÷ ``static``,
      target <= 0.6.
  (c) a slow reader that falls silent: the (b) dataset, ``--inject 2:readbw=5@0-3``
      (rank 2's reads deliver 5 MB/s for the first 3 s), 16 epochs (about 9 s on a quiet
      machine: a run must outlast the window plus two intervals, 7 s, to show a recovery).
      From the run log: whether rank 2 fell silent (a ``workers/`` row with no samples from
      it), when shards moved to it (probes among them), when its logged rate recovered (the
      first row after 3 s at which it is at least half the others' median), and when it got
      work again (after 3 s, a second shard handed to it within one epoch: more than a
      probe). Recovery = the later of the two, in seconds after the slowdown ended; target:
      within two rebalance intervals (``--rebalance-interval``, 2 s).
  (d) ``--store local --replicas 2`` with rank 2 hung mid-epoch (``2:hang@1``, ``--worker-timeout
      1``) and rank 1 a slow reader, so rows are in flight: exit 3, status degraded, exact
      coverage (every repeat).
  (e) a CPU per rank: one server and one worker (``mpiexec -n 2``; skipped on a machine with
      fewer than 2 CPUs), the models of (a) and (b) for 1 epoch, with the default waits
      (which poll for a moment before they sleep where each rank has a CPU: cores.py) and
      with ``MPILB_SPIN=0`` (sleep between polls, as where ranks share CPUs), back to back:
      the worker's communication seconds per push and the samples/s, default ÷ sleeping.

Ratios are taken within a repeat (runs back to back), then the median, min and max over
repeats are shown and written to ``benchmarks/results/quality.json`` (``--out``; see
``_results.py``). Other jobs on the machine slow every run; the ratios and the efficiency
(whose ideal is measured in the same run) are what to read. Exit status: 0 when every target
is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _runs  # noqa: E402  (the shared run plumbing beside this script)

NAME = "quality"

STRAGGLER = "3:compute=4"
SLOW_READER = "2:readbw=5@0-3"
SLOW_READER_END_S = 3.0
SLOW_READER_EPOCHS = 16
INTERVAL_S = 2.0      # --rebalance-interval (the default)


def spread(values) -> dict:
    vals = [float(v) for v in values]
    return {"values": vals, "median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def show(name: str, s: dict, digits: int = 2) -> str:
    return (f"{name}: median {s['median']:.{digits}f} (min {s['min']:.{digits}f}, max "
            f"{s['max']:.{digits}f}, n={len(s['values'])})")


def efficiency(run: _runs.Run) -> float:
    """Samples per second of the epochs ÷ the sum of the workers' busy rates."""
    s = run.summary
    ideal = sum(w["samples"] / (w["compute_s"] + w["io_s"]) for w in s["per_worker"]
                if w["compute_s"] + w["io_s"] > 0)
    return (s["samples"] / sum(s["epoch_s"])) / ideal


def cores_busy(two: _runs.Run, one: _runs.Run, cpus: int) -> float:
    """The share of the machine's `cpus` the job kept busy during its second epoch: the
    difference of a 2-epoch and a 1-epoch run's CPU seconds (start-up and the end cancel)
    over the CPUs times the difference of their training times. Near 1, the workers'
    waits are waits for a CPU as much as for a message."""
    return (two.cpu_s - one.cpu_s) / (cpus * (two.summary["train_s"] - one.summary["train_s"]))


def comm_share(run: _runs.Run) -> float:
    """The fast workers' communication seconds ÷ their compute + I/O + comm + idle seconds."""
    ws = [w for w in run.summary["per_worker"] if w["rank"] != 3]
    comm = sum(w["comm_s"] for w in ws)
    return comm / sum(w["compute_s"] + w["io_s"] + w["comm_s"] + w["idle_s"] for w in ws)


class Bench:
    def __init__(self, opts):
        self.opts = opts
        ns = argparse.Namespace(dir=opts.dir, shards=48, run_timeout=opts.run_timeout)
        self.big = _runs.Bench(argparse.Namespace(**vars(ns), samples=120000, features=784),
                               ["--model", "mlp", "--hidden", "256,256", "--batch", "512"])
        self.small = _runs.Bench(argparse.Namespace(**vars(ns), samples=96000, features=256),
                                 ["--model", "mlp", "--hidden", "128", "--batch", "128"])
        self.results: dict = {}
        self.res = _results.Results(NAME, "Balancing quality", opts)
        for name in os.listdir(self.small.logs):   # an earlier run's checkpoints beside its logs
            if name.endswith(".ckpt.h5"):          # would make `train` refuse the same --log
                os.remove(os.path.join(self.small.logs, name))

    # ---------------------------------------------------------------- (a)
    def straggler(self) -> None:
        b = self.big
        b.prepare()
        print(f"(a) {STRAGGLER}, 2 epochs, --pipeline 0 and 1, {self.opts.repeats} repeats")
        from mpilb.config.build import build_config
        from mpilb.mpi.cores import usable_cpus

        default = int(build_config().updates.pipeline)   # async's default
        cpus = usable_cpus()   # affinity, capped by a control group's quota
        runs = {0: [], 1: []}
        short = []   # the default for 1 epoch: what an epoch costs the CPUs (cores_busy)
        for r in range(self.opts.repeats):
            for p in (0, 1):
                runs[p].append(b.train(f"a-p{p}-r{r}", "--epochs", 2, "--inject", STRAGGLER,
                                       "--pipeline", p))
            short.append(b.train(f"a-1epoch-r{r}", "--epochs", 1, "--inject", STRAGGLER))
        out = {f"pipeline{p}": {"efficiency": spread(efficiency(x) for x in runs[p]),
                                "comm_share": spread(comm_share(x) for x in runs[p]),
                                "samples_per_s": spread(x.summary["samples"] / sum(x.summary["epoch_s"])
                                                        for x in runs[p]),
                                "command": runs[p][0].command} for p in (0, 1)}
        out["pipeline1_over_0"] = spread(
            (y.summary["samples"] / sum(y.summary["epoch_s"])) / (x.summary["samples"] / sum(x.summary["epoch_s"]))
            for x, y in zip(runs[0], runs[1]))
        out["default_pipeline"] = default
        out["cores_busy"] = spread(cores_busy(two, one, cpus) for two, one in zip(runs[default], short))
        # the first rebalance on measured rates (its workers/ rows), seconds into training
        out["first_plan_s"] = spread(float(np.min(x.cols["workers"]["t"])) for x in runs[0] + runs[1])
        self.results["a"] = out
        for p in (0, 1):
            print("  " + show(f"pipeline {p} efficiency", out[f"pipeline{p}"]["efficiency"]))
            print("  " + show(f"pipeline {p} fast workers' comm share", out[f"pipeline{p}"]["comm_share"]))
        print("  " + show("samples/s pipeline 1 / pipeline 0", out["pipeline1_over_0"]))
        print("  " + show("first plan on measured rates, s into training", out["first_plan_s"]))
        print("  " + show("share of the CPUs busy during an epoch (default)", out["cores_busy"]))
        g = self.res.group(f"(a) the straggler ({STRAGGLER}, 120000 x 784, mlp 256,256, batch 512, "
                           f"2 epochs)", runs[0][0].command)
        eff = lambda x: efficiency(x)  # noqa: E731
        self.res.figure(g, "a.efficiency", f"efficiency, default --pipeline {default} (÷ ideal)",
                        [eff(x) for x in runs[default]], target=">= 0.85",
                        command=runs[default][0].command)
        self.res.figure(g, "a.efficiency_other", f"efficiency, --pipeline {1 - default}",
                        [eff(x) for x in runs[1 - default]], command=runs[1 - default][0].command)
        for p in (0, 1):
            self.res.figure(g, f"a.comm_share_p{p}", f"fast workers' comm share, --pipeline {p}",
                            out[f"pipeline{p}"]["comm_share"]["values"], command=runs[p][0].command)
        self.res.figure(g, "a.pipeline_ratio", "samples/s, --pipeline 1 ÷ --pipeline 0",
                        out["pipeline1_over_0"]["values"])
        self.res.figure(g, "a.first_plan_s", "first plan on measured rates, s into training",
                        out["first_plan_s"]["values"], unit="s", target="<= 0.5")
        self.res.figure(g, "a.cores_busy", f"share of the {cpus} CPUs busy during an "
                        f"epoch, default (2-epoch run against a 1-epoch run)",
                        out["cores_busy"]["values"], command=short[0].command)

    # ---------------------------------------------------------------- (b)
    def local_store(self) -> None:
        b = self.small
        b.prepare()
        print(f"(b) --store local --inject {STRAGGLER}, 2 epochs: static, load")
        ratios, loads = [], []
        for r in range(self.opts.repeats):
            st = b.train(f"b-static-r{r}", "--epochs", 2, "--store", "local", "--inject", STRAGGLER,
                         "--balancer", "static")
            ld = b.train(f"b-load-r{r}", "--epochs", 2, "--store", "local", "--inject", STRAGGLER)
            ratios.append(ld.mean_epoch() / st.mean_epoch())
            loads.append(ld)
        self.results["b"] = {"load_over_static": spread(ratios), "command": loads[0].command,
                             "bytes_moved": spread(x.summary["bytes_moved"] for x in loads)}
        s = self.results["b"]["load_over_static"]
        print("  " + show("load / static mean epoch", s))
        g = self.res.group(f"(b) --store local --inject {STRAGGLER} (96000 x 256, mlp 128, batch 128, "
                           f"2 epochs)", loads[0].command)
        self.res.figure(g, "b.load_over_static", "load ÷ static, mean epoch time", ratios,
                        target="<= 0.6")

    # ---------------------------------------------------------------- (c)
    def slow_reader(self) -> None:
        from mpilb.runfiles.runlog import read_columns

        b = self.small
        b.prepare()
        print(f"(c) --inject {SLOW_READER}, {SLOW_READER_EPOCHS} epochs: is rank 2 probed, does "
              f"it recover within {2 * INTERVAL_S:g} s of the window's end?")
        found = []
        for r in range(self.opts.repeats):
            run = b.train(f"c-r{r}", "--epochs", SLOW_READER_EPOCHS, "--inject", SLOW_READER,
                          "--rebalance-interval", INTERVAL_S)
            _, cols = read_columns(run.log)
            found.append(self._recovery(cols))
            f = found[-1]
            print(f"    silent rows {f['silent_rows']}, moves to rank 2 at {f['moves_t']}, rate back "
                  f"at {f['rate_back_t']} s, work again at {f['work_t']} s, run ended at "
                  f"{f['end_t']} s: recovered {f['recovered_s']} s after the window (rate back in "
                  f"workers/ row {f['rows_to_rate_back']} after it; longest gap between rows "
                  f"{f['max_row_gap_s']} s)")
        late = [f["recovered_s"] for f in found]
        self.results["c"] = {"runs": found, "silent_runs": sum(1 for f in found if f["silent_rows"]),
                             "command": b.runs[-1].command}
        g = self.res.group(f"(c) a slow reader, --inject {SLOW_READER}, {SLOW_READER_EPOCHS} epochs, "
                           f"--rebalance-interval {INTERVAL_S:g}", b.runs[-1].command)
        self.res.figure(g, "c.recovered_s", "rank 2 recovered (logged rate >= half the others' and "
                        "shards beyond a probe), s after its slowdown ended", late,
                        unit="s", target=f"<= {2 * INTERVAL_S:g}")
        self.res.figure(g, "c.rate_back_s", "its logged rate back, s after the slowdown ended",
                        [None if f["rate_back_t"] is None else f["rate_back_t"] - SLOW_READER_END_S
                         for f in found], unit="s")
        self.res.figure(g, "c.work_s", "shards assigned to it again, s after the slowdown ended",
                        [None if f["work_t"] is None else f["work_t"] - SLOW_READER_END_S
                         for f in found], unit="s")
        self.res.figure(g, "c.rows", "rebalance rows (workers/) after the slowdown ended until its "
                        "rate was back", [f["rows_to_rate_back"] for f in found], digits=0)
        self.res.figure(g, "c.gap_s", "longest gap between two rebalance rows (the job descheduled "
                        "by other jobs when far over the interval)", [f["max_row_gap_s"] for f in found],
                        unit="s")
        self.res.figure(g, "c.silent", "runs in which rank 2 fell silent (a row with no samples)",
                        [float(bool(f["silent_rows"])) for f in found], digits=0)

    @staticmethod
    def _recovery(cols) -> dict:
        """When rank 2's logged rate was back and when it got work again, from a run log."""
        w, sh = cols["workers"], cols["shards"]
        t, rank, rate, samples = (np.asarray(w[k]) for k in ("t", "worker", "rate", "samples"))
        silent = [round(float(x), 2) for x, r, n in zip(t, rank, samples)
                  if r == 2 and n == 0 and x < t.max()]   # the last row closes the run
        rate_back = None
        for x in sorted(set(t[t >= SLOW_READER_END_S])):
            mine = rate[(t == x) & (rank == 2)]
            others = rate[(t == x) & (rank != 2)]
            if len(mine) and len(others) and mine[0] >= 0.5 * float(np.median(others)):
                rate_back = float(x)
                break
        events = [e.decode() if isinstance(e, bytes) else str(e) for e in sh["event"]]
        moves_t = [round(float(x), 2) for x, d, e in zip(sh["t"], sh["dst"], events)
                   if d == 2 and e == "move"]
        # work again: a second shard handed to rank 2 in one epoch after the window (a
        # probe is one shard per interval; a second one means the plan or a steal chose it)
        work, per_epoch = None, {}
        for x, ep, d, e in zip(sh["t"], sh["epoch"], sh["dst"], events):
            if d == 2 and e == "assign" and x >= SLOW_READER_END_S:
                per_epoch[int(ep)] = per_epoch.get(int(ep), 0) + 1
                if per_epoch[int(ep)] == 2:
                    work = round(float(x), 2)
                    break
        done = rate_back is not None and work is not None
        rows = sorted(set(t.tolist()))
        # A job descheduled for seconds by other jobs on the machine shows as a long gap
        # between rows (rebalances are due every interval): its seconds are not the balancer's.
        gap = max((b - a for a, b in zip(rows, rows[1:])), default=0.0)
        return {"silent_rows": silent, "moves_t": moves_t[:8],
                "rate_back_t": None if rate_back is None else round(rate_back, 2),
                "work_t": work, "end_t": round(float(t.max()), 2), "max_row_gap_s": round(gap, 2),
                "rows_to_rate_back": (sum(1 for x in rows if SLOW_READER_END_S <= x <= rate_back)
                                      if rate_back is not None else None),
                "recovered_s": round(max(rate_back, work) - SLOW_READER_END_S, 2) if done else None}

    # ---------------------------------------------------------------- (d)
    def lost_holder(self) -> None:
        from mpilb.runfiles.summary import summarize_log

        b = self.small
        b.prepare()
        print("(d) --store local --replicas 2, rank 2 hung at 1 s, rank 1 a slow reader")
        ok = []
        for r in range(self.opts.repeats):
            log = os.path.join(b.logs, f"d-r{r}.h5")
            if os.path.exists(log):
                os.remove(log)
            args = ["--data", b.data, *b.model, "--epochs", "3", "--store", "local", "--replicas",
                    "2", "--inject", "2:hang@1", "--inject", "1:readbw=20", "--worker-timeout", "1",
                    "--no-progress", "--overwrite", "--log", log]
            cmd = [_runs.mpiexec(), "-n", "4", sys.executable, "-m", "mpilb", "train", *args]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=self.opts.run_timeout)
            try:
                s = summarize_log(log)
            except Exception as exc:  # noqa: BLE001 - a run that left no readable log failed
                print(f"    exit {res.returncode}, no log ({exc}): {res.stderr[-300:]}")
                ok.append(False)
                continue
            cov = s["coverage"]
            exact = cov["applied"] == cov["expected"] > 0 and cov["duplicates"] == cov["missing"] == 0
            resourced = "come from rank" in res.stderr
            ok.append(res.returncode == 3 and s["status"] == "degraded" and exact)
            print(f"    exit {res.returncode}, {s['status']}, coverage {cov['applied']}/{cov['expected']} "
                  f"(dup {cov['duplicates']}, missing {cov['missing']}), rows re-sourced: {resourced}")
        self.results["d"] = {"runs_ok": ok, "command": "mpiexec -n 4 mpilb train " + " ".join(args[:-2])}
        g = self.res.group("(d) --store local --replicas 2, a rank hung mid-epoch",
                           self.results["d"]["command"])
        self.res.figure(g, "d.ok", "exit 3, degraded, exact coverage (1 = yes)",
                        [float(x) for x in ok], digits=0, target=">= 1", decide="all")


    # ---------------------------------------------------------------- (e)
    def own_cpus(self) -> None:
        from mpilb.mpi.cores import usable_cpus

        if usable_cpus() < 2:
            print("(e) skipped: fewer than 2 CPUs, so the ranks cannot have one each")
            return
        print("(e) a CPU per rank: 1 server + 1 worker, 1 epoch, default waits and MPILB_SPIN=0")
        cases = (("a", self.big, "mlp 256,256, batch 512"), ("b", self.small, "mlp 128, batch 128"))
        for key, b, what in cases:
            b.prepare()
            runs = {"default": [], "sleep": []}
            for r in range(self.opts.repeats):
                for how, env in (("sleep", {"MPILB_SPIN": "0"}), ("default", {})):
                    runs[how].append(b.train(f"e-{key}-{how}-r{r}", "--epochs", 1, ranks=2, env=env))
            per_push = {how: [w["comm_s"] / max(1, x.summary["updates"]) * 1e3
                              for x in rs for w in x.summary["per_worker"]] for how, rs in runs.items()}
            speed = [(y.summary["samples"] / sum(y.summary["epoch_s"]))
                     / (x.summary["samples"] / sum(x.summary["epoch_s"]))
                     for x, y in zip(runs["sleep"], runs["default"])]
            self.results[f"e{key}"] = {"comm_ms_per_push": {h: spread(v) for h, v in per_push.items()},
                                      "default_over_sleep": spread(speed)}
            for how in ("sleep", "default"):
                print("  " + show(f"{key}: {how} waits, worker comm ms per push",
                                  self.results[f"e{key}"]["comm_ms_per_push"][how], 3))
            print("  " + show(f"{key}: samples/s, default ÷ MPILB_SPIN=0", self.results[f"e{key}"]["default_over_sleep"]))
            g = self.res.group(f"(e{key}) a CPU per rank: 1 server + 1 worker ({what}, 1 epoch)",
                               runs["default"][0].command)
            self.res.figure(g, f"e{key}.comm_ms_sleep", "worker comm per push (ms), MPILB_SPIN=0",
                            per_push["sleep"], unit="ms", digits=3, command=runs["sleep"][0].command)
            self.res.figure(g, f"e{key}.comm_ms", "worker comm per push (ms), default waits",
                            per_push["default"], unit="ms", digits=3)
            self.res.figure(g, f"e{key}.speedup", "samples/s, default ÷ MPILB_SPIN=0", speed)
            self.res.figure(g, f"e{key}.efficiency", "efficiency (÷ ideal), default waits",
                            [efficiency(x) for x in runs["default"]])
            self.res.figure(g, f"e{key}.efficiency_sleep", "efficiency (÷ ideal), MPILB_SPIN=0",
                            [efficiency(x) for x in runs["sleep"]])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "mpilb-quality"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="a,b,c,d,e", help="scenarios to run, comma-separated")
    ap.add_argument("--run-timeout", type=float, default=300.0)
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.repeats = 1
    os.makedirs(opts.dir, exist_ok=True)
    import mpilb

    print(f"mpilb {mpilb.__version__} from {os.path.dirname(mpilb.__file__)}")
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    bench = Bench(opts)
    steps = {"a": bench.straggler, "b": bench.local_store, "c": bench.slow_reader, "d": bench.lost_holder,
             "e": bench.own_cpus}
    for key in opts.only.split(","):
        steps[key]()
    _runs.print_targets(bench.res.checks())
    print(f"{time.perf_counter() - t0:.0f} s on {os.cpu_count()} CPUs; 1-minute load average "
          f"before {load_before:.1f}, after {os.getloadavg()[0]:.1f}; other jobs slow both sides "
          f"of a ratio")
    bench.res.write(_results.out_path(opts, NAME))
    return 0 if bench.res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
