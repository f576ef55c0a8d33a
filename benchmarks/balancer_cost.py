"""What one balancer decision costs at 64, 256 and 1024 workers (issue 14, "Speed").

    python benchmarks/balancer_cost.py [--workers 64,256,1024] [--repeats 5] [--json OUT]

For each policy and worker count W (4 shards per worker, 10% of workers 4x slow, every
worker has reported for a while, so rates are known): the median and spread over
``--repeats`` of one ``rebalance`` (from an even plan, the moves the slow workers need),
of one ``next_shard`` (a worker asking for its prefetch shard mid-epoch) and of one
``plan_epoch``. The last column is the ratio to the 64-worker figure divided by
(W log W)/(64 log 64): at most about 1 means the cost grows no faster than W log W.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpilb.core.balancer import BalancerConfig, build_balancer  # noqa: E402

POLICIES = ["static", "demand", "load", "predictive"]


def setup(policy: str, w: int):
    workers = list(range(1, w + 1))
    sizes = [1000] * (4 * w)
    bal = build_balancer(policy, workers, sizes, BalancerConfig(batch=32))
    slow = set(workers[:: 10])
    t = 0.0
    for step in range(30):            # every worker reports: rates known
        t += 0.32
        for r in workers:
            rate = 25.0 if r in slow else 100.0
            bal.observe(r, t, 32, 32 / rate, comm_s=0.001)
    bal.plan_epoch(0, list(range(len(sizes))))
    return bal, workers


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(policy: str, w: int, repeats: int) -> dict:
    out = {"rebalance": [], "next_shard": [], "plan_epoch": []}
    for _ in range(repeats):
        bal, workers = setup(policy, w)
        committed = {r: 500 for r in workers}
        out["rebalance"].append(timed(lambda: bal.rebalance(10.0, committed)))
        for r in workers[: w // 2]:   # half the workers hold one shard already
            bal.next_shard(r)
        asker = workers[-1]
        bal.next_shard(asker)
        out["next_shard"].append(timed(lambda: bal.next_shard(asker)))
        out["plan_epoch"].append(timed(lambda: bal.plan_epoch(1, list(range(4 * w)))))
    return {k: (statistics.median(v), max(v) - min(v)) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="64,256,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--before", help="JSON of the same script run on the code before the "
                    "changes (shown beside, as a ratio)")
    ap.add_argument("--doc", help="write the table between <!-- cost:begin --> and "
                    "<!-- cost:end --> of this markdown file")
    opts = ap.parse_args()
    counts = [int(c) for c in opts.workers.split(",")]
    rows = []
    print(f"{'policy':<11} {'workers':>7} {'op':<11} {'median ms':>10} {'spread ms':>10} {'vs W log W':>10}")
    for policy in POLICIES:
        base = None
        for w in counts:
            res = measure(policy, w, opts.repeats)
            if base is None:
                base = (w, res)
            for op, (med, spread) in res.items():
                b_w, b_res = base
                scale = (w * math.log(w)) / (b_w * math.log(b_w))
                growth = (med / b_res[op][0]) / scale if b_res[op][0] > 0 else float("nan")
                rows.append({"policy": policy, "workers": w, "op": op, "median_s": med,
                             "spread_s": spread, "growth_vs_wlogw": growth})
                print(f"{policy:<11} {w:>7} {op:<11} {med * 1e3:>10.3f} {spread * 1e3:>10.3f} {growth:>10.2f}",
                      flush=True)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if opts.doc:
        write_doc(opts.doc, rows, opts.before)


def write_doc(path: str, rows: list[dict], before_path: str | None) -> None:
    import re

    before = {}
    if before_path:
        with open(before_path) as fh:
            before = {(r["policy"], r["workers"], r["op"]): r for r in json.load(fh)}
    md = ["| policy | workers | decision | median ms | spread ms | growth / W log W | before: median ms |",
          "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        b = before.get((r["policy"], r["workers"], r["op"]))
        md.append(f"| {r['policy']} | {r['workers']} | {r['op']} | {r['median_s'] * 1e3:.3f} | "
                  f"{r['spread_s'] * 1e3:.3f} | {r['growth_vs_wlogw']:.2f} | "
                  + (f"{b['median_s'] * 1e3:.3f} |" if b else "not measured |"))
    md += ["", f"`python benchmarks/balancer_cost.py --doc docs/simulate.md` (median of the repeats; "
           f"load average {os.getloadavg()[0]:.1f}: other jobs shared the 2 cores, so single "
           f"figures are noisy). \"before\": the same script on the balancer as it was before "
           f"these changes (commit 80d611f); \"not measured\": it had not finished after an hour."]
    with open(path) as fh:
        doc = fh.read()
    block = "<!-- cost:begin -->\n" + "\n".join(md) + "\n<!-- cost:end -->"
    doc, n = re.subn(r"<!-- cost:begin -->.*?<!-- cost:end -->", lambda _: block, doc, flags=re.S)
    if n != 1:
        sys.exit(f"{path}: no <!-- cost:begin --> ... <!-- cost:end --> block")
    with open(path, "w") as fh:
        fh.write(doc)


if __name__ == "__main__":
    main()
