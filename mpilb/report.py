"""`mpilb report`: the summary of a run log, as text or JSON, plots, and run comparison.

The summary is computed from the log's columns and a few root attributes, so the same
function serves a finished run (its summary is stored in the log) and a killed one (whose
columns survive up to the last flush).
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import numpy as np

from .errors import UsageError
from .runlog import read_columns

SUMMARY_KEYS = (
    "status", "mode", "balancer", "batch_policy", "store", "correction", "workers", "wall_s",
    "train_s", "samples", "samples_per_s", "updates", "epochs_completed", "epoch_s",
    "utilization", "final_test_accuracy", "best_test_accuracy", "metric", "final_test_metric",
    "best_test_metric", "time_to_target_s",
    "staleness", "shard_moves", "bytes_moved", "lost_workers", "coverage", "server_cpu_s",
    "per_worker",
)


def _json_attr(attrs: dict, key: str, default):
    value = attrs.get(key)
    if value is None:
        return default
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return default


def summarize(attrs: dict, cols: dict) -> dict:
    """Build DESIGN.md's summary object from a log's root attributes and columns."""
    config = _json_attr(attrs, "config", {})
    up, wk, ev, sh, ep = (cols[g] for g in ("updates", "workers", "eval", "shards", "epochs"))
    world = int(attrs.get("world_size", 1))
    workers = max(1, world - 1)
    batch = up["batch"].astype(np.int64)
    samples = int(batch.sum())
    updates_t = up["t"]
    train_s = float(attrs.get("train_s", updates_t.max() if updates_t.size else 0.0))
    wall_s = float(attrs.get("wall_s", train_s))
    acc = ev["test_accuracy"]
    if acc.size and np.isnan(acc).all():
        acc = np.zeros(0)             # not a classifier: no accuracy to report
    metric = ev["test_metric"] if ev["test_metric"].size == ev["t"].size else acc
    time_to_target = None
    # the metric --target-* decided on: validation's when one was held out
    decided = ev["val_metric"] if (ev["val_metric"].size == ev["t"].size and ev["t"].size
                                   and not np.isnan(ev["val_metric"]).all()) else metric
    for target, values in ((config.get("target_accuracy"), acc),
                           (config.get("target_metric"), decided)):
        if target is not None and values.size:
            hit = np.nonzero(values >= target)[0]
            if hit.size:
                t_hit = float(ev["t"][hit[0]])
                time_to_target = t_hit if time_to_target is None else min(time_to_target, t_hit)
    st = up["staleness"].astype(np.float64)
    staleness = ({"mean": float(st.mean()), "p50": float(np.percentile(st, 50)),
                  "p99": float(np.percentile(st, 99)), "max": int(st.max())} if st.size else
                 {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0})
    events = sh["event"]
    per_worker = []
    ranks = sorted(set(int(w) for w in wk["worker"])) if wk["worker"].size else []
    if world > 1:
        ranks = sorted(set(ranks) | set(range(1, world)))
    for r in ranks:
        m = wk["worker"] == r
        um = up["worker"] == r
        per_worker.append({
            "rank": r,
            "samples": int(up["batch"][um].astype(np.int64).sum()),
            "compute_s": float(wk["compute_s"][m].sum()),
            "io_s": float(wk["io_s"][m].sum()),
            "comm_s": float(wk["comm_s"][m].sum()),
            "idle_s": float(wk["idle_s"][m].sum()),
            "mean_batch": float(up["batch"][um].mean()) if um.any() else 0.0,
        })
    status = attrs.get("status", "running")
    summary = {
        "status": status,
        "mode": config.get("mode"),
        "balancer": config.get("balancer"),
        "batch_policy": config.get("batch_policy"),
        "store": config.get("store"),
        "correction": config.get("correction"),
        "workers": workers,
        "wall_s": wall_s,
        "train_s": train_s,
        "samples": samples,
        "samples_per_s": samples / train_s if train_s > 0 else 0.0,
        "updates": int(up["t"].size),
        "epochs_completed": int(ep["epoch"].size),
        "epoch_s": [float(b - a) for a, b in zip(ep["t_start"], ep["t_end"])],
        "utilization": [float(u) for u in ep["utilization"]],
        "final_test_accuracy": float(acc[-1]) if acc.size else None,
        "best_test_accuracy": float(acc.max()) if acc.size else None,
        "metric": str(attrs.get("metric", "accuracy")),
        "final_test_metric": float(metric[-1]) if metric.size else None,
        "best_test_metric": float(np.nanmax(metric)) if metric.size and not np.isnan(metric).all() else None,
        "time_to_target_s": time_to_target,
        "staleness": staleness,
        "shard_moves": int(np.count_nonzero(events == "move")),
        "bytes_moved": int(sh["bytes"].astype(np.int64).sum()),
        "lost_workers": _json_attr(attrs, "lost_workers", []),
        "coverage": _json_attr(attrs, "coverage",
                               {"expected": 0, "applied": 0, "duplicates": 0, "missing": 0}),
        "server_cpu_s": float(attrs.get("server_cpu_s", 0.0)),
        "per_worker": per_worker,
    }
    return summary


def open_log(path: str) -> tuple[dict, dict]:
    try:
        return read_columns(path)
    except FileNotFoundError:
        raise UsageError(f"{path}: run log not found") from None
    except OSError as exc:
        raise UsageError(f"{path}: not a readable mpilb run log ({exc})") from None


def summarize_log(path: str) -> dict:
    attrs, cols = open_log(path)
    return summarize(attrs, cols)


def format_summary(s: dict, path: str = "") -> str:
    """Human-readable report of one summary."""
    lines = []
    head = f"run {path}" if path else "run"
    lines.append(f"{head}: status {s['status']}"
                 + ("  (INCOMPLETE: the run did not finish; figures up to its last flush)"
                    if s["status"] == "running" else ""))
    lines.append(f"  mode {s['mode']}, balancer {s['balancer']}, batch policy {s['batch_policy']}, "
                 f"store {s['store']}, correction {s['correction']}, workers {s['workers']}")
    lines.append(f"  {s['samples']} samples, {s['updates']} updates in {s['train_s']:.2f} s: "
                 f"{s['samples_per_s']:.0f} samples/s; server CPU {s['server_cpu_s']:.1f} s")
    fa, ba = s["final_test_accuracy"], s["best_test_accuracy"]
    if fa is None and s.get("final_test_metric") is not None:
        lines.append(f"  test {s['metric']}: final {s['final_test_metric']:.4f}, best "
                     f"{s['best_test_metric']:.4f}"
                     + (f", target reached at {s['time_to_target_s']:.1f} s"
                        if s["time_to_target_s"] is not None else ""))
    if fa is not None:
        lines.append(f"  test accuracy: final {fa:.4f}, best {ba:.4f}"
                     + (f", target reached at {s['time_to_target_s']:.1f} s"
                        if s["time_to_target_s"] is not None else ""))
    st = s["staleness"]
    lines.append(f"  staleness: mean {st['mean']:.2f}, p50 {st['p50']:.0f}, p99 {st['p99']:.0f}, max {st['max']}")
    cov = s["coverage"]
    lines.append(f"  coverage: {cov['applied']}/{cov['expected']} applied, "
                 f"{cov['duplicates']} duplicates, {cov['missing']} missing")
    lines.append(f"  shard moves {s['shard_moves']}, bytes moved {s['bytes_moved']}"
                 + (f", lost workers {s['lost_workers']}" if s["lost_workers"] else ""))
    if s["epoch_s"]:
        lines.append("  epoch   seconds  utilization")
        for i, (t, u) in enumerate(zip(s["epoch_s"], s["utilization"])):
            lines.append(f"  {i:5d}  {t:8.2f}  {u:11.2f}")
    if s["per_worker"]:
        lines.append("  rank   samples  compute_s   io_s  comm_s  idle_s  mean_batch")
        for w in s["per_worker"]:
            lines.append(f"  {w['rank']:4d}  {w['samples']:8d}  {w['compute_s']:9.2f}  "
                         f"{w['io_s']:5.2f}  {w['comm_s']:6.2f}  {w['idle_s']:6.2f}  "
                         f"{w['mean_batch']:10.1f}")
    return "\n".join(lines)


def format_compare(paths: list[str], summaries: list[dict]) -> str:
    """Runs side by side, one column per run."""
    rows = [
        ("status", lambda s: s["status"]),
        ("mode", lambda s: s["mode"]),
        ("balancer", lambda s: s["balancer"]),
        ("batch_policy", lambda s: s["batch_policy"]),
        ("workers", lambda s: s["workers"]),
        ("train_s", lambda s: f"{s['train_s']:.2f}"),
        ("samples/s", lambda s: f"{s['samples_per_s']:.0f}"),
        ("mean epoch s", lambda s: f"{np.mean(s['epoch_s']):.2f}" if s["epoch_s"] else "-"),
        ("mean utilization", lambda s: f"{np.mean(s['utilization']):.2f}" if s["utilization"] else "-"),
        ("final accuracy", lambda s: "-" if s["final_test_accuracy"] is None else f"{s['final_test_accuracy']:.4f}"),
        ("time to target s", lambda s: "-" if s["time_to_target_s"] is None else f"{s['time_to_target_s']:.1f}"),
        ("staleness mean", lambda s: f"{s['staleness']['mean']:.2f}"),
        ("shard moves", lambda s: s["shard_moves"]),
        ("bytes moved", lambda s: s["bytes_moved"]),
    ]
    names = [p.rsplit("/", 1)[-1] for p in paths]
    width = max(12, *(len(n) for n in names))
    out = ["".ljust(18) + "".join(n.rjust(width + 2) for n in names)]
    for label, fn in rows:
        out.append(label.ljust(18) + "".join(str(fn(s)).rjust(width + 2) for s in summaries))
    return "\n".join(out)


def run_report(paths: list[str], as_json: bool = False, plots: Optional[str] = None,
               compare: bool = False) -> int:
    """Entry point of `mpilb report`."""
    summaries = []
    for p in paths:
        attrs, cols = open_log(p)
        summaries.append(summarize(attrs, cols))
    if plots:
        from .plots import write_plots

        written = write_plots(paths, plots)
        for w in written:
            # with --json, stdout must stay one JSON document
            print(f"wrote {w}", file=sys.stderr if as_json else sys.stdout)
    if compare or len(paths) > 1:
        if as_json:
            print(json.dumps(dict(zip(paths, summaries)), indent=2))
        else:
            print(format_compare(paths, summaries))
        return 0
    if as_json:
        print(json.dumps(summaries[0], indent=2))
    else:
        print(format_summary(summaries[0], paths[0]))
    return 0
