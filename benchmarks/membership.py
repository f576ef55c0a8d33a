"""Workers that join a running job: a run started with 2 workers, joined by 2 more a few
seconds in, against a run started with 4.

    python benchmarks/membership.py [--repeats 3] [--epochs 60] [--join-at 3] [--box [--link-rate 1gbit]]

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

With `--box` (root; mpilb.clusterbox) the same across two nodes of a cluster in a box, links
shaped to `--link-rate`: the joined run `-hosts n0:2,n1:1` (rank 0 and worker 1 on n0, worker
2 on n1), both joiners started on n1 (they reach rank 0 over the network, as a second job on
other nodes does), against `-hosts n0:2,n1:3` (the same ranks on the same nodes from the
start). Writes benchmarks/results/membership_box.json.
"""

from __future__ import annotations

import argparse
import contextlib
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


class Here:
    """Runs on this machine: the job's ranks and the joiners share its memory."""

    def job(self, n: int, args, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(mpilb(n, *args), **kwargs)

    def joiner(self, args, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(mpilb(1, *args), **kwargs)


class OnTwoNodes:
    """Runs on two nodes of a cluster in a box: the job's ranks placed by `-hosts` (rank 0 and
    worker 1 on n0, the other workers on n1), the joiners started on n1."""

    def __init__(self, box):
        self.box = box

    def job(self, n: int, args, env=None, **kwargs) -> subprocess.Popen:
        hosts = f"n0:2,n1:{n - 2}"
        cmd = self.box.mpiexec_cmd(["-hosts", hosts, sys.executable, "-m", "mpilb", *args])
        return self.box.popen(0, cmd, env=env, **kwargs)

    def joiner(self, args, env=None, **kwargs) -> subprocess.Popen:
        return self.box.popen(1, mpilb(1, *args), env=env, **kwargs)


class Joiner:
    """One `mpilb join` process, and the wall-clock time it said it joined."""

    def __init__(self, where, log: str, cwd: str, env: dict):
        self.launched = time.time()
        self.proc = where.joiner(["join", log], cwd=cwd, env=env, text=True,
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


def one_repeat(d: str, opts, env: dict, where) -> dict:
    from mpilb.runfiles.runlog import read_columns

    common = ["train", "--epochs", str(opts.epochs), "--no-progress"]
    join_log = os.path.join(d, "join.h5")
    run = where.job(3, [*common, "--log", join_log], cwd=d, env=env, text=True,
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_first_update(join_log, run)
    time.sleep(opts.join_at)
    joiners = [Joiner(where, join_log, d, env), Joiner(where, join_log, d, env)]
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
    four = where.job(5, [*common, "--log", four_log], cwd=d, env=env, text=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err4 = four.communicate(timeout=opts.epochs * 20 + 120)
    if four.returncode != 0:
        sys.exit(f"the 4-worker run: exit {four.returncode}\n{err4[-2000:]}")
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
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--join-at", type=float, default=3.0,
                    help="seconds after the first applied update to start the joiners")
    ap.add_argument("--box", action="store_true",
                    help="across two nodes of a cluster in a box (root): joiners on the other node")
    ap.add_argument("--link-rate", default="1gbit", help="with --box: each node's link rate")
    _results.add_output_args(ap, NAME)
    _results.add_box_args(ap)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.epochs = 1, 30
    name = f"{NAME}_box" if opts.box else NAME
    cache = os.environ.get("MPILB_CACHE") or os.path.join(tempfile.gettempdir(), "mpilb-bench-cache")
    env = dict(os.environ, MPILB_CACHE=cache)
    if opts.box:
        from mpilb.clusterbox import ClusterBox, missing

        why = missing()
        if why:
            sys.exit(f"--box: no cluster in a box here: {why}")
        title = f"Workers that join a running job from another node (cluster in a box, links {opts.link_rate})"
        place = ClusterBox(nodes=2, link_rate=opts.link_rate, tcp=opts.tcp)
    else:
        title, place = "Workers that join a running job", None
    res = _results.Results(name, title, opts)
    runs = []
    with (place if place is not None else contextlib.nullcontext()):
        if place is not None:
            res.box(place)
        where = OnTwoNodes(place) if place is not None else Here()
        for r in range(opts.repeats):
            print(f"repeat {r + 1} of {opts.repeats}", flush=True)
            d = tempfile.mkdtemp(prefix="mpilb-join-")
            try:
                runs.append(one_repeat(d, opts, env, where))
            finally:
                shutil.rmtree(d, ignore_errors=True)
    if opts.box:
        what = (f"2 workers (n0: rank 0 and worker 1; n1: worker 2) joined by 2 more on n1 "
                f"{opts.join_at:g} s in, against the same 4 workers from the start "
                f"(the built-in dataset, {opts.epochs} epochs, links {opts.link_rate})")
        how = (f"mpilb box: mpiexec -hosts n0:2,n1:1 mpilb train --epochs {opts.epochs} --log join.h5; "
               "on n1: mpiexec -n 1 mpilb join join.h5 (twice, together); "
               f"mpiexec -hosts n0:2,n1:3 mpilb train --epochs {opts.epochs}")
    else:
        what = (f"2 workers joined by 2 more {opts.join_at:g} s in, against 4 from the start "
                f"(the built-in dataset, {opts.epochs} epochs)")
        how = (f"mpiexec -n 3 mpilb train --epochs {opts.epochs} --log join.h5; "
               "mpiexec -n 1 mpilb join join.h5 (twice, together); "
               f"mpiexec -n 5 mpilb train --epochs {opts.epochs}")
    g = res.group(what, how)
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
    res.write(_results.out_path(opts, name))
    return 0 if res.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
