"""Overlays of several runs (`mpilb report --compare A.h5 B.h5 --plots DIR`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mpilb.runfiles.summary import differing_settings, setting_text, smoothed_loss
from mpilb.runfiles.plots._common import _figure, _no_data, _Run


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


def compare_figures(runs: list[_Run]) -> list[tuple[str, object]]:
    """(file name, figure) of every overlay; legends name each run and what sets it apart."""
    labels = _labels(runs)
    differ = differing_settings([r.config for r in runs])
    tags = [_tag(run, label, differ) for run, label in zip(runs, labels)]
    return [
        ("compare_accuracy.png", _compare_metric(runs, tags)),
        ("compare_loss.png", _compare_loss(runs, tags)),
        ("compare_rates.png", _compare_rates(runs, tags)),
        ("compare_epoch_time.png", _compare_epoch_time(runs, tags)),
    ]


def _overlay(runs: list[_Run], tags: list[str], title: str, ylabel: str, series, empty: str,
             floor: bool = False, **style):
    """One line per run: ``series(run)`` -> (x, y), nothing drawn for a run whose x is empty;
    `empty` says so on the axes when no run has any. `floor`: the y axis starts at 0."""
    fig, (ax,) = _figure()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("time since training start (s)")
    ax.set_ylabel(ylabel)
    drawn = 0
    for run, tag in zip(runs, tags):
        x, y = series(run)
        if x.size:
            ax.plot(x, y, label=tag, **style)
            drawn += 1
    if not drawn:
        _no_data(ax, empty)
        return fig
    if floor:
        ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _compare_metric(runs: list[_Run], tags: list[str]):
    metrics = " / ".join(sorted({r.metric for r in runs}))
    return _overlay(runs, tags, f"Test {metrics} of each run", f"test {metrics}",
                    lambda run: (run.cols["eval"]["t"], run.metric_values),
                    "no run has rows in eval/", marker="o", ms=3)


def _compare_loss(runs: list[_Run], tags: list[str]):
    def series(run):
        up = run.cols["updates"]
        return up["t"], smoothed_loss(up["loss"], up["batch"]) if up["loss"].size else up["loss"]

    return _overlay(runs, tags, "Training loss of each run (rolling mean per sample, all workers)",
                    "loss per sample", series, "no run has rows in updates/", floor=True)


def _compare_rates(runs: list[_Run], tags: list[str]):
    return _overlay(runs, tags, "Training throughput of each run (samples applied per second)",
                    "samples/s (all workers)",
                    lambda run: throughput(run.cols["updates"]["t"], run.cols["updates"]["batch"]),
                    "no run has rows in updates/", floor=True, marker=".")


def _compare_epoch_time(runs: list[_Run], tags: list[str]):
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
    ax.set_xticks(x, [t.replace(" (", "\n(", 1) for t in tags], fontsize=8,
                  rotation=15 if len(runs) > 3 else 0)
    ax.set_ylim(0, max(max(np.add(means, hi)), 1e-3) * 1.3)
    return fig


def _tag(run: _Run, label: str, differ: list[str]) -> str:
    """A run's legend entry: its label and its values of the settings that differ."""
    bits = [setting_text(run.config, k) for k in differ] or [f"balancer={run.config.get('balancer', '?')}"]
    if run.status != "finished":
        bits.append(run.status)
    return f"{label} ({', '.join(bits)})"
