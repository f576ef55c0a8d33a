"""Figures of run logs for `mpilb report --plots DIR` (PNG, matplotlib's Agg backend).

One question per figure. For one run:

- ``timeline.png``: where did each worker's time go (compute, I/O, communication, idle)?
- ``rates.png``: how fast was each worker (measured and predicted samples/s)?
- ``batch.png``: what batch size did each worker use?
- ``staleness.png``: how stale were the gradients, per worker?
- ``shards.png``: which worker held which shard when, and what did the balancer move?
- ``loss.png``: how did the training loss fall (per worker and overall, against time and
  against samples applied)?
- ``eval.png``: how did the test metric and test loss evolve (against time and samples)?
- ``members.png``, for a run whose workers changed (``members/`` has rows): how many
  workers were in the run over time, and which, with joins, leaves, losses and respawns
  marked.

For several runs: ``compare_accuracy.png`` (the test metric), ``compare_loss.png``,
``compare_rates.png`` and ``compare_epoch_time.png``, each run labelled with its file name
and the settings that differ between the runs.

Every figure is written even when its group is empty (a run killed before its first
report, a serial run): it then says so in place of the data, so the set of files a
report produces does not depend on how far the run got; ``members.png`` is the one added
only where the run had membership changes.

Modules: ``_common`` (loading, helpers), ``workers``, ``shards``, ``learning``, ``members``,
``compare``.
matplotlib is imported inside the functions that draw: it is slow to import and only
``--plots`` needs it (``mpilb report`` imports this package for every report).
"""

from __future__ import annotations

from pathlib import Path

from mpilb.runfiles.files import replace_file

from mpilb.runfiles.plots._common import _load, _Run
from mpilb.runfiles.plots.compare import compare_figures, throughput
from mpilb.runfiles.plots.learning import eval_figure, loss_figure, staleness_figure
from mpilb.runfiles.plots.members import (counts_text, had_changes, member_spans, members_figure,
                                          resume_times, worker_counts)
from mpilb.runfiles.plots.shards import shard_spans, shards_figure
from mpilb.runfiles.plots.workers import batch_figure, rates_figure, timeline_figure, timeline_segments

__all__ = ["write_plots", "shard_spans", "throughput", "timeline_segments", "member_spans",
           "worker_counts", "counts_text", "resume_times"]


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
    figures = compare_figures(runs) if len(runs) > 1 else run_figures(runs[0])
    written = []
    for name, fig in figures:
        path = out / name
        # into a new file renamed into place: a link already there is replaced, not followed
        replace_file(path, lambda fh: fig.savefig(fh, format="png", dpi=100, bbox_inches="tight"),
                     f"--plots {out_dir}")
        written.append(str(path))
    return written


def run_figures(run: _Run) -> list[tuple[str, object]]:
    """(file name, figure) of every per-run figure."""
    figures = [
        ("timeline.png", timeline_figure(run)),
        ("rates.png", rates_figure(run)),
        ("batch.png", batch_figure(run)),
        ("staleness.png", staleness_figure(run)),
        ("shards.png", shards_figure(run)),
        ("loss.png", loss_figure(run)),
        ("eval.png", eval_figure(run)),
    ]
    if had_changes(run):
        figures.append(("members.png", members_figure(run)))
    return figures
