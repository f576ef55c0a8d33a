"""How training went: staleness of the gradients, training loss, test loss and metric."""

from __future__ import annotations

import numpy as np

from mpilb.runfiles.summary import LOSS_WINDOW, smoothed_loss
from mpilb.runfiles.plots._common import _epoch_lines, _figure, _no_data, _Run, _worker_colour


def staleness_figure(run: _Run):
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


LOSS_LABEL = "loss per sample"
TEST_COLOUR = "#d64541"


def _loss_lines(ax, run: _Run, against: str) -> bool:
    """Smoothed training loss per worker (thin) and overall (thick) against "t" or "samples"."""
    up = run.cols["updates"]
    if up["loss"].size == 0:
        return False
    x_all = up["t"] if against == "t" else np.cumsum(up["batch"].astype(np.int64))
    workers = sorted(set(up["worker"].astype(int).tolist()))
    if len(workers) > 1:
        for r in workers:
            m = up["worker"] == r
            ax.plot(x_all[m], smoothed_loss(up["loss"][m], up["batch"][m]), lw=0.9, alpha=0.8,
                    color=_worker_colour(r, run.ranks), label=f"rank {r}")
    ax.plot(x_all, smoothed_loss(up["loss"], up["batch"]), lw=2.0, color="black",
            label="training, all workers" if len(workers) > 1 else f"training (rank {workers[0]})")
    return True


def _test_points(ax, run: _Run, values: np.ndarray, against: str, **style) -> None:
    ev = run.cols["eval"]
    x = ev["t"] if against == "t" else run.samples_at(ev["t"])
    ax.plot(x, values, marker="o", ms=4, **style)


def _x_label(ax, against: str, label: bool = True) -> None:
    if label:
        ax.set_xlabel("time since training start (s)" if against == "t" else "samples applied")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)


def loss_figure(run: _Run):
    fig, axes = _figure(height=6.5, rows=2, sharex=False)
    axes[0].set_title(f"Training loss (mean per sample, rolling over {LOSS_WINDOW:.0%} of updates) "
                      f"and test loss\n{run.subtitle}", fontsize=10)
    for ax, against in zip(axes, ("t", "samples")):
        ax.set_ylabel(LOSS_LABEL)
        if not _loss_lines(ax, run, against):
            _no_data(ax, "no rows in updates/ (no gradient applied before the run stopped)")
            continue
        if run.cols["eval"]["t"].size:
            _test_points(ax, run, run.cols["eval"]["test_loss"], against, color=TEST_COLOUR,
                         ls="--", lw=1.2, label="test")
        if against == "t":
            _epoch_lines(ax, run, label=False)
        ax.set_ylim(bottom=0)
        _x_label(ax, against)
        ax.legend(fontsize=8, loc="upper right", ncol=2)
    return fig


def eval_figure(run: _Run):
    ev = run.cols["eval"]
    fig, axes = _figure(height=6.0, width=11.0, rows=2, cols=2, sharex=False)
    fig.suptitle(f"Test {run.metric} and test loss\n{run.subtitle}", fontsize=10)
    has_eval = ev["t"].size > 0
    for col, against in enumerate(("t", "samples")):
        ax_metric, ax_loss = axes[col], axes[2 + col]
        ax_metric.set_ylabel(f"test {run.metric}")
        ax_loss.set_ylabel(f"test {LOSS_LABEL}" if has_eval else f"training {LOSS_LABEL}")
        if has_eval:
            _test_points(ax_metric, run, run.metric_values, against, color="#2a7ab0")
            _test_points(ax_loss, run, ev["test_loss"], against, color=TEST_COLOUR, label="test")
            target = run.config.get("target_metric", run.config.get("target_accuracy"))
            if target is not None:
                ax_metric.axhline(target, color="0.5", ls="--", lw=1, label=f"target {target:g}")
                ax_metric.legend(fontsize=8, loc="lower right")
        else:
            _no_data(ax_metric, "no rows in eval/:\nno evaluation before the run stopped")
        # without evaluations the training loss still shows how the run went
        if not has_eval and _loss_lines(ax_loss, run, against):
            ax_loss.legend(fontsize=8, loc="upper right")
        elif not has_eval:
            _no_data(ax_loss, "no rows in eval/ or updates/")
        for ax in (ax_metric, ax_loss):
            if against == "t":
                _epoch_lines(ax, run, label=False)
            _x_label(ax, against, label=ax is ax_loss)
    return fig
