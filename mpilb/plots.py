"""Figures of run logs for `mpilb report --plots DIR` (PNG, matplotlib's Agg backend).

One question per figure. For one run:

- ``timeline.png``: where did each worker's time go (compute, I/O, communication, idle)?
- ``rates.png``: how fast was each worker (measured and predicted samples/s)?
- ``batch.png``: what batch size did each worker use?
- ``staleness.png``: how stale were the gradients, per worker?
- ``shards.png``: which worker held which shard when, and what did the balancer move?
- ``eval.png``: how did test accuracy and loss evolve?

For several runs: ``compare_accuracy.png``, ``compare_rates.png`` and ``compare_epoch_time.png``.

Every figure is written even when its group is empty (a run killed before its first
report, a serial run): it then says so in place of the data, so the set of files a
report produces does not depend on how far the run got.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .runlog import read_columns

# Colours of the parts of a worker's time (timeline) and markers of shard events.
PART_COLOURS = {"compute": "#2a7ab0", "I/O": "#e08a1e", "comm": "#8e5fb5", "idle": "#d64541",
                "untimed": "#d9d9d9"}
EVENT_MARKERS = {"assign": ("o", 14, "none"), "start": (">", 18, None), "done": ("|", 40, None),
                 "move": ("*", 110, None), "reassign": ("X", 80, None)}
OTHER_MARKER = ("x", 30, None)
NO_WORKER = "#7f7f7f"


def write_plots(paths: list[str], out_dir: str) -> list[str]:
    """Write the figures of one run log, or the overlays of several, as PNG files.

    Args:
        paths: run logs; one gives the per-run figures, more than one the comparison.
        out_dir: directory for the PNG files (created if missing).

    Returns:
        The paths of the files written, in a stable order.
    """
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = [_load(p) for p in paths]
    figures = _compare_figures(runs) if len(runs) > 1 else _run_figures(runs[0])
    written = []
    for name, fig in figures:
        path = out / name
        fig.savefig(path, dpi=100, bbox_inches="tight")
        written.append(str(path))
    return written


# --------------------------------------------------------------------------- loading

class _Run:
    """One run log's columns plus what the figures need from its attributes."""

    def __init__(self, path: str, attrs: dict, cols: dict):
        self.path = path
        self.attrs = attrs
        self.cols = cols
        try:
            self.config = json.loads(attrs.get("config", "{}"))
        except (TypeError, ValueError):
            self.config = {}
        self.status = attrs.get("status", "running")
        self.label = Path(path).name
        wk, up, sh = cols["workers"], cols["updates"], cols["shards"]
        ranks = set(wk["worker"].astype(int).tolist()) | set(up["worker"].astype(int).tolist())
        ranks |= set(int(r) for r in sh["dst"] if r >= 0) if sh["dst"].size else set()
        self.ranks = sorted(ranks)

    @property
    def end_t(self) -> float:
        """The last time the log knows of (training seconds)."""
        ts = [float(self.attrs.get("train_s", 0.0))]
        ts += [float(self.cols[g][c].max()) for g, c in (("updates", "t"), ("workers", "t"),
               ("shards", "t"), ("eval", "t"), ("epochs", "t_end")) if self.cols[g][c].size]
        return max(ts)

    @property
    def subtitle(self) -> str:
        c = self.config
        if int(self.attrs.get("world_size", 0)) == 1:
            bits = [self.label, "serial (1 process)"]
        else:
            bits = [self.label, f"balancer {c.get('balancer', '?')}", f"mode {c.get('mode', '?')}"]
        if c.get("inject"):
            bits.append("inject " + " ".join(c["inject"]))
        if self.status != "finished":
            bits.append(f"status {self.status}" + (" (INCOMPLETE)" if self.status == "running" else ""))
        return ", ".join(bits)


def _load(path: str) -> _Run:
    attrs, cols = read_columns(path)
    return _Run(path, attrs, cols)


def _figure(height: float = 4.0, width: float = 9.0, rows: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, axes


def _worker_colour(rank: int, ranks: list[int]):
    from matplotlib import colormaps

    if rank < 0:
        return NO_WORKER
    cmap = colormaps["tab10"]
    return cmap(ranks.index(rank) % 10) if rank in ranks else cmap(rank % 10)


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, what, transform=ax.transAxes, ha="center", va="center", color="0.4")


def _epoch_lines(ax, run: _Run, label: bool = True) -> None:
    ends = run.cols["epochs"]["t_end"]
    for i, t in enumerate(ends):
        ax.axvline(t, color="0.35", lw=0.8, ls=":", label="epoch end" if label and i == 0 else None)


# --------------------------------------------------------------------------- one run

def _run_figures(run: _Run) -> list[tuple[str, object]]:
    return [
        ("timeline.png", _timeline(run)),
        ("rates.png", _rates(run)),
        ("batch.png", _batches(run)),
        ("staleness.png", _staleness(run)),
        ("shards.png", _shards(run)),
        ("eval.png", _eval(run)),
    ]


def timeline_segments(t: np.ndarray, parts: dict[str, np.ndarray], start: float = 0.0):
    """Split each report interval of one worker into stacked segments.

    Row i covers (t[i-1], t[i]] (the first from `start`). Its reported seconds are laid out
    in proportion inside that interval; when they add up to less than the interval, the
    rest is "untimed" (time outside the worker's timed phases: per-step overhead between
    them, the wait after its last push, being descheduled on a busy node); when they add
    up to more (a push's timings can reach back before the previous row), they are scaled
    to fit.

    Args:
        t: row times of one worker, ascending.
        parts: {name: seconds per row}, same length as t.
        start: start of the first interval.

    Returns:
        A list of (name, left, width) segments.
    """
    segments = []
    prev = start
    names = list(parts)
    for i, end in enumerate(t):
        span = float(end) - prev
        if span <= 0:
            prev = max(prev, float(end))
            continue
        secs = [max(0.0, float(parts[n][i])) for n in names]
        scale = span / max(sum(secs), span)
        left = prev
        for name, s in zip(names, secs):
            if s > 0:
                segments.append((name, left, s * scale))
                left += s * scale
        if end - left > 1e-9:
            segments.append(("untimed", left, float(end) - left))
        prev = float(end)
    return segments


def _timeline(run: _Run):
    wk, up = run.cols["workers"], run.cols["updates"]
    spans = shard_spans(run.cols["shards"])
    ranks = sorted(set(wk["worker"].astype(int).tolist()) | {r for *_, r in spans})
    fig, (ax,) = _figure(height=1.8 + 0.7 * max(1, len(ranks)))
    ax.set_title(f"Where each worker's time went (thin strip: shards in progress)\n{run.subtitle}",
                 fontsize=10)
    ax.set_xlabel("time since training start (s)")
    ax.set_ylabel("worker rank")
    if not ranks:
        _no_data(ax, "no rows in workers/ or shards/ (the run stopped before its first report)")
        return fig
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.transforms import ScaledTranslation

    total = max(1, int(up["batch"].astype(np.int64).sum()))
    for y, r in enumerate(ranks):
        m = wk["worker"] == r
        order = np.argsort(wk["t"][m], kind="stable")
        t = wk["t"][m][order]
        parts = {name: wk[col][m][order] for name, col in
                 (("compute", "compute_s"), ("I/O", "io_s"), ("comm", "comm_s"), ("idle", "idle_s"))}
        for name, left, width in timeline_segments(t, parts):
            ax.barh(y + 0.1, width, left=left, height=0.5, color=PART_COLOURS[name], linewidth=0)
        # shard spans at event resolution, finer than the workers/ rows (one per rebalance)
        mine = [(a, b - a) for a, b, _, rank in spans if rank == r]
        if mine:
            ax.broken_barh(mine, (y - 0.38, 0.18), facecolors="0.25", edgecolors="white",
                           linewidth=0.4)
        samples = int(up["batch"][up["worker"] == r].astype(np.int64).sum())
        busy = float(wk["compute_s"][m].sum() + wk["io_s"][m].sum())
        label = f"{samples:,} samples ({100 * samples / total:.0f}%)"
        if busy > 0:
            label += f"\n{samples / busy:,.0f} per busy s"
        ax.text(1.005, y, label, transform=ax.get_yaxis_transform(), va="center", fontsize=8)
    ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(left=0)
    _epoch_lines(ax, run)
    handles = [Patch(color=c, label=n) for n, c in PART_COLOURS.items()]
    handles.append(Patch(color="0.25", label="shard start to done"))
    if run.cols["epochs"]["t_end"].size:
        handles.append(Line2D([], [], color="0.35", lw=0.8, ls=":", label="epoch end"))
    # below the x label, at a fixed distance whatever the number of lanes
    below = ax.transAxes + ScaledTranslation(0, -34 / 72, fig.dpi_scale_trans)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=below,
              ncol=len(handles), fontsize=8, frameon=False)
    return fig


def _per_worker_steps(ax, run: _Run, column: str, holds: str, dashed: str = "",
                      initial: float | None = None) -> list[int]:
    """One step line per worker of a `workers/` column; returns the ranks drawn.

    holds="before": a row's value describes the interval it closes (a measured rate);
    holds="after": it holds from the row on, until the next row or the end of the run
    (a batch size chosen at a rebalance), with `initial` before the first row.
    """
    wk = run.cols["workers"]
    ranks = sorted(set(wk["worker"].astype(int).tolist()))
    end = run.end_t
    for r in ranks:
        m = wk["worker"] == r
        order = np.argsort(wk["t"][m], kind="stable")
        t = wk["t"][m][order]
        colour = _worker_colour(r, run.ranks)
        for col, style in ((column, "-"), (dashed, "--")):
            if not col:
                continue
            v = wk[col][m][order].astype(np.float64)
            if holds == "before":
                x, y, draw = np.r_[0.0, t], np.r_[v[:1], v], "steps-pre"
            else:
                first = v[0] if initial is None else initial
                x, y, draw = np.r_[0.0, t, max(end, t[-1])], np.r_[first, v, v[-1]], "steps-post"
            ax.plot(x, y, color=colour, ls=style, lw=1.6 if style == "-" else 1.2, drawstyle=draw,
                    label=f"rank {r}" if style == "-" else None)
            if style == "-":
                ax.plot(t, v, ls="none", marker="o", ms=3, color=colour)
    ax.set_xlim(left=0)
    return ranks


def _rates(run: _Run):
    fig, (ax,) = _figure()
    wk = run.cols["workers"]
    same = wk["rate"].size and np.allclose(wk["rate"], wk["predicted_rate"])
    ax.set_title("Samples per second of each worker (solid: measured, dashed: predicted"
                 + (", equal here" if same else "") + f")\n{run.subtitle}", fontsize=10)
    ax.set_xlabel("time since training start (s)")
    ax.set_ylabel("samples/s (per busy second)")
    ranks = _per_worker_steps(ax, run, "rate", "before", dashed="predicted_rate")
    if not ranks:
        _no_data(ax, "no rows in workers/ (the run stopped before its first report)")
        return fig
    from matplotlib.ticker import EngFormatter

    ax.yaxis.set_major_formatter(EngFormatter())
    measured_top = float(np.nanmax(wk["rate"])) if np.isfinite(wk["rate"]).any() else 0.0
    predicted_top = float(np.nanmax(wk["predicted_rate"])) if np.isfinite(wk["predicted_rate"]).any() else 0.0
    if measured_top > 0 and predicted_top > 1.5 * measured_top:
        # a wild forecast would flatten the measured lines; it still shows, leaving the top
        ax.set_ylim(0, 1.5 * measured_top)
        ax.text(0.99, 0.98, f"predictions clipped (max {predicted_top:,.0f})", transform=ax.transAxes,
                ha="right", va="top", fontsize=8, color="0.3",
                bbox=dict(facecolor="white", edgecolor="none", alpha=0.8))
    else:
        ax.set_ylim(bottom=0)
    _epoch_lines(ax, run)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    return fig


def _batches(run: _Run):
    fig, (ax,) = _figure(height=3.5)
    ax.set_title(f"Batch size of each worker (batch policy {run.config.get('batch_policy', '?')})\n"
                 f"{run.subtitle}", fontsize=10)
    ax.set_xlabel("time since training start (s)")
    ax.set_ylabel("batch size (samples)")
    ranks = _per_worker_steps(ax, run, "batch", "after", initial=run.config.get("batch"))
    if not ranks:
        _no_data(ax, "no rows in workers/ (the run stopped before its first report)")
        return fig
    ax.set_ylim(bottom=0, top=max(1.0, float(run.cols["workers"]["batch"].max())) * 1.15)
    _epoch_lines(ax, run)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    return fig


def _staleness(run: _Run):
    up = run.cols["updates"]
    fig, (ax,) = _figure(height=3.8)
    ax.set_title(f"Staleness of applied gradients (server versions behind)\n{run.subtitle}", fontsize=10)
    ax.set_xlabel("staleness (updates)")
    ax.set_ylabel("gradients applied (count, log scale)")
    if up["staleness"].size == 0:
        _no_data(ax, "no rows in updates/")
        return fig
    st = up["staleness"].astype(int)
    bins = np.arange(-0.5, st.max() + 1.5, 1.0)
    for r in sorted(set(up["worker"].astype(int).tolist())):
        s = st[up["worker"] == r]
        ax.hist(s, bins=bins, histtype="step", lw=1.6, color=_worker_colour(r, run.ranks),
                label=f"rank {r}: mean {s.mean():.1f}, p99 {np.percentile(s, 99):.0f}, max {s.max()}")
    ax.set_yscale("log")
    ax.set_xlim(-0.5, st.max() + 0.5)
    ax.legend(fontsize=8)
    return fig


def _shards(run: _Run):
    sh = run.cols["shards"]
    n_shards = int(sh["shard"].max()) + 1 if sh["shard"].size else 0
    fig, (ax,) = _figure(height=max(3.5, min(9.0, 1.5 + 0.2 * n_shards)))
    ax.set_title(f"Shard placement over time (colour: destination worker, marker: event)\n"
                 f"{run.subtitle}", fontsize=10)
    ax.set_xlabel("time since training start (s)")
    ax.set_ylabel("shard")
    if sh["t"].size == 0:
        _no_data(ax, "no rows in shards/")
        return fig
    from matplotlib.lines import Line2D

    events = np.asarray(sh["event"]).astype(str)
    dst = sh["dst"].astype(int)
    spans = shard_spans(sh)
    for (start, end, shard, rank) in spans:
        # the processing span: a slow worker's shards stand out as long bars
        ax.plot([start, end], [shard, shard], color=_worker_colour(rank, run.ranks), lw=2.5,
                alpha=0.45, solid_capstyle="butt", zorder=1)
    # many epochs crowd the routine events: shrink them, keep the balancer's moves large
    crowd = float(np.clip(6.0 / max(1, len(set(sh["epoch"].tolist()))), 0.3, 1.0))
    for event in sorted(set(events.tolist()), key=lambda e: (e not in EVENT_MARKERS, e)):
        marker, size, face = EVENT_MARKERS.get(event, OTHER_MARKER)
        if event not in ("move", "reassign"):
            size *= crowd
        m = events == event
        colours = [_worker_colour(int(d), run.ranks) for d in dst[m]]
        # moves are drawn last and large: they are the balancer's decisions
        z = 3 if event in ("move", "reassign") else 2
        if face == "none":
            ax.scatter(sh["t"][m], sh["shard"][m], s=size, marker=marker, facecolors="none",
                       edgecolors=colours, linewidths=0.8, zorder=z)
        else:
            ax.scatter(sh["t"][m], sh["shard"][m], s=size, marker=marker, c=colours,
                       edgecolors="black" if event in ("move", "reassign") else None,
                       linewidths=0.5, zorder=z)
    _epoch_lines(ax, run, label=False)
    ax.set_ylim(-0.7, n_shards - 0.3)
    ax.invert_yaxis()
    kinds = [e for e in EVENT_MARKERS if e in set(events.tolist())]
    kinds += sorted(set(events.tolist()) - set(EVENT_MARKERS))
    ev_handles = [Line2D([], [], ls="none", marker=EVENT_MARKERS.get(e, OTHER_MARKER)[0], color="0.3",
                         markerfacecolor="none" if EVENT_MARKERS.get(e, OTHER_MARKER)[2] == "none" else "0.3",
                         label=f"{e} ({int((events == e).sum())})") for e in kinds]
    wk_ranks = sorted(set(int(d) for d in dst))
    wk_handles = [Line2D([], [], ls="none", marker="s", color=_worker_colour(r, run.ranks),
                         label=f"rank {r}" if r >= 0 else "no destination") for r in wk_ranks]
    # one legend (a second one added with add_artist escapes bbox_inches="tight")
    spacer = Line2D([], [], ls="none", label=" ")
    if spans:
        ev_handles.append(Line2D([], [], color="0.3", lw=2.5, alpha=0.45, label="start to done"))
    ax.legend(handles=ev_handles + [spacer] + wk_handles, fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), title="event / new owner", title_fontsize=8)
    return fig


def shard_spans(sh: dict) -> list[tuple[float, float, int, int]]:
    """(start t, done t, shard, worker) of each shard processed, from `shards/` events.

    A shard's span opens at its "start" and closes at the next "done" of the same
    (epoch, shard); a span that never closed (killed run, lost worker) is left out.
    """
    events = np.asarray(sh["event"]).astype(str)
    open_at: dict[tuple[int, int], tuple[float, int]] = {}
    spans = []
    for t, epoch, shard, dst, event in zip(sh["t"], sh["epoch"], sh["shard"], sh["dst"], events):
        key = (int(epoch), int(shard))
        if event == "start":
            open_at[key] = (float(t), int(dst))
        elif event == "done" and key in open_at:
            start, rank = open_at.pop(key)
            spans.append((start, float(t), int(shard), rank))
    return spans


def _eval(run: _Run):
    ev = run.cols["eval"]
    fig, (ax_acc, ax_loss) = _figure(height=5.0, rows=2)
    ax_acc.set_title(f"Test accuracy and loss\n{run.subtitle}", fontsize=10)
    ax_acc.set_ylabel("test accuracy (fraction)")
    ax_loss.set_ylabel("test loss (cross-entropy, nats)")
    ax_loss.set_xlabel("time since training start (s)")
    if ev["t"].size == 0:
        _no_data(ax_acc, "no rows in eval/ (no evaluation before the run stopped)")
        return fig
    ax_acc.plot(ev["t"], ev["test_accuracy"], marker="o", ms=4, color="#2a7ab0")
    ax_loss.plot(ev["t"], ev["test_loss"], marker="o", ms=4, color="#d64541")
    target = run.config.get("target_accuracy")
    if target is not None:
        ax_acc.axhline(target, color="0.5", ls="--", lw=1, label=f"target {target:g}")
        ax_acc.legend(fontsize=8, loc="lower right")
    for ax in (ax_acc, ax_loss):
        _epoch_lines(ax, run, label=False)
        ax.grid(alpha=0.3)
    ax_loss.set_xlim(left=0)
    return fig


# --------------------------------------------------------------------------- comparison

def _labels(runs: list[_Run]) -> list[str]:
    """File names, with the parent directory where two runs share a name."""
    names = [r.label for r in runs]
    if len(set(names)) == len(names):
        return names
    return [os.path.join(Path(r.path).parent.name, r.label) if names.count(r.label) > 1 else r.label
            for r in runs]


def throughput(t: np.ndarray, samples: np.ndarray, bins: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """Applied samples/s in equal time bins from 0 to the last update: (bin centres, rates)."""
    if t.size == 0:
        return np.zeros(0), np.zeros(0)
    end = float(t.max())
    if end <= 0:
        return np.zeros(0), np.zeros(0)
    n = int(np.clip(t.size // 20, 3, bins))
    edges = np.linspace(0.0, end, n + 1)
    sums, _ = np.histogram(t, bins=edges, weights=samples.astype(np.float64))
    return 0.5 * (edges[1:] + edges[:-1]), sums / np.diff(edges)


def _compare_figures(runs: list[_Run]) -> list[tuple[str, object]]:
    labels = _labels(runs)
    return [
        ("compare_accuracy.png", _compare_accuracy(runs, labels)),
        ("compare_rates.png", _compare_rates(runs, labels)),
        ("compare_epoch_time.png", _compare_epoch_time(runs, labels)),
    ]


def _compare_accuracy(runs: list[_Run], labels: list[str]):
    fig, (ax,) = _figure()
    ax.set_title("Test accuracy of each run", fontsize=10)
    ax.set_xlabel("time since training start (s)")
    ax.set_ylabel("test accuracy (fraction)")
    drawn = 0
    for run, label in zip(runs, labels):
        ev = run.cols["eval"]
        if ev["t"].size:
            ax.plot(ev["t"], ev["test_accuracy"], marker="o", ms=3, label=_tag(run, label))
            drawn += 1
    if not drawn:
        _no_data(ax, "no run has rows in eval/")
        return fig
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _compare_rates(runs: list[_Run], labels: list[str]):
    fig, (ax,) = _figure()
    ax.set_title("Training throughput of each run (samples applied per second)", fontsize=10)
    ax.set_xlabel("time since training start (s)")
    ax.set_ylabel("samples/s (all workers)")
    drawn = 0
    for run, label in zip(runs, labels):
        up = run.cols["updates"]
        centres, rates = throughput(up["t"], up["batch"])
        if centres.size:
            ax.plot(centres, rates, marker=".", label=_tag(run, label))
            drawn += 1
    if not drawn:
        _no_data(ax, "no run has rows in updates/")
        return fig
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _compare_epoch_time(runs: list[_Run], labels: list[str]):
    fig, (ax,) = _figure(height=3.5 + 0.1 * len(runs))
    ax.set_title("Mean epoch time of each run (bars: min to max)", fontsize=10)
    ax.set_ylabel("seconds per epoch")
    means, lo, hi = [], [], []
    for run in runs:
        ep = run.cols["epochs"]
        secs = ep["t_end"] - ep["t_start"]
        means.append(float(secs.mean()) if secs.size else 0.0)
        lo.append(float(means[-1] - secs.min()) if secs.size else 0.0)
        hi.append(float(secs.max() - means[-1]) if secs.size else 0.0)
    x = np.arange(len(runs))
    bars = ax.bar(x, means, yerr=[lo, hi], capsize=4, color="#2a7ab0")
    for bar, run, m, up in zip(bars, runs, means, hi):
        n = run.cols["epochs"]["epoch"].size
        ax.annotate(f"{m:.2f} s\n({n} epochs)" if n else "no epoch\ncompleted",
                    (bar.get_x() + bar.get_width() / 2, m + up), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [_tag(r, lbl) for r, lbl in zip(runs, labels)], fontsize=8,
                  rotation=15 if len(runs) > 3 else 0)
    ax.set_ylim(0, max(max(np.add(means, hi)), 1e-3) * 1.3)
    return fig


def _tag(run: _Run, label: str) -> str:
    c = run.config
    tag = f"{label} ({c.get('balancer', '?')}"
    if run.status != "finished":
        tag += f", {run.status}"
    return tag + ")"
