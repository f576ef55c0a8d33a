"""`--tensorboard DIR`: the run's scalars as TensorBoard events, written while it trains.

Rank 0 writes, from the same rows as the run log (it observes them through
:class:`~mpilb.run.progress.LogTap`), the figures `mpilb report` shows:

| tag | value | when |
| --- | --- | --- |
| `train/loss` | mean training loss per sample, all workers | every `interval` s |
| `train/loss/rank_R` | the same for worker R | every `interval` s |
| `train/samples_per_s` | samples applied per second | every `interval` s |
| `staleness/mean`, `staleness/max` | of the gradients applied | every `interval` s |
| `test/loss`, `test/METRIC` | each evaluation (METRIC: accuracy, or the model's) | at each `eval/` row |
| `workers/rate/rank_R`, `workers/predicted_rate/rank_R`, `workers/batch/rank_R` | the balancer's view of worker R | at each rebalance |
| `epochs/utilization`, `epochs/imbalance_s`, `epochs/seconds` | per completed epoch | at each epoch end |

The step of every scalar is the number of samples applied so far (all workers), so runs of
different speeds line up on TensorBoard's "step" axis and differ on its "relative" one.
Events are written with tensorboardX (``pip install 'mpilb[tensorboard]'``), which needs
neither TensorFlow nor torch.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional

from mpilb.errors import UsageError

# Seconds of training between two points of the windowed scalars.
INTERVAL_S = 1.0


def _writer_class():
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise UsageError("--tensorboard needs the tensorboardX package: "
                         "pip install 'mpilb[tensorboard]' (or pip install tensorboardX)") from None
    return SummaryWriter


class TensorBoardTap:
    """Observer of run-log rows that writes TensorBoard scalars into `logdir`.

    Args:
        logdir: the event directory (created if missing), as given to `--tensorboard`.
        metric: the test metric's name ("accuracy").
        interval: seconds of training between points of the windowed scalars.
        writer: a SummaryWriter-like object (tests); default: tensorboardX's.
    """

    def __init__(self, logdir: str, metric: str = "accuracy", interval: float = INTERVAL_S,
                 writer=None):
        if writer is None:
            try:
                writer = _writer_class()(logdir=str(logdir), flush_secs=10)
            except OSError as exc:
                raise UsageError(f"--tensorboard {logdir}: cannot write there ({exc.strerror})") from None
        self.writer = writer
        self.metric = metric
        self.interval = interval
        self.samples = 0
        self._t_last = 0.0            # log time of the last windowed point
        self._t = 0.0
        self._reset_window()

    def _reset_window(self) -> None:
        self._loss = defaultdict(float)   # rank -> sum of loss x batch (-1: all)
        self._n = defaultdict(int)
        self._window_samples = 0
        self._stale_sum = 0
        self._stale_max = 0
        self._updates = 0

    def _scalar(self, tag: str, value) -> None:
        if value is not None and value == value:   # skip NaN
            self.writer.add_scalar(tag, float(value), self.samples, walltime=time.time())

    def row(self, group: str, row: dict) -> None:
        """One run-log row (see the table in the module docstring)."""
        t = float(row.get("t", self._t))
        self._t = max(self._t, t)
        if group == "updates":
            b = int(row.get("batch", 0))
            self.samples += b
            self._window_samples += b
            loss = float(row.get("loss", 0.0))
            if b and loss == loss:
                r = int(row.get("worker", 0))
                self._loss[r] += loss * b
                self._n[r] += b
                self._loss[-1] += loss * b
                self._n[-1] += b
            st = int(row.get("staleness", 0))
            self._stale_sum += st
            self._stale_max = max(self._stale_max, st)
            self._updates += 1
            if self._t - self._t_last >= self.interval:
                self.write_window()
        elif group == "eval":
            self._scalar("test/loss", row.get("test_loss"))
            self._scalar(f"test/{self.metric}", row.get("test_metric", row.get("test_accuracy")))
        elif group == "workers":
            r = int(row.get("worker", 0))
            for col in ("rate", "predicted_rate", "batch"):
                if col in row:
                    self._scalar(f"workers/{col}/rank_{r}", row[col])
        elif group == "epochs":
            self._scalar("epochs/utilization", row.get("utilization"))
            self._scalar("epochs/imbalance_s", row.get("imbalance_s"))
            self._scalar("epochs/seconds", float(row.get("t_end", 0.0)) - float(row.get("t_start", 0.0)))

    def write_window(self) -> None:
        """Write the windowed scalars (loss, throughput, staleness) since the last point."""
        if self._updates:
            for r, n in self._n.items():
                tag = "train/loss" if r == -1 else f"train/loss/rank_{r}"
                self._scalar(tag, self._loss[r] / n)
            span = self._t - self._t_last
            if span > 0:
                self._scalar("train/samples_per_s", self._window_samples / span)
            self._scalar("staleness/mean", self._stale_sum / self._updates)
            self._scalar("staleness/max", self._stale_max)
        self._t_last = self._t
        self._reset_window()

    def flush(self) -> None:
        self.writer.flush()

    def close_log(self) -> None:
        """The run log closes: write the last window and close the event file."""
        self.write_window()
        self.writer.close()


def tap_for(cfg, metric: str = "accuracy") -> Optional[TensorBoardTap]:
    """The tap for `--tensorboard DIR`, or None when it is not set."""
    logdir = getattr(cfg, "tensorboard", None)
    return TensorBoardTap(logdir, metric=metric) if logdir else None
