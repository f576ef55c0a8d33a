"""Workers that join a running job: a run started with 2 workers, joined by 2 more a few
seconds in, against a run started with 4.

    python benchmarks/membership.py [--repeats 3] [--epochs 20] [--join-at 3]

Each repeat runs, on the built-in dataset (`$MPILB_CACHE`, made once):

- `mpiexec -n 3 mpilb train --epochs E --log join.h5` (rank 0 and workers 1, 2), and
  `--join-at` seconds after its first applied update, two `mpiexec -n 1 mpilb join join.h5`
  started together (they are taken one after the other, as workers 3 and 4);
- `mpiexec -n 5 mpilb train --epochs E --log four.h5` (4 workers from the start).

Figures: for each joiner, the seconds from its launch to its first applied push (its launch
to the line `joined as worker N` on its stderr, by the wall clock here, plus the log's time
from its `join` row in `members/` to its first row in `updates/`); samples/s of the joined run
from one second after the last join to its last update, over the same window of the 4-worker
run (the run clock of each log starts at its training start); and the coverage both logs
recorded (every sample of every epoch once). Targets (issue #29): the first push within 2 s
of the joiner's start, samples/s after the join at least 0.9 of the 4-worker run's, exact
coverage. Writes benchmarks/results/membership.json; exit 0 when every target is met.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _runs  # noqa: E402

NAME = "membership"
TARGETS = {"first_push_s": "<= 2", "rate_ratio": ">= 0.9", "exact": ">= 1"}


def mpilb(n: int, *args: str) -> list[str]:
    return [_runs.mpiexec(), "-n", str(n), sys.executable, "-m", "mpilb", *args]


class Joiner:
    """One `mpilb join` process, and the wall-clock time it said it joined."""

    def __init__(self, log: str, cwd: str, env: dict):
        self.launched = time.time()
        self.proc = subprocess.Popen(mpilb(1, "join", log), cwd=cwd, env=env, text=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.joined_at: float | None = None
        self.rank: int | None = None
        self.err: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line)
            if "joined as worker" in line and self.joined_at is None:
                self.joined_at = time.time()
                self.rank = int(line.split()[-1])

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=5)
        return code


def wait_first_update(log: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    from mpilb.runfiles.runlog import holds_updates

    t0 = time.monotonic()
    while not (os.path.exists(log) and holds_updates(log)):
        if proc.poll() is not None:
            sys.exit(f"{log}: the run ended (exit {proc.returncode}) before its first update:\n"
                     f"{proc.stderr.read()[-2000:]}")
        if time.monotonic() - t0 > timeout:
            sys.exit(f"{log}: no update within {timeout} s")
        time.sleep(0.05)


def exact(attrs) -> bool:
    cov = json.loads(attrs["coverage"])
    return cov["missing"] == 0 and cov["duplicates"] == 0 and cov["applied"] == cov["expected"]


def samples_per_s(updates, t_from: float) -> float:
    after = updates["t"] >= t_from
    span = float(updates["t"][after].max() - t_from) if after.any() else 0.0
    if span < 1.0:
        sys.exit(f"only {span:.2f} s of updates after {t_from:.2f} s: give more --epochs")
    return float(updates["batch"][after].sum()) / span


def one_repeat(d: str, opts, env: dict) -> dict:
    from mpilb.runfiles.runlog import read_columns

    common = ["train", "--epochs", str(opts.epochs), "--no-progress"]
    join_log = os.path.join(d, "join.h5")
    run = subprocess.Popen(mpilb(3, *common, "--log", join_log), cwd=d, env=env, text=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_first_update(join_log, run)
    time.sleep(opts.join_at)
    joiners = [Joiner(join_log, d, env), Joiner(join_log, d, env)]
    codes = [j.wait(timeout=opts.epochs * 20 + 120) for j in joiners]
    _, err = run.communicate(timeout=opts.epochs * 20 + 120)
    if run.returncode != 0 or codes != [0, 0] or None in [j.joined_at for j in joiners]:
        sys.exit(f"the joined run: exit {run.returncode}, joiners {codes}\n{err[-2000:]}\n"
                 + "".join(e for j in joiners for e in j.err)[-2000:])
    attrs, cols = read_columns(join_log)
    members, updates = cols["members"], cols["updates"]
    joins = np.array([e.decode() if isinstance(e, bytes) else e for e in members["event"]]) == "join"
    first_push, join_t = [], []
    for j in joiners:
        t_join = float(members["t"][(members["worker"] == j.rank) & joins][0])
        mine = updates["t"][updates["worker"] == j.rank]
        first_push.append((j.joined_at - j.launched) + float(mine.min()) - t_join)
        join_t.append(t_join)
    window_from = max(join_t) + 1.0
    joined_rate = samples_per_s(updates, window_from)

    four_log = os.path.join(d, "four.h5")
    res = subprocess.run(mpilb(5, *common, "--log", four_log), cwd=d, env=env, text=True,
                         capture_output=True, timeout=opts.epochs * 20 + 120)
    if res.returncode != 0:
        sys.exit(f"the 4-worker run: exit {res.returncode}\n{res.stderr[-2000:]}")
    attrs4, cols4 = read_columns(four_log)
    four_rate = samples_per_s(cols4["updates"], window_from)
    out = {"first_push_s": max(first_push), "rate_ratio": joined_rate / four_rate,
           "joined_rate": joined_rate, "four_rate": four_rate, "join_t": max(join_t),
           "exact": float(exact(attrs) and exact(attrs4)), "status": attrs["status"]}
    print(f"  joins admitted at {', '.join(f'{t:.2f}' for t in join_t)} s; first pushes "
          f"{', '.join(f'{x:.2f}' for x in first_push)} s after launch; samples/s after the "
          f"join {joined_rate:.0f} against {four_rate:.0f} with 4 workers from the start "
          f"({out['rate_ratio']:.2f}x); coverage exact: {bool(out['exact'])}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--join-at", type=float, default=3.0,
                    help="seconds after the first applied update to start the joiners")
    _results.add_output_args(ap, NAME)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.epochs = 1, 10
    cache = os.environ.get("MPILB_CACHE") or os.path.join(tempfile.gettempdir(), "mpilb-bench-cache")
    env = dict(os.environ, MPILB_CACHE=cache)
    res = _results.Results(NAME, "Workers that join a running job", opts)
    runs = []
    for r in range(opts.repeats):
        print(f"repeat {r + 1} of {opts.repeats}", flush=True)
        d = tempfile.mkdtemp(prefix="mpilb-join-")
        try:
            runs.append(one_repeat(d, opts, env))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    g = res.group(f"2 workers joined by 2 more {opts.join_at:g} s in, against 4 from the start "
                  f"(the built-in dataset, {opts.epochs} epochs)",
                  f"mpiexec -n 3 mpilb train --epochs {opts.epochs} --log join.h5; "
                  "mpiexec -n 1 mpilb join join.h5 (twice, together); "
                  f"mpiexec -n 5 mpilb train --epochs {opts.epochs}")
    res.figure(g, "first_push_s", "a joiner's launch to its first applied push, the later of two",
               [x["first_push_s"] for x in runs], unit="s", digits=2, target=TARGETS["first_push_s"])
    res.figure(g, "rate_ratio", "samples/s from 1 s after the joins ÷ the 4-worker run's, same window",
               [x["rate_ratio"] for x in runs], unit="x", target=TARGETS["rate_ratio"])
    res.figure(g, "joined_rate", "joined run: samples/s after the joins", [x["joined_rate"] for x in runs],
               unit="samples/s", digits=0)
    res.figure(g, "four_rate", "4 workers from the start: samples/s, same window",
               [x["four_rate"] for x in runs], unit="samples/s", digits=0)
    res.figure(g, "exact", "both runs' coverage exact (1 = yes)", [x["exact"] for x in runs],
               target=TARGETS["exact"])
    _runs.print_targets(res.checks())
    res.write(_results.out_path(opts, NAME))
    return 0 if res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
