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
    "utilization", "final_test_accuracy", "best_test_accuracy", "time_to_target_s",
    "staleness", "shard_moves", "bytes_moved", "lost_workers", "coverage", "server_cpu_s",
    "per_worker", "servers",
)


def _json_attr(attrs: dict, key: str, default):
    value = attrs.get(key)
    if value is None:
        return default
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return default


def _finite_or_none(value) -> Optional[float]:
    value = float(value)
    return value if np.isfinite(value) else None


def summarize(attrs: dict, cols: dict) -> dict:
    """Build DESIGN.md's summary object from a log's root attributes and columns."""
    config = _json_attr(attrs, "config", {})
    up, wk, ev, sh, ep = (cols[g] for g in ("updates", "workers", "eval", "shards", "epochs"))
    world = int(attrs.get("world_size", 1))
    n_servers = int(config.get("servers", 1))   # ranks 0..K-1 hold parameters
    workers = max(1, world - n_servers)
    batch = up["batch"].astype(np.int64)
    samples = int(batch.sum())
    updates_t = up["t"]
    train_s = float(attrs.get("train_s", updates_t.max() if updates_t.size else 0.0))
    wall_s = float(attrs.get("wall_s", train_s))
    acc = ev["test_accuracy"]
    target = config.get("target_accuracy")
    time_to_target = None
    if target is not None and acc.size:
        hit = np.nonzero(acc >= target)[0]
        if hit.size:
            time_to_target = float(ev["t"][hit[0]])
    st = up["staleness"].astype(np.float64)
    staleness = ({"mean": float(st.mean()), "p50": float(np.percentile(st, 50)),
                  "p99": float(np.percentile(st, 99)), "max": int(st.max())} if st.size else
                 {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0})
    events = sh["event"]
    per_worker = []
    ranks = sorted(set(int(w) for w in wk["worker"])) if wk["worker"].size else []
    if world > 1:
        ranks = sorted(set(ranks) | set(range(n_servers, world)))
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
        # non-finite (an empty test set): null, never a bare NaN in the JSON
        "final_test_accuracy": _finite_or_none(acc[-1]) if acc.size else None,
        "best_test_accuracy": _finite_or_none(np.nanmax(acc)) if np.isfinite(acc).any() else None,
        "time_to_target_s": time_to_target,
        "staleness": staleness,
        "shard_moves": int(np.count_nonzero(events == "move")),
        "bytes_moved": int(sh["bytes"].astype(np.int64).sum()),
        "lost_workers": _json_attr(attrs, "lost_workers", []),
        "coverage": _json_attr(attrs, "coverage",
                               {"expected": 0, "applied": 0, "duplicates": 0, "missing": 0}),
        "server_cpu_s": float(attrs.get("server_cpu_s", 0.0)),
        "per_worker": per_worker,
        "servers": _servers(attrs, cols["servers"]),
    }
    return summary


def _servers(attrs: dict, sv: dict) -> list[dict]:
    """Per parameter store: its slice's floats and its counters summed over `servers/`."""
    out = []
    for entry in _json_attr(attrs, "servers", []):
        m = sv["server"] == entry["rank"] if sv["server"].size else np.zeros(0, bool)
        out.append({"rank": int(entry["rank"]), "params": int(entry["params"]),
                    "updates": int(sv["updates"][m].astype(np.int64).sum()),
                    "bytes_in": int(sv["bytes_in"][m].astype(np.int64).sum()),
                    "bytes_out": int(sv["bytes_out"][m].astype(np.int64).sum()),
                    "cpu_s": float(sv["cpu_s"][m].sum())})
    return out


def open_log(path: str) -> tuple[dict, dict]:
    try:
        attrs, cols = read_columns(path)
    except FileNotFoundError:
        raise UsageError(f"{path}: run log not found") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: is a directory, not a run log") from None
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:   # damaged file
        raise UsageError(f"{path}: not a readable mpilb run log ({type(exc).__name__}: {exc})") from None
    if "status" not in attrs:
        what = ("an mpilb checkpoint" if "model" in attrs and "format" in attrs else
                "an HDF5 file without a run log's attributes (a dataset shard?)")
        raise UsageError(f"{path}: not an mpilb run log: {what}")
    return attrs, cols


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
    if len(s.get("servers", [])) > 1:
        lines.append("  store   params   updates  MB in  MB out  cpu_s")
        for v in s["servers"]:
            lines.append(f"  {v['rank']:5d}  {v['params']:7d}  {v['updates']:8d}  "
                         f"{v['bytes_in'] / 1e6:5.1f}  {v['bytes_out'] / 1e6:6.1f}  {v['cpu_s']:5.2f}")
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

        try:
            written = write_plots(paths, plots)
        except OSError as exc:   # a read-only directory, or a file where the directory goes
            raise UsageError(f"--plots {plots}: cannot write the figures there "
                             f"({exc.strerror or exc})") from None
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
