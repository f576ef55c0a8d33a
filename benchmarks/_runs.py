"""What the benchmark scripts share: running `mpilb train` under mpiexec and reading its log.

Each script keeps its scenarios, tables and targets; a run, its summary and the cached
dataset are handled here once.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

WORKERS = 3


def mpiexec() -> str:
    scripts = os.path.dirname(sys.executable)
    path = shutil.which("mpiexec", path=scripts + os.pathsep + os.environ.get("PATH", ""))
    if path is None:
        sys.exit("mpiexec not found: install MPICH or `pip install mpich`")
    return path


@dataclass
class Run:
    """One training run: its command and what its log says."""

    label: str
    args: list[str]
    log: str
    summary: dict = field(default_factory=dict)
    cols: dict = field(default_factory=dict)
    wall_s: float = 0.0
    loadavg: float = 0.0     # the machine's 1-minute load average when the run ended
    ranks: int = WORKERS + 1
    env: dict = field(default_factory=dict)   # variables set for the run
    cpu_s: float = 0.0       # CPU seconds (user + system) of the whole job, start-up included

    @property
    def command(self) -> str:
        """The run's command line, with the dataset and the log by their base names."""
        args = [os.path.basename(a) if prev == "--data" else a
                for prev, a in zip([""] + self.args, self.args)]
        env = "".join(f"{k}={v} " for k, v in sorted(self.env.items()))
        return (f"{env}mpiexec -n {self.ranks} mpilb train "
                + " ".join(args + ["--log", os.path.basename(self.log)]))

    def mean_epoch(self) -> float:
        return float(np.mean(self.summary["epoch_s"]))

    def later_epochs(self) -> float:
        """Mean epoch time without the first epoch (the one where rates are learnt)."""
        e = self.summary["epoch_s"]
        return float(np.mean(e[1:] if len(e) > 1 else e))

    def mean_util(self) -> float:
        return float(np.mean(self.summary["utilization"]))

    def share(self, rank: int) -> float:
        """The worker's share of all samples applied."""
        total = sum(w["samples"] for w in self.summary["per_worker"])
        mine = sum(w["samples"] for w in self.summary["per_worker"] if w["rank"] == rank)
        return mine / total if total else 0.0

    def coverage_exact(self) -> bool:
        cov = self.summary["coverage"]
        return (cov["expected"] > 0 and cov["applied"] == cov["expected"]
                and cov["duplicates"] == 0 and cov["missing"] == 0)


class Bench:
    """A cached synthetic dataset and the runs made on it (`opts`: dir, samples, features,
    shards, run_timeout)."""

    run_class = Run

    def __init__(self, opts, model: list[str]):
        self.opts = opts
        self.model = model
        self.data = os.path.join(opts.dir, f"synthetic-{opts.samples}x{opts.features}-{opts.shards}")
        self.logs = os.path.join(opts.dir, "runs")
        os.makedirs(self.logs, exist_ok=True)
        self.runs: list[Run] = []

    def prepare(self):
        """Make the dataset unless it is cached; returns it (mpilb.data.dataset.Dataset)."""
        if os.path.exists(os.path.join(self.data, "manifest.json")):
            print(f"dataset: {self.data} (cached)")
        else:
            cmd = [sys.executable, "-m", "mpilb", "prepare", "synthetic", self.data,
                   "--samples", str(self.opts.samples), "--features", str(self.opts.features),
                   "--classes", "10", "--shards", str(self.opts.shards)]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            print(f"dataset: {self.data} (prepared)")
        from mpilb.data.dataset import open_dataset

        ds = open_dataset(self.data)
        self.samples_per_epoch = int(sum(ds.shard_sizes))
        return ds

    def train(self, label: str, *args: str, ranks: int = WORKERS + 1, env: dict | None = None) -> Run:
        """One `mpiexec -n 4 mpilb train` run (`ranks`: another size; `env`: variables to
        set for it); exits the script if it fails."""
        from mpilb.runfiles.summary import summarize_log
        from mpilb.runfiles.runlog import read_columns

        log = os.path.join(self.logs, f"{label}.h5")
        # a rerun replaces this label's log and the checkpoint beside it (mpilb refuses to
        # overwrite either without --overwrite)
        for old in (log, os.path.join(self.logs, f"{label}.ckpt.h5")):
            if os.path.exists(old):
                os.remove(old)
        argv = ["--data", self.data, *self.model, "--no-progress", *map(str, args)]
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpilb", "train",
               *argv, "--log", log]
        t0 = time.perf_counter()
        # mpiexec waits for its proxy and the proxy for the ranks, so the ranks' CPU time
        # reaches this process's children's usage when the run ends
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=self.opts.run_timeout,
                             env=dict(os.environ, **(env or {})))
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = time.perf_counter() - t0
        if res.returncode != 0:
            sys.exit(f"run {label} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
        run = self.run_class(label, argv, log, wall_s=wall, loadavg=os.getloadavg()[0],
                             ranks=ranks, env=dict(env or {}),
                             cpu_s=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
        run.summary = summarize_log(log)
        _, run.cols = read_columns(log)
        self.runs.append(run)
        print(f"  {label:<28} {wall:6.1f} s wall, mean epoch {run.mean_epoch():6.3f} s, "
              f"util {run.mean_util():.2f}{self.run_note(run)}, load average {run.loadavg:.1f}",
              flush=True)
        return run

    def run_note(self, run: Run) -> str:
        """Extra figures for the progress line of each run."""
        return ""



def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie awaiting its parent has ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def marked_processes(entry: bytes) -> dict[int, dict]:
    """pid -> environment (bytes keys and values) of every live, non-zombie process whose
    environment holds exactly `entry` (``b"NAME=value"``): the ranks of one job, found by a
    mark its launcher set (benchmarks/hostile.py, tests/mpi/test_survival.py)."""
    found = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            env = open(f"/proc/{p}/environ", "rb").read().split(b"\0")
            state = open(f"/proc/{p}/stat", "rb").read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if entry in env and state != b"Z":
            found[int(p)] = dict(kv.split(b"=", 1) for kv in env if b"=" in kv)
    return found

def load_arrays(ds):
    """Every training shard and the test set of an opened dataset, in memory:
    ``(x, y, x_test, y_test)`` (for baselines outside mpilb, e.g. plain PyTorch)."""
    import h5py

    xs, ys = [], []
    for i in range(len(ds.shards)):
        with h5py.File(ds.shard_path(i), "r") as f:
            xs.append(f["x"][()])
            ys.append(f["y"][()])
    xt, yt = ds.load_test()
    return np.concatenate(xs), np.concatenate(ys), xt, yt


def digits_dataset(root: str) -> str:
    """scikit-learn's digits as a dataset under `root` (8 shards), made once and reused."""
    data = os.path.join(root, "digits")
    if not os.path.exists(os.path.join(data, "manifest.json")):
        from mpilb.data.dataset import prepare_digits

        prepare_digits(data, shards=8, seed=0)
    return data


def add_dataset_args(ap, default_dir: str) -> None:
    """The options every benchmark has: where to work, the synthetic dataset, a run's limit."""
    ap.add_argument("--dir", default=default_dir, help="where the dataset is cached and run logs go")
    ap.add_argument("--samples", type=int, default=96000)
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--shards", type=int, default=48)
    ap.add_argument("--run-timeout", type=float, default=300.0, help="seconds per run")


def print_targets(checks) -> None:
    """One PASS/MISS line per (name, ok, value)."""
    print("targets")
    for name, ok, value in checks:
        print(f"  {'PASS' if ok else 'MISS'}  {name}: {value}")
