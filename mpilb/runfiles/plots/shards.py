"""Shard placement over time: who held which shard, and what the balancer moved."""

from __future__ import annotations

import numpy as np

from mpilb.runfiles.plots._common import EVENT_MARKERS, OTHER_MARKER, _epoch_lines, _figure, _no_data, _Run, _worker_colour


def shards_figure(run: _Run):
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

