"""Churn: runs whose membership changes at random times (a join, a leave and a kill in
each), against an undisturbed run of the same options.

    python benchmarks/churn.py [--runs 10] [--epochs 30] [--seed 0] [--references 5]

Each run: `mpiexec -disable-auto-cleanup -n 4 mpilb train` (3 workers) on a synthetic
dataset, with, at times drawn from its seed (seconds after its first applied update, or for
the kill after the training start): `mpiexec -n 1 mpilb join RUN.h5`, `mpilb leave RUN.h5
--rank R` and `--inject K:crash@T` (worker K ends abruptly: os._exit, as a kill -9 under
--survive-signals does for its launcher); every other run with --respawn. What each run
must show (issue #29): its exit code as it should be (3 where a worker was lost: a
`lost` row in `members/`; else 0), the joiner's and the leave's exit 0 (or, where the run
had ended before them, their refusal: exit 2), coverage exact (every sample of every
epoch once, recomputed from the log's ranges) and the final test accuracy within 1 point of
the undisturbed runs' median (`--references`, 5: single async runs differ by about a
point from one another). Writes benchmarks/results/churn.json; exit 0 when every run passes.

tests/mpi/test_churn.py runs the same scenario (fewer runs, a looser accuracy bound).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _results  # noqa: E402
import _runs  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from mpirun import recomputed_coverage  # noqa: E402  (the tests' recount from updates/)

NAME = "churn"
WORKERS = 3
WORKER_TIMEOUT_S = 2.0
ACCURACY_POINTS = 0.01   # the bound: within 1 point of an undisturbed run


@dataclass(frozen=True)
class Plan:
    """What happens to one run, and when (drawn from `seed`)."""

    seed: int
    crash_rank: int
    crash_at: float     # seconds after training starts (--inject's clock)
    leave_rank: int
    leave_at: float     # seconds after the run's first applied update
    join_at: float
    respawn: bool

    @classmethod
    def draw(cls, seed: int, workers: int = WORKERS) -> "Plan":
        rng = np.random.default_rng(seed)
        crash, leave = (int(r) for r in rng.choice(np.arange(1, workers + 1), 2, replace=False))
        return cls(seed, crash, round(float(rng.uniform(0.5, 2.5)), 2), leave,
                   round(float(rng.uniform(0.2, 3.0)), 2), round(float(rng.uniform(0.0, 2.0)), 2),
                   bool(seed % 2))


def train_args(data: str, log: str, epochs: int, *extra: str) -> list[str]:
    return ["train", "--data", data, "--hidden", "16", "--epochs", str(epochs), "--no-progress",
            "--worker-timeout", str(WORKER_TIMEOUT_S), "--log", log, *extra]


def mpilb(n: int, *args: str) -> list[str]:
    base = [sys.executable, "-m", "mpilb", *args]
    return base if n == 0 else [_runs.mpiexec(), *(["-disable-auto-cleanup"] if n > 1 else []),
                                "-n", str(n), *base]


def wait_first_update(log: str, proc: subprocess.Popen, timeout: float) -> None:
    from mpilb.runfiles.runlog import holds_updates

    deadline = time.monotonic() + timeout
    while not (os.path.exists(log) and holds_updates(log)):
        if proc.poll() is not None:
            raise RuntimeError(f"{log}: the run ended (exit {proc.returncode}) before its first "
                               f"update:\n{proc.communicate()[1][-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{log}: no update within {timeout:g} s")
        time.sleep(0.05)


def undisturbed(data: str, workdir: str, epochs: int, env: dict, timeout: float = 300,
                k: int = 0) -> float:
    """The final test accuracy of the same run without a join, a leave or a kill."""
    from mpilb.runfiles.summary import summarize_log

    log = os.path.join(workdir, f"undisturbed{k}.h5")
    r = subprocess.run(mpilb(WORKERS + 1, *train_args(data, log, epochs)), cwd=workdir, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"the undisturbed run: exit {r.returncode}\n{r.stderr[-2000:]}")
    return float(summarize_log(log)["final_test_accuracy"])


def churn_run(data: str, workdir: str, plan: Plan, epochs: int, env: dict,
              timeout: float = 300) -> dict:
    """One run of `plan`: its outcome (codes, members/ rows, coverage, accuracy)."""
    from mpilb.data.dataset import open_dataset
    from mpilb.runfiles.runlog import read_columns
    from mpilb.runfiles.summary import summarize_log

    log = os.path.join(workdir, f"churn-{plan.seed}.h5")
    extra = ["--inject", f"{plan.crash_rank}:crash@{plan.crash_at}"]
    if plan.respawn:
        extra.append("--respawn")
    job = subprocess.Popen(mpilb(WORKERS + 1, *train_args(data, log, epochs, *extra)), cwd=workdir,
                           env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    joiner = None
    leave = None
    try:
        wait_first_update(log, job, timeout=120)
        t0 = time.monotonic()
        for at, what in sorted([(plan.join_at, "join"), (plan.leave_at, "leave")]):
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            if what == "join":
                joiner = subprocess.Popen(mpilb(1, "join", log), cwd=workdir, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            else:
                leave = subprocess.run(mpilb(0, "leave", log, "--rank", str(plan.leave_rank)),
                                       cwd=workdir, env=env, text=True, capture_output=True,
                                       timeout=60)
        _, err = job.communicate(timeout=timeout)
        join_code, join_err = None, ""
        if joiner is not None:
            _, join_err = joiner.communicate(timeout=60)
            join_code = joiner.returncode
    finally:
        for proc in (job, joiner):
            if proc is not None and proc.poll() is None:
                proc.kill()
    attrs, cols = read_columns(log)
    m = cols["members"]
    rows = [(round(float(t), 2), int(w), str(e.decode() if isinstance(e, bytes) else e))
            for t, w, e in zip(m["t"], m["worker"], m["event"])]
    summary = summarize_log(log)
    cov = recomputed_coverage(log, open_dataset(data).shard_sizes)
    lost = any(e == "lost" for _, _, e in rows)
    return {"plan": asdict(plan), "code": job.returncode, "expected_code": 3 if lost else 0,
            "status": summary["status"], "lost_workers": summary["lost_workers"],
            "join_code": join_code, "leave_code": leave.returncode if leave else None,
            "leave_said": (leave.stdout + leave.stderr).strip() if leave else "",
            "members": rows, "coverage": cov,
            "exact": cov["applied"] == cov["expected"] and cov["missing"] == cov["duplicates"] == 0
            and cov == summary["coverage"],
            "accuracy": float(summary["final_test_accuracy"]),
            "end_t": float(cols["epochs"]["t_end"][-1]) if len(cols["epochs"]["t_end"]) else 0.0,
            "stderr": err[-3000:],
            "join_stderr": join_err[-1500:]}


def problems(out: dict, reference: float, points: float) -> list[str]:
    """What is wrong with a churn run's outcome (none: it passes)."""
    bad = []
    if out["code"] != out["expected_code"]:
        bad.append(f"exit {out['code']}, expected {out['expected_code']}")
    if out["status"] != ("degraded" if out["expected_code"] == 3 else "finished"):
        bad.append(f"status {out['status']}")
    if out["join_code"] not in (0, 2) or out["leave_code"] not in (0, 2):
        bad.append(f"join exit {out['join_code']}, leave exit {out['leave_code']}")
    if not out["exact"]:
        bad.append(f"coverage {out['coverage']}")
    if abs(out["accuracy"] - reference) > points:
        bad.append(f"accuracy {out['accuracy']:.4f} vs {reference:.4f} undisturbed")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0, help="the first run's seed (then +1 each)")
    ap.add_argument("--references", type=int, default=5,
                    help="undisturbed runs; the accuracy bound is against their median")
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    t0 = time.perf_counter()
    if opts.quick:
        opts.runs, opts.references = 2, 1
    from mpilb.data.dataset import prepare_synthetic

    workdir = tempfile.mkdtemp(prefix="mpilb-churn-")
    env = dict(os.environ, MPILB_CACHE=os.environ.get("MPILB_CACHE") or os.path.join(workdir, "cache"))
    try:
        data = os.path.join(workdir, "synth")
        prepare_synthetic(data, samples=12000, features=32, classes=10, shards=12, seed=0)
        # asynchronous runs differ from run to run (arrival order): the reference is the
        # median of several undisturbed runs, whose own spread is printed beside it
        references = [undisturbed(data, workdir, opts.epochs, env, k=k) for k in range(opts.references)]
        reference = float(np.median(references))
        print(f"undisturbed: test accuracy {reference:.4f} (median of {len(references)}: "
              f"{min(references):.4f}-{max(references):.4f})", flush=True)
        runs = []
        for seed in range(opts.seed, opts.seed + opts.runs):
            out = churn_run(data, workdir, Plan.draw(seed), opts.epochs, env)
            out["problems"] = problems(out, reference, ACCURACY_POINTS)
            runs.append(out)
            print(f"seed {seed}: exit {out['code']} ({out['status']}), join {out['join_code']}, "
                  f"leave {out['leave_code']}, members {out['members']}, exact {out['exact']}, "
                  f"accuracy {out['accuracy']:.4f}" + (f"; PROBLEMS: {out['problems']}"
                                                       if out["problems"] else ""), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    passed = sum(not r["problems"] for r in runs)
    res = _results.Results(NAME, "Churn: joins, leaves and a kill at random times", opts)
    res.t0 = t0   # (made once the runs are done: their time counts)
    g = res.group(f"{len(runs)} runs of 3 workers ({opts.epochs} epochs, synthetic 12,000 x 32), each "
                  f"with a join, a leave and a kill at times drawn from its seed (seeds "
                  f"{opts.seed}-{opts.seed + len(runs) - 1}; the odd ones with --respawn)",
                  f"python benchmarks/churn.py --runs {opts.runs} --epochs {opts.epochs}")
    res.figure(g, "as_expected", "exit code, join and leave as they should be (1 = yes)",
               [int(not [p for p in r["problems"] if not p.startswith("accuracy")]) for r in runs],
               digits=0, target=">= 1", decide="all")
    res.figure(g, "exact", "coverage exact, recomputed from updates/ (1 = yes)",
               [int(bool(r["exact"])) for r in runs], digits=0, target=">= 1", decide="all")
    res.figure(g, "accuracy_gap", f"final test accuracy's distance from the undisturbed median, points "
               f"(median of {len(references)} undisturbed runs: {reference:.4f})",
               [abs(r["accuracy"] - reference) * 100 for r in runs], unit="points",
               target=f"<= {ACCURACY_POINTS * 100:g}", decide="all")
    res.figure(g, "undisturbed", "undisturbed runs: final test accuracy", references, digits=4)
    res.figure(g, "accuracy", "churned runs: final test accuracy", [r["accuracy"] for r in runs], digits=4)
    res.write(_results.out_path(opts, NAME))
    print(f"{passed} of {len(runs)} runs passed", flush=True)
    return 0 if passed == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
