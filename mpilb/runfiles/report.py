"""`mpilb report`: the summary of a run log, as text or JSON, plots, CSV and run comparison.

The summary is computed from the log's columns and a few root attributes, so the same
function serves a finished run (its summary is stored in the log) and a killed one (whose
columns survive up to the last flush).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from mpilb.runfiles import efficiency as eff
from mpilb.errors import UsageError
from mpilb.runfiles.runlog import file_kind, read_columns, write_csv
from mpilb.runfiles.logattrs import format_layout, json_attr as _json_attr, store_ranks  # noqa: F401

SUMMARY_KEYS = (
    "status", "mode", "balancer", "batch_policy", "store", "correction", "workers", "wall_s",
    "train_s", "samples", "samples_per_s", "updates", "epochs_completed", "epoch_s",
    "utilization", "final_test_accuracy", "best_test_accuracy", "metric", "final_test_metric",
    "best_test_metric", "final_train_loss", "time_to_target_s", "staleness", "shard_moves",
    "bytes_moved", "lost_workers", "coverage", "server_cpu_s", "per_worker", "servers",
    "efficiency",
)

# The training loss reported for a run (or a worker) is the sample-weighted mean of the
# per-sample loss over its last LOSS_WINDOW of updates (at least one update): a single
# batch's loss is too noisy to compare runs by.
LOSS_WINDOW = 0.05
# Metrics where lower is better (the best value is the minimum).
LOWER_IS_BETTER = ("loss", "mse", "mae", "rmse")
# Settings that never change what a run computes: left out of "settings that differ".
NOT_SETTINGS = ("log", "checkpoint", "progress", "progress_interval", "tensorboard",
                "overwrite", "resume")


def run_config(attrs: dict) -> dict:
    """The run's configuration (root attribute `config`), with `workers` added."""
    config = dict(_json_attr(attrs, "config", {}))
    # the store ranks hold parameters (--servers), the others work
    config["workers"] = max(1, int(attrs.get("world_size", 1)) - len(store_ranks(attrs, config)))
    return config


def loss_window(n: int) -> int:
    """Updates averaged into a reported training loss, out of `n`."""
    return max(1, int(np.ceil(n * LOSS_WINDOW)))


def smoothed_loss(loss: np.ndarray, batch: np.ndarray, window: Optional[int] = None) -> np.ndarray:
    """Sample-weighted rolling mean of per-sample losses over `window` updates.

    Element i averages updates max(0, i-window+1)..i, each weighted by its batch; non-finite
    losses are skipped. `window` defaults to :func:`loss_window` of the series' length.

    Returns:
        An array as long as `loss` (NaN where the window holds no finite loss).
    """
    loss = np.asarray(loss, dtype=np.float64)
    if loss.size == 0:
        return np.zeros(0)
    w = np.asarray(batch, dtype=np.float64) * np.isfinite(loss)
    window = window or loss_window(loss.size)
    csum = np.concatenate([[0.0], np.cumsum(np.where(w > 0, loss * w, 0.0))])
    cw = np.concatenate([[0.0], np.cumsum(w)])
    hi = np.arange(1, loss.size + 1)
    lo = np.maximum(0, hi - window)
    weight = cw[hi] - cw[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(weight > 0, (csum[hi] - csum[lo]) / np.where(weight > 0, weight, 1), np.nan)


def final_loss(loss: np.ndarray, batch: np.ndarray) -> Optional[float]:
    """The reported training loss: the last value of :func:`smoothed_loss` (None if none)."""
    s = smoothed_loss(loss, batch)
    return float(s[-1]) if s.size and np.isfinite(s[-1]) else None


def metric_columns(attrs: dict, ev: dict) -> tuple[str, np.ndarray]:
    """(metric name, its column in eval/): `test_metric` when logged, else test accuracy."""
    name = str(attrs.get("metric") or "accuracy")
    col = ev.get("test_metric")
    if col is None or col.size != ev["t"].size or (col.size and np.isnan(col).all()):
        col = ev["test_accuracy"]
    return name, np.asarray(col, dtype=np.float64)


def _best(values: np.ndarray, name: str) -> Optional[float]:
    v = values[np.isfinite(values)]
    if not v.size:
        return None
    return float(v.min() if name in LOWER_IS_BETTER else v.max())


def _last(values: np.ndarray) -> Optional[float]:
    return float(values[-1]) if values.size and np.isfinite(values[-1]) else None


def _time_to_target(config: dict, name: str, ev: dict, metric: np.ndarray) -> Optional[float]:
    acc_target, metric_target = config.get("target_accuracy"), config.get("target_metric")
    for target, values in ((acc_target, ev["test_accuracy"]), (metric_target, metric)):
        if target is None or not values.size:
            continue
        lower = values is metric and name in LOWER_IS_BETTER
        hit = np.nonzero(values <= target if lower else values >= target)[0]
        if hit.size:
            return float(ev["t"][hit[0]])
    return None


def _per_worker(world: int, up: dict, wk: dict, stores=(0,)) -> list[dict]:
    ranks = sorted(set(int(w) for w in wk["worker"])) if wk["worker"].size else []
    if world > 1:
        ranks = sorted(set(ranks) | (set(range(world)) - set(stores)))
    out = []
    for r in ranks:
        m = wk["worker"] == r
        um = up["worker"] == r
        out.append({
            "rank": r,
            "samples": int(up["batch"][um].astype(np.int64).sum()),
            "compute_s": float(wk["compute_s"][m].sum()),
            "io_s": float(wk["io_s"][m].sum()),
            "comm_s": float(wk["comm_s"][m].sum()),
            "idle_s": float(wk["idle_s"][m].sum()),
            "mean_batch": float(up["batch"][um].mean()) if um.any() else 0.0,
            "train_loss": final_loss(up["loss"][um], up["batch"][um]),
        })
    return out


def summarize(attrs: dict, cols: dict) -> dict:
    """Build the summary object (docs/logs.md, "Summary keys") from a log's root attributes and columns."""
    config = run_config(attrs)
    up, wk, ev, sh, ep = (cols[g] for g in ("updates", "workers", "eval", "shards", "epochs"))
    world = int(attrs.get("world_size", 1))
    samples = int(up["batch"].astype(np.int64).sum())
    train_s = float(attrs.get("train_s", up["t"].max() if up["t"].size else 0.0))
    wall_s = float(attrs.get("wall_s", train_s))
    acc = np.asarray(ev["test_accuracy"], dtype=np.float64)
    name, metric = metric_columns(attrs, ev)
    st = up["staleness"].astype(np.float64)
    staleness = ({"mean": float(st.mean()), "p50": float(np.percentile(st, 50)),
                  "p99": float(np.percentile(st, 99)), "max": int(st.max())} if st.size else
                 {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0})
    return {
        "status": attrs.get("status", "running"),
        "mode": config.get("mode"),
        "balancer": config.get("balancer"),
        "batch_policy": config.get("batch_policy"),
        "store": config.get("store"),
        "correction": config.get("correction"),
        "workers": config["workers"],
        "wall_s": wall_s,
        "train_s": train_s,
        "samples": samples,
        "samples_per_s": samples / train_s if train_s > 0 else 0.0,
        "updates": int(up["t"].size),
        "epochs_completed": int(ep["epoch"].size),
        "epoch_s": [float(b - a) for a, b in zip(ep["t_start"], ep["t_end"])],
        "utilization": [float(u) for u in ep["utilization"]],
        "final_test_accuracy": _last(acc),
        "best_test_accuracy": _best(acc, "accuracy"),
        "metric": name,
        "final_test_metric": _last(metric),
        "best_test_metric": _best(metric, name),
        "final_train_loss": final_loss(up["loss"], up["batch"]),
        "time_to_target_s": _time_to_target(config, name, ev, metric),
        "staleness": staleness,
        "shard_moves": int(np.count_nonzero(sh["event"] == "move")),
        "bytes_moved": int(sh["bytes"].astype(np.int64).sum()),
        "lost_workers": _json_attr(attrs, "lost_workers", []),
        "coverage": _coverage(attrs),
        "server_cpu_s": float(attrs.get("server_cpu_s", 0.0)),
        "per_worker": _per_worker(world, up, wk, store_ranks(attrs, config)),
        "servers": _servers(attrs, cols["servers"]),
        "efficiency": _efficiency(config, up, ev),
    }


def _coverage(attrs: dict) -> dict:
    """The log's `coverage`; zeros where it holds none (JSON null: a run that ended before
    it was counted) or not the four counts, as for a run that has not closed its log."""
    keys = ("expected", "applied", "duplicates", "missing")
    cov = _json_attr(attrs, "coverage", None)
    if not isinstance(cov, dict) or not all(isinstance(cov.get(k), int) for k in keys):
        return dict.fromkeys(keys, 0)
    return {k: cov[k] for k in keys}


def _efficiency(config: dict, up: dict, ev: dict) -> dict:
    """Samples to the target, staleness and effective momentum per worker, warnings
    (mpilb/runfiles/efficiency.py); `--compare` adds samples against a reference run."""
    e = eff.efficiency(config, up, ev)
    return {"samples_to_target": e["samples_to_target"], "per_worker": e["per_worker"],
            "warnings": e["warnings"]}


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
    if file_kind(attrs) != "log":
        what = ("an mpilb checkpoint" if file_kind(attrs) == "checkpoint" else
                "an HDF5 file without a run log's attributes (a dataset shard?)")
        raise UsageError(f"{path}: not an mpilb run log: {what}")
    return attrs, cols


def summarize_log(path: str) -> dict:
    attrs, cols = open_log(path)
    return summarize(attrs, cols)


def _num(value, fmt: str = ".4f") -> str:
    return "n/a" if value is None else format(value, fmt)


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
    lines.append(f"  train loss {_num(s['final_train_loss'])} (mean per sample over the last "
                 f"{LOSS_WINDOW:.0%} of updates)")
    fm, bm = s["final_test_metric"], s["best_test_metric"]
    if fm is not None:
        lines.append(f"  test {s['metric']}: final {fm:.4f}, best {bm:.4f}"
                     + (f", target reached at {s['time_to_target_s']:.1f} s"
                        if s["time_to_target_s"] is not None else ""))
    else:
        lines.append(f"  test {s['metric']}: n/a (no evaluation in the log)")
    st = s["staleness"]
    lines.append(f"  staleness: mean {st['mean']:.2f}, p50 {st['p50']:.0f}, p99 {st['p99']:.0f}, max {st['max']}")
    cov = s["coverage"]
    lines.append(f"  coverage: {cov['applied']}/{cov['expected']} applied, "
                 f"{cov['duplicates']} duplicates, {cov['missing']} missing")
    lines.append(f"  shard moves {s['shard_moves']}, bytes moved {s['bytes_moved']}"
                 + (f", lost workers {s['lost_workers']}" if s["lost_workers"] else ""))
    if s["epoch_s"]:
        lines.append("  epoch   seconds  utilization")
        # numbered from 1, as the progress line does (the log's `epoch` index is i - 1)
        for i, (t, u) in enumerate(zip(s["epoch_s"], s["utilization"]), start=1):
            lines.append(f"  {i:5d}  {t:8.2f}  {u:11.2f}")
    if len(s.get("servers", [])) > 1:
        lines.append("  store   params   updates  MB in  MB out  cpu_s")
        for v in s["servers"]:
            lines.append(f"  {v['rank']:5d}  {v['params']:7d}  {v['updates']:8d}  "
                         f"{v['bytes_in'] / 1e6:5.1f}  {v['bytes_out'] / 1e6:6.1f}  {v['cpu_s']:5.2f}")
    e = s.get("efficiency") or {}
    if e.get("per_worker"):
        lines.append("  rank  staleness_mean  staleness_p99  effective_momentum")
        for w in e["per_worker"]:
            lines.append(f"  {w['rank']:4d}  {w['staleness_mean']:14.2f}  {w['staleness_p99']:13.0f}"
                         f"  {w['effective_momentum']:18.2f}")
    if e.get("samples_to_target") is not None:
        lines.append(f"  samples to the target: {e['samples_to_target']}")
    for w in e.get("warnings", []):
        lines.append(f"  warning: {w}")
    if s["per_worker"]:
        lines.append("  rank   samples  compute_s   io_s  comm_s  idle_s  mean_batch  train_loss")
        for w in s["per_worker"]:
            lines.append(f"  {w['rank']:4d}  {w['samples']:8d}  {w['compute_s']:9.2f}  "
                         f"{w['io_s']:5.2f}  {w['comm_s']:6.2f}  {w['idle_s']:6.2f}  "
                         f"{w['mean_batch']:10.1f}  {_num(w['train_loss']):>10}")
    return "\n".join(lines)


def differing_settings(configs: list[dict]) -> list[str]:
    """Configuration keys whose values are not the same in every run, in a stable order."""
    keys = sorted(set().union(*configs) - set(NOT_SETTINGS)) if configs else []
    return [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1]


def setting_text(config: dict, key: str) -> str:
    value = config.get(key)
    if isinstance(value, list):
        value = " ".join(map(str, value)) or "none"
    return f"{key}={value}"


def format_compare(paths: list[str], summaries: list[dict], configs: list[dict]) -> str:
    """Runs side by side, one column per run, then the settings that differ between them."""
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
        ("final train loss", lambda s: "-" if s["final_train_loss"] is None else f"{s['final_train_loss']:.4f}"),
        ("final metric", lambda s: "-" if s["final_test_metric"] is None
         else f"{s['metric']} {s['final_test_metric']:.4f}"),
        ("time to target s", lambda s: "-" if s["time_to_target_s"] is None else f"{s['time_to_target_s']:.1f}"),
        ("staleness mean", lambda s: f"{s['staleness']['mean']:.2f}"),
        ("samples to target", lambda s: "-" if (s.get("efficiency") or {}).get("samples_to_target") is None
         else s["efficiency"]["samples_to_target"]),
        ("shard moves", lambda s: s["shard_moves"]),
        ("bytes moved", lambda s: s["bytes_moved"]),
    ]
    names = [p.rsplit("/", 1)[-1] for p in paths]
    table = [[str(fn(s)) for s in summaries] for _, fn in rows]
    differ = differing_settings(configs)
    settings = [[setting_text(c, k).split("=", 1)[1] for c in configs] for k in differ]
    width = max(12, *(len(v) for row in [names] + table + settings for v in row))
    out = ["".ljust(18) + "".join(n.rjust(width + 2) for n in names)]
    for (label, _), cells in zip(rows, table):
        out.append(label.ljust(18) + "".join(v.rjust(width + 2) for v in cells))
    if differ:
        out.append("settings that differ:")
        for key, cells in zip(differ, settings):
            out.append(f"  {key}".ljust(18) + "".join(v.rjust(width + 2) for v in cells))
    else:
        out.append("settings that differ: none (same configuration)")
    ref = next((i for i, s in enumerate(summaries) if "against_reference" in s.get("efficiency", {})), None)
    if ref is not None:
        base = summaries[ref]["efficiency"]["reference"]
        out.append(f"samples to each accuracy the reference reached (reference {names[base]}; "
                   f"x its samples):")
        for i, level in enumerate(summaries[ref]["efficiency"]["against_reference"]):
            cells = []
            for s in summaries:
                row = s["efficiency"]["against_reference"][i]
                cells.append("never" if row["samples"] is None else
                             f"{row['samples']}" + ("" if row["ratio"] is None or row["ratio"] == 1
                                                    else f" ({row['ratio']:.2f}x)"))
            out.append(f"  {level['accuracy']:.3f}".ljust(18) + "".join(v.rjust(width + 2) for v in cells))
    for name, s in zip(names, summaries):
        for w in (s.get("efficiency") or {}).get("warnings", []):
            out.append(f"warning: {name}: {w}")
    return "\n".join(out)


def reference_index(configs: list[dict]) -> int:
    """The run the others are measured against: the first sync or serial one, else the first."""
    for i, c in enumerate(configs):
        if c.get("mode") == "sync" or c.get("workers", 1) <= 1 and c.get("world_size", 2) == 1:
            return i
    return 0


def add_reference(logs: list[tuple[dict, dict]], summaries: list[dict]) -> None:
    """Each summary's efficiency gains `against_reference`: samples to each accuracy the
    reference run reached, and their ratio to the reference's (`reference`: its index)."""
    configs = [dict(run_config(a), world_size=int(a.get("world_size", 1))) for a, _ in logs]
    ref = reference_index(configs)
    ref_cols = logs[ref][1]
    ref_curve = (eff.samples_at_evals(ref_cols["updates"], ref_cols["eval"]),
                 np.asarray(ref_cols["eval"]["test_accuracy"], dtype=np.float64))
    for (attrs, cols), s in zip(logs, summaries):
        curve = (eff.samples_at_evals(cols["updates"], cols["eval"]),
                 np.asarray(cols["eval"]["test_accuracy"], dtype=np.float64))
        s["efficiency"]["against_reference"] = eff.against_reference(curve, ref_curve)
        s["efficiency"]["reference"] = ref


def run_report(paths: list[str], as_json: bool = False, plots: Optional[str] = None,
               compare: bool = False, csv: Optional[str] = None) -> int:
    """Entry point of `mpilb report`."""
    logs = [open_log(p) for p in paths]
    summaries = [summarize(attrs, cols) for attrs, cols in logs]
    # with --json, stdout must stay one JSON document
    note = sys.stderr if as_json else sys.stdout
    if plots:
        from mpilb.runfiles.plots import write_plots

        try:
            written = write_plots(paths, plots)
        except OSError as exc:   # a read-only directory, or a file where the directory goes
            raise UsageError(f"--plots {plots}: cannot write the figures there "
                             f"({exc.strerror or exc})") from None
        for w in written:
            print(f"wrote {w}", file=note)
    if csv:
        for path, (_, cols) in zip(paths, logs):
            out = Path(csv) / Path(path).stem if len(paths) > 1 else Path(csv)
            for w in write_csv(cols, out):
                print(f"wrote {w}", file=note)
    if compare or len(paths) > 1:
        add_reference(logs, summaries)
        if as_json:
            print(json.dumps(dict(zip(paths, summaries)), indent=2))
        else:
            print(format_compare(paths, summaries, [run_config(a) for a, _ in logs]))
        return 0
    if as_json:
        print(json.dumps(summaries[0], indent=2))
    else:
        print("\n".join([format_summary(summaries[0], paths[0]), *format_layout(logs[0][0])]))
    return 0
