"""What a run log says: its summary (docs/logs.md, "Summary keys"), its configuration and
the settings that differ between runs. Computed from the log's columns and a few root
attributes, so the same function serves a finished run (its summary is stored in the log)
and a killed one (whose columns survive up to the last flush).

The runtime (the summary a run prints and returns) and the report command both use it;
the report's text, plots and comparisons are built on it in report.py and plots/.
"""

from __future__ import annotations

import json
from typing import Optional

import numpy as np

from mpilb.errors import UsageError
from mpilb.runfiles import efficiency as eff
from mpilb.runfiles.logattrs import json_attr as _json_attr, store_ranks
from mpilb.runfiles.runlog import file_kind, read_columns

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


def differing_settings(configs: list[dict]) -> list[str]:
    """Configuration keys whose values are not the same in every run, in a stable order."""
    keys = sorted(set().union(*configs) - set(NOT_SETTINGS)) if configs else []
    return [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1]


def setting_text(config: dict, key: str) -> str:
    value = config.get(key)
    if isinstance(value, list):
        value = " ".join(map(str, value)) or "none"
    return f"{key}={value}"
