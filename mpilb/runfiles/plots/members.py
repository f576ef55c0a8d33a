"""Membership over time: which workers were in the run when, and how many (``members/``).

A job's own workers (every rank that is not a parameter store) are in the run from its
start; a ``join`` or ``respawn`` row brings a worker in, a ``leave`` or ``lost`` row takes
one out (docs/logs.md, ``members/``); at a ``--resume`` (root attribute ``resumed_at``) the
resumed launch starts with its own ranks: those that joined before are out, and its own
workers that had left are back. The report's text (``workers: 2 until 3.1 s, 4
after``) and ``members.png`` are both built on :func:`member_spans`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mpilb.runfiles.logattrs import json_attr, store_ranks
from mpilb.runfiles.plots._common import _epoch_lines, _figure, _no_data, _Run, _worker_colour

ARRIVALS = ("join", "respawn")
DEPARTURES = ("leave", "lost")
# marker, size, colour of each event in members.png
EVENT_STYLE = {"join": ("^", 70, "#2ca02c"), "respawn": ("P", 80, "#8e5fb5"),
               "leave": ("v", 70, "#e08a1e"), "lost": ("X", 80, "#d64541")}


class Span(NamedTuple):
    """A worker's time in the run: from ``start`` (0 for the job's own workers) to ``end``
    (None: still in at the end of the log), and the events that opened and closed it (a
    worker has one more span for each time it came back at a resume)."""

    rank: int
    start: float
    end: float | None
    came: str      # "start", "join", "respawn" or "resume"
    went: str      # "", "leave", "lost" or "resume"


def member_events(cols: dict) -> list[tuple[float, int, int, str]]:
    """The ``members/`` rows as (t, worker, node, event), in time order."""
    m = cols.get("members") or {}
    rows = [(float(t), int(w), int(n), e.decode() if isinstance(e, bytes) else str(e))
            for t, w, n, e in zip(m.get("t", ()), m.get("worker", ()), m.get("node", ()),
                                  m.get("event", ()))]
    return sorted(rows, key=lambda r: r[0])


def job_workers(attrs: dict) -> list[int]:
    """The job's own worker ranks: every rank of its launch that is not a store (a serial
    run's one process works)."""
    world = int(attrs.get("world_size", 1))
    if world <= 1:
        return [0]
    stores = set(store_ranks(attrs))
    return [r for r in range(world) if r not in stores]


def resume_times(attrs: dict) -> list[float]:
    """The training seconds each --resume continued from (root attribute ``resumed_at``)."""
    times = json_attr(attrs, "resumed_at", [])
    return sorted(float(t) for t in times) if isinstance(times, list) else []


def member_spans(attrs: dict, cols: dict) -> list[Span]:
    """Every worker's time in the run, the job's own ranks first, then the others in the
    order they came."""
    job = job_workers(attrs)
    spans = [Span(r, 0.0, None, "start", "") for r in job]
    rows = [(t, rank, event) for t, rank, _node, event in member_events(cols)]
    rows += [(t, -1, "resume") for t in resume_times(attrs)]
    for t, rank, event in sorted(rows, key=lambda r: r[0]):
        now = {s.rank: i for i, s in enumerate(spans) if s.end is None}   # who is in
        if event == "resume":
            for r, i in now.items():
                if r not in job:
                    spans[i] = spans[i]._replace(end=t, went="resume")
            spans += [Span(r, t, None, "resume", "") for r in job if r not in now]
        elif event in ARRIVALS and rank not in now:
            spans.append(Span(rank, t, None, event, ""))
        elif event in DEPARTURES and rank in now:
            spans[now[rank]] = spans[now[rank]]._replace(end=t, went=event)
    first = {r: i for i, r in reversed(list(enumerate(s.rank for s in spans)))}
    return sorted(spans, key=lambda s: (first[s.rank], s.start))


def worker_counts(attrs: dict, cols: dict) -> list[tuple[float, int]]:
    """The count of workers in the run over time: (from t, count) steps, the first at 0;
    changes at the same time are one step, and a step that changes nothing is left out."""
    changes: dict[float, int] = {}
    spans = member_spans(attrs, cols)
    for s in spans:
        if s.came != "start":
            changes[s.start] = changes.get(s.start, 0) + 1
        if s.end is not None:
            changes[s.end] = changes.get(s.end, 0) - 1
    count = sum(1 for s in spans if s.came == "start")
    steps = [(0.0, count)]
    for t in sorted(changes):
        count += changes[t]
        if t <= 0:
            steps[0] = (0.0, count)
        elif count != steps[-1][1]:
            steps.append((t, count))
    return steps


def counts_text(steps: list[tuple[float, int]]) -> str:
    """``workers: 2 until 3.1 s, 4 after`` (``workers: 3 throughout`` with one step)."""
    if len(steps) == 1:
        return f"workers: {steps[0][1]} throughout"
    parts = [f"{count} until {until:.1f} s" for (_, count), (until, _) in zip(steps, steps[1:])]
    return "workers: " + ", ".join(parts) + f", {steps[-1][1]} after"


def members_figure(run: _Run):
    """Top: how many workers were in the run; below: each worker's time in it, with its
    joins, leaves, losses and respawns marked."""
    spans = member_spans(run.attrs, run.cols)
    fig, (ax, lanes) = _figure(height=3.0 + 0.45 * max(1, len(spans)), rows=2)
    ax.set_title(f"Workers in the run over time (members/)\n{run.subtitle}", fontsize=10)
    ax.set_ylabel("workers")
    lanes.set_xlabel("time since training start (s)")
    lanes.set_ylabel("worker")
    end = run.end_t
    steps = worker_counts(run.attrs, run.cols)
    x = [t for t, _ in steps] + [max(end, steps[-1][0])]
    y = [c for _, c in steps] + [steps[-1][1]]
    ax.plot(x, y, drawstyle="steps-post", color="0.2", lw=1.8)
    ax.set_ylim(0, max(y) + 1)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    events = member_events(run.cols)
    if not events:
        _no_data(ax, "no membership changes (members/ is empty)")
    ranks = list(dict.fromkeys(s.rank for s in spans))   # a lane per worker
    for s in spans:
        stop = end if s.end is None else s.end
        lane = ranks.index(s.rank)
        lanes.plot([s.start, stop], [lane, lane], color=_worker_colour(s.rank, ranks), lw=6,
                   solid_capstyle="butt", alpha=0.8)
    seen = set()
    for t, rank, node, event in events:
        marker, size, colour = EVENT_STYLE.get(event, ("o", 40, "0.3"))
        label = None if event in seen else event
        seen.add(event)
        lanes.scatter([t], [ranks.index(rank) if rank in ranks else -1], marker=marker, s=size,
                      color=colour, edgecolors="black", linewidths=0.5, zorder=3, label=label)
        ax.axvline(t, color=colour, lw=0.8, alpha=0.6)
    for i, t in enumerate(resume_times(run.attrs)):
        for a in (ax, lanes):
            a.axvline(t, color="0.2", lw=1.2, ls="--", label="--resume" if a is lanes and i == 0 else None)
        seen.add("--resume")
    lanes.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    lanes.set_ylim(len(ranks) - 0.5, -0.5)
    lanes.set_xlim(0, max(end, 1e-3))
    _epoch_lines(lanes, run, label=False)
    if seen:
        lanes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def had_changes(run: _Run) -> bool:
    """The run's members/ has rows (members.png is drawn then)."""
    return bool(np.asarray((run.cols.get("members") or {}).get("t", ())).size)
