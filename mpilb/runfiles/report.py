"""`mpilb report`: the summary of a run log (summary.py), as text or JSON, plots, CSV and run
comparison."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from mpilb.core.topology import span
from mpilb.errors import UsageError
from mpilb.mpi.wire_format import wire_format
from mpilb.runfiles import efficiency as eff
from mpilb.runfiles.logattrs import format_layout, json_attr, node_layout, store_ranks
from mpilb.runfiles.plots import counts_text, resume_times, worker_counts, write_plots
from mpilb.runfiles.runlog import write_csv
from mpilb.runfiles.summary import LOSS_WINDOW, differing_settings, open_log, run_config, setting_text, summarize

# `--compare` notes counts known more coarsely than this share of themselves (the
# evaluations' spacing before the one that reached an accuracy)
COARSE = 0.1


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


def format_network(s: dict, attrs: dict) -> list[str]:
    """What the workers that reach a parameter store over the network spent communicating
    (the share of their time, and an exchange's bytes and seconds at the median), after the
    layout; none on one node or when every worker sits beside every store."""
    nodes = node_layout(attrs)
    if len(set(nodes)) < 2:
        return []
    stores = [r for r in store_ranks(attrs) if r < len(nodes)]
    ranks, shares, per_exchange = [], [], []
    for w in s.get("per_worker") or []:
        r = int(w["rank"])
        total = w["compute_s"] + w["io_s"] + w["comm_s"] + w["idle_s"]
        if r >= len(nodes) or total <= 0 or all(nodes[st] == nodes[r] for st in stores):
            continue
        ranks.append(r)
        shares.append(w["comm_s"] / total)
        pushes = w["samples"] / w["mean_batch"] if w.get("mean_batch") else 0
        if pushes >= 1:
            per_exchange.append(w["comm_s"] / pushes)
    if not ranks:
        return []
    params = sum(int(v.get("params", 0)) for v in json_attr(attrs, "servers", []) or [])
    wire = str(run_config(attrs).get("wire") or "fp32")
    size = params * wire_format(wire).itemsize
    line = (f"  network: rank(s) {span(ranks)} reach a store over the network and spent "
            f"{min(shares):.0%}-{max(shares):.0%} of their time communicating "
            f"(median {float(np.median(shares)):.0%})")
    if per_exchange and size:
        line += (f"; a push and its reply carry {_bytes(size)} each ({wire}), and an "
                 f"exchange took {1e3 * float(np.median(per_exchange)):.1f} ms of "
                 f"communication at the median")
    return [line]


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f} {unit}"
    return f"{n:.0f} B"


_MEMBER_WORDS = {"join": "joined", "leave": "left", "lost": "was lost",
                 "respawn": "started as a replacement"}


def format_members(cols: dict, attrs: dict | None = None) -> list[str]:
    """The run's membership changes (the `members/` group), one line each, after the count
    of workers over time (with the log's root attributes `attrs`): none, no lines."""
    m = cols.get("members") or {}
    if not len(m.get("t", ())):
        return []
    lines = ["  membership changes:"]
    rows = [(float(t), f"rank {int(rank)} {_MEMBER_WORDS.get(str(event), str(event))} (node {int(node)})")
            for t, rank, node, event in zip(m["t"], m["worker"], m["node"], m["event"])]
    if attrs is not None:
        lines.append("    " + counts_text(worker_counts(attrs, cols)))
        rows += [(t, "resumed (--resume: the launch's own ranks from here)") for t in resume_times(attrs)]
    for t, what in sorted(rows, key=lambda r: r[0]):
        lines.append(f"    {t:8.2f} s  {what}")
    return lines


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
        rows = [r for s in summaries for r in s["efficiency"]["against_reference"]]
        worst = eff.coarsest(rows)
        if worst is not None and worst[0] > COARSE * worst[1]:
            counts = [v for r in rows for v in (r["samples"], r["reference_samples"]) if v]
            out.append(f"note: a count is known to the evaluations' spacing, here up to {worst[0]} "
                       f"samples before {worst[1]}: train the runs with --eval-every "
                       f"{max(1, min(counts) // 20)} (an evaluation after every that many samples) "
                       f"for finer counts")
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
        print("\n".join([format_summary(summaries[0], paths[0]), *format_members(logs[0][1], logs[0][0]),
                         *format_layout(logs[0][0]), *format_network(summaries[0], logs[0][0])]))
    return 0
