"""Per-worker figures: where each worker's time went, its rate, its batch size."""

from __future__ import annotations

import numpy as np

from mpilb.runfiles.plots._common import PART_COLOURS, _epoch_lines, _figure, _no_data, _Run, _worker_colour
from mpilb.runfiles.plots.shards import shard_spans


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


def timeline_figure(run: _Run):
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


def epoch_shares(run: _Run) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
    """Each worker's share of the samples applied in each epoch.

    Returns:
        (epoch start times, epoch end times, {rank: share per epoch}); an epoch not
        completed ends at its last update.
    """
    up, ep = run.cols["updates"], run.cols["epochs"]
    epochs = sorted(set(up["epoch"].astype(int).tolist()))
    starts, ends, shares = [], [], {r: [] for r in sorted(set(up["worker"].astype(int).tolist()))}
    done = {int(e): (float(a), float(b)) for e, a, b in zip(ep["epoch"], ep["t_start"], ep["t_end"])}
    for e in epochs:
        m = up["epoch"] == e
        total = float(up["batch"][m].sum())
        a, b = done.get(e, (float(up["t"][m].min()), float(up["t"][m].max())))
        starts.append(a)
        ends.append(b)
        for r in shares:
            shares[r].append(float(up["batch"][m & (up["worker"] == r)].sum()) / total if total else 0.0)
    return np.array(starts), np.array(ends), {r: np.array(v) for r, v in shares.items()}


def rates_figure(run: _Run):
    """Top: each worker's rate; bottom: its share of each epoch, which the balancer sets."""
    fig, (ax, ax_share) = _figure(height=6.5, rows=2)
    wk = run.cols["workers"]
    same = wk["rate"].size and np.allclose(wk["rate"], wk["predicted_rate"])
    ax.set_title("Samples per second of each worker (solid: measured, dashed: predicted"
                 + (", equal here" if same else "") + ")\nand its share of each epoch's samples"
                 + f"\n{run.subtitle}", fontsize=10)
    ax.set_ylabel("samples/s (per busy second)")
    ax_share.set_xlabel("time since training start (s)")
    ax_share.set_ylabel("share of the epoch's samples")
    starts, ends, shares = epoch_shares(run)
    for r, share in shares.items():
        if starts.size:
            # each epoch's share as a flat segment over the epoch
            x = np.ravel(np.column_stack([starts, ends]))
            ax_share.plot(x, np.repeat(share, 2), color=_worker_colour(r, run.ranks), lw=1.8,
                          label=f"rank {r}")
    if shares and len(shares) > 1:
        ax_share.axhline(1 / len(shares), color="0.5", ls="--", lw=1, label="even split")
        ax_share.legend(fontsize=8, loc="best", ncol=2)
    ax_share.set_ylim(0, 1)
    ax_share.grid(alpha=0.3)
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
    for a in (ax, ax_share):
        _epoch_lines(a, run, label=a is ax)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    return fig


def batch_figure(run: _Run):
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

