"""What every figure shares: a run log loaded for plotting, figure and colour helpers."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mpilb.runfiles.summary import metric_columns, run_config
from mpilb.runfiles.runlog import read_columns

# Colours of the parts of a worker's time (timeline) and markers of shard events.
PART_COLOURS = {"compute": "#2a7ab0", "I/O": "#e08a1e", "comm": "#8e5fb5", "idle": "#d64541",
                "untimed": "#d9d9d9"}
EVENT_MARKERS = {"assign": ("o", 14, "none"), "start": (">", 18, None), "done": ("|", 40, None),
                 "move": ("*", 110, None), "reassign": ("X", 80, None)}
OTHER_MARKER = ("x", 30, None)
NO_WORKER = "#7f7f7f"


class _Run:
    """One run log's columns plus what the figures need from its attributes."""

    def __init__(self, path: str, attrs: dict, cols: dict):
        self.path = path
        self.attrs = attrs
        self.cols = cols
        self.config = run_config(attrs)
        self.metric, self.metric_values = metric_columns(attrs, cols["eval"])
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

    def samples_at(self, t: np.ndarray) -> np.ndarray:
        """Samples applied (all workers) up to each time in `t`."""
        up = self.cols["updates"]
        order = np.argsort(up["t"], kind="stable")
        cum = np.concatenate([[0], np.cumsum(up["batch"][order].astype(np.int64))])
        return cum[np.searchsorted(up["t"][order], np.asarray(t, dtype=np.float64), side="right")]

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


def _figure(height: float = 4.0, width: float = 9.0, rows: int = 1, cols: int = 1,
            sharex: bool = True):
    """A figure and its axes: a flat array, row by row."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    axes = fig.subplots(rows, cols, sharex=sharex, squeeze=False)
    return fig, axes[:, 0] if cols == 1 else axes.ravel()


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

