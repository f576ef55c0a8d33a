"""What relaying a joiner's rows costs rank 0 (`--store local`, server/relay.py).

    python benchmarks/relay.py [--repeats 5] [--epochs 30] [--join-at 1] [--link-rate 1gbit]

A joiner of a `--store local` run reads the shards its node holds; the rows of every other
shard it is given come through rank 0, which receives them from their holder and sends them
on (a joiner is connected to rank 0 only). Each repeat (root: a 3-node cluster in a box,
links shaped to `--link-rate`) runs one pair, back to back, on the built-in dataset:

- *relayed*: `mpiexec -hosts n0:1,n1:2 mpilb train --store local` (rank 0 on n0, workers 1
  and 2 on n1, where every shard is placed), joined `--join-at` seconds after its first
  applied update by `mpiexec -n 1 mpilb join` on n2, a node that holds no shard: every row
  the joiner trains on crosses n1's link to rank 0 and rank 0's link to n2;
- *read locally*: the same run, the same join, but the joiner started on n1: it reads
  every shard from its node's disk and no row is relayed.

Figures: the bytes of rows relayed to the joiner (`shards/` moves to it), rank 0's CPU
seconds (its `servers` entry) in each run and their difference per relayed MB, rank 0's
CPU ÷ wall in each, and the run's samples/s from one second after the join (relayed ÷
read locally, same repeat), with the joiner's share of those samples. No targets: issue
#29 asks what the relay costs rank 0, and the docs say it. Writes
benchmarks/results/relay.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
from membership import exact, mpilb, samples_per_s, wait_first_update  # noqa: E402

NAME = "relay"


def text(values) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def one_run(box, d: str, opts, env: dict, joiner_node: int, label: str) -> dict:
    from mpilb.runfiles.runlog import read_columns

    log = os.path.join(d, f"{label}.h5")
    train = ["train", "--store", "local", "--epochs", str(opts.epochs), "--no-progress",
             "--log", log]
    run = box.popen(0, box.mpiexec_cmd(["-hosts", "n0:1,n1:2", sys.executable, "-m", "mpilb",
                                        *train]),
                    cwd=d, env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_first_update(log, run)
    time.sleep(opts.join_at)
    joiner = box.popen(joiner_node, mpilb(1, "join", log), cwd=d, env=env, text=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    limit = opts.epochs * 20 + 120
    _, jerr = joiner.communicate(timeout=limit)
    _, err = run.communicate(timeout=limit)
    if run.returncode != 0 or joiner.returncode != 0 or "joined as worker 3" not in jerr:
        sys.exit(f"{label}: the run exit {run.returncode}, the joiner {joiner.returncode}\n"
                 f"{err[-2000:]}\n{jerr[-2000:]}")
    attrs, cols = read_columns(log)
    if not exact(attrs):
        sys.exit(f"{label}: coverage not exact: {attrs['coverage']}")
    summary = json.loads(attrs["summary"]) if isinstance(attrs["summary"], str) else attrs["summary"]
    store = [s for s in summary["servers"] if s["rank"] == 0][0]
    sh = cols["shards"]
    relayed = int(sum(int(b) for dst, e, b in zip(sh["dst"], text(sh["event"]), sh["bytes"])
                      if int(dst) == 3 and e == "move"))
    m, up = cols["members"], cols["updates"]
    t_join = float(m["t"][(m["worker"] == 3) & (np.array(text(m["event"])) == "join")][0])
    rate = samples_per_s(up, t_join + 1.0)   # (exits where under 1 s of updates follow)
    after = up["t"] >= t_join + 1.0
    samples = float(up["batch"][after].sum())
    return {"relayed_mb": relayed / 1e6, "cpu_s": float(store["cpu_s"]),
            "cpu_per_wall": float(store["cpu_s"]) / float(summary["train_s"]),
            "rate": rate,
            "joiner_share": float(up["batch"][after & (up["worker"] == 3)].sum()) / samples,
            "join_t": t_join}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--join-at", type=float, default=1.0,
                    help="seconds after the first applied update to start the joiner")
    ap.add_argument("--link-rate", default="1gbit", help="each node's link rate")
    _results.add_output_args(ap, NAME)
    _results.add_box_args(ap)
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.epochs = 1, 12
    from mpilb.clusterbox import ClusterBox, missing

    why = missing()
    if why:
        sys.exit(f"no cluster in a box here: {why}")
    cache = os.environ.get("MPILB_CACHE") or os.path.join(tempfile.gettempdir(), "mpilb-bench-cache")
    env = dict(os.environ, MPILB_CACHE=cache)
    res = _results.Results(NAME, f"Rows relayed to a joiner through rank 0 (cluster in a box, "
                                 f"links {opts.link_rate})", opts)
    pairs = []
    with ClusterBox(nodes=3, link_rate=opts.link_rate, tcp=opts.tcp) as box:
        res.box(box)
        for r in range(opts.repeats):
            d = tempfile.mkdtemp(prefix="mpilb-relay-")
            try:
                pair = {}
                # (alternating which goes first: neither always meets a warmer page cache)
                order = [("relayed", 2), ("local", 1)][:: 1 if r % 2 == 0 else -1]
                for label, node in order:
                    pair[label] = one_run(box, d, opts, env, node, label)
            finally:
                shutil.rmtree(d, ignore_errors=True)
            a, b = pair["relayed"], pair["local"]
            print(f"repeat {r + 1} of {opts.repeats}: relayed {a['relayed_mb']:.1f} MB "
                  f"(read locally: {b['relayed_mb']:.1f} MB); rank 0 CPU {a['cpu_s']:.2f} s "
                  f"against {b['cpu_s']:.2f} s; samples/s after the join {a['rate']:.0f} against "
                  f"{b['rate']:.0f} ({a['rate'] / b['rate']:.2f}x); the joiner's share "
                  f"{a['joiner_share']:.2f} against {b['joiner_share']:.2f}", flush=True)
            pairs.append(pair)
    what = (f"a `--store local` run (rank 0 on n0, workers 1 and 2 on n1) joined {opts.join_at:g} s "
            f"in by a worker on n2 (no shard: every row relayed) or on n1 (every shard on its "
            f"disk), the built-in dataset, {opts.epochs} epochs, links {opts.link_rate}")
    how = ("mpilb box: mpiexec -hosts n0:1,n1:2 mpilb train --store local "
           f"--epochs {opts.epochs} --log run.h5; on n2 (or n1): mpiexec -n 1 mpilb join run.h5")
    g = res.group(what, how)
    rel = [p["relayed"] for p in pairs]
    loc = [p["local"] for p in pairs]
    res.figure(g, "relayed_mb", "rows relayed to the joiner on n2, MB", [x["relayed_mb"] for x in rel],
               unit="MB", digits=1)
    res.figure(g, "local_mb", "rows sent to the joiner on n1, MB", [x["relayed_mb"] for x in loc],
               unit="MB", digits=1)
    res.figure(g, "cpu_relayed", "rank 0 CPU seconds, joiner on n2", [x["cpu_s"] for x in rel], unit="s",
               digits=2)
    res.figure(g, "cpu_local", "rank 0 CPU seconds, joiner on n1", [x["cpu_s"] for x in loc], unit="s",
               digits=2)
    res.figure(g, "cpu_per_mb", "rank 0 CPU ms per MB relayed (the pair's difference)",
               [1e3 * (a["cpu_s"] - b["cpu_s"]) / max(a["relayed_mb"] - b["relayed_mb"], 1e-9)
                for a, b in zip(rel, loc)], unit="ms/MB", digits=2)
    res.figure(g, "cpu_wall_relayed", "rank 0 CPU ÷ wall, joiner on n2",
               [x["cpu_per_wall"] for x in rel], digits=3)
    res.figure(g, "cpu_wall_local", "rank 0 CPU ÷ wall, joiner on n1",
               [x["cpu_per_wall"] for x in loc], digits=3)
    res.figure(g, "rate_ratio", "samples/s from 1 s after the join: joiner on n2 ÷ on n1",
               [a["rate"] / b["rate"] for a, b in zip(rel, loc)], unit="x")
    res.figure(g, "share_relayed", "the joiner's share of those samples, on n2",
               [x["joiner_share"] for x in rel], digits=2)
    res.figure(g, "share_local", "the joiner's share of those samples, on n1",
               [x["joiner_share"] for x in loc], digits=2)
    res.write(_results.out_path(opts, NAME))
    return 0


if __name__ == "__main__":
    sys.exit(main())
