"""Live progress on rank 0: a tqdm bar on a terminal, a timestamped status line otherwise.

Under ``mpiexec`` the launcher pipes every rank's stderr, so rank 0 almost never sees a
terminal there: it then prints a line when training starts, one per ``--progress-interval``
seconds, the first of them a second after the start (sooner for a shorter interval), and
one last line when the run ends that agrees with the summary. The rate is computed over the samples applied by this
process since it started, so a resumed run does not count its predecessor's samples.

Progress learns the training loss and the test metric from the run-log rows it is shown
(:meth:`Progress.row`, fed by :class:`LogTap`), so the training loops only tell it where
they are in the epoch.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

# The first status line comes at most this many seconds after the start.
FIRST_LINE_S = 1.0


class LogTap:
    """A run log that also shows every row it appends to a few observers.

    Wraps a :class:`~mpilb.runlog.RunLog`; `append` passes each row on to every observer's
    ``row(group, row)``, `flush` and `close` to their ``flush()``/``close()`` when they
    have one. Everything else is the wrapped log's.
    """

    def __init__(self, log, *observers):
        self._log = log
        self._observers = [o for o in observers if o is not None]

    def append(self, group: str, **row) -> None:
        self._log.append(group, **row)
        for o in self._observers:
            o.row(group, row)

    def flush(self) -> None:
        self._log.flush()
        for o in self._observers:
            if hasattr(o, "flush"):
                o.flush()

    def close(self, *args, **kwargs):
        for o in self._observers:
            if hasattr(o, "close_log"):
                o.close_log()
        return self._log.close(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._log, name)


def tapped(log, *observers):
    """`log` wrapped in a :class:`LogTap` for the observers that want rows (not None, not a
    disabled display); `log` itself when none does, so an unobserved run pays nothing."""
    wanted = [o for o in observers if o is not None and getattr(o, "enabled", True)]
    return LogTap(log, *wanted) if wanted else log


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


class Progress:
    """Progress display of one run.

    Args:
        enabled: False for --no-progress.
        total_epochs: epochs planned.
        samples_per_epoch: samples in one epoch.
        interval: seconds between status lines (--progress-interval).
        stream: where to write (stderr).
        bar: True for a tqdm bar, False for lines; None: a bar when `stream` is a terminal.
        metric: name of the test metric ("accuracy").
        max_seconds: --max-seconds, for the ETA.
        clock: time source (tests).
    """

    def __init__(self, enabled: bool, total_epochs: int, samples_per_epoch: int,
                 interval: float = 5.0, stream: Optional[TextIO] = None, bar: Optional[bool] = None,
                 metric: str = "accuracy", max_seconds: Optional[float] = None, clock=time.monotonic):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.total = total_epochs * samples_per_epoch
        self.epochs = total_epochs
        self.per_epoch = samples_per_epoch
        self.interval = interval
        self.metric_name = metric
        self.max_seconds = max_seconds
        self.clock = clock
        self.t0 = clock()
        self.train_t0 = 0.0          # training seconds already done before this process
        self.start_done: Optional[int] = None
        self._next_line = self.t0 + min(FIRST_LINE_S, interval)
        self.done = 0
        self.epoch = 0
        self.metric: Optional[float] = None
        self.lost: list[int] = []
        self.workers: dict[int, float] = {}
        self._loss_sum = 0.0          # sum of loss x batch since the last line
        self._loss_n = 0
        self.loss: Optional[float] = None
        self._bar = None
        if bar is None:
            bar = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._want_bar = enabled and bar

    # ------------------------------------------------------------------ inputs
    def begin(self, epoch: int, epoch_samples: int, train_s: float = 0.0) -> None:
        """Training starts (or resumes) here: rates count samples from this point on."""
        self.t0 = self.clock()
        self._next_line = self.t0 + min(FIRST_LINE_S, self.interval)
        self.train_t0 = train_s
        self.epoch = epoch
        self.done = self.start_done = epoch * self.per_epoch + epoch_samples
        if self.enabled and not self._want_bar:
            how = "resumed" if self.done else "started"
            self._print(f"mpilb [{0.0:7.1f} s] epoch {min(epoch + 1, self.epochs)}/{self.epochs}, "
                        f"{self.done}/{self.total} samples, training {how}")
        if self._want_bar and self.enabled:
            from tqdm import tqdm

            if self._bar is not None:
                self._bar.close()
            # `initial`: the bar's rate counts only what this process applies
            self._bar = tqdm(total=self.total, initial=self.done, unit="sample", unit_scale=True,
                             file=self.stream, dynamic_ncols=True, leave=True)

    def row(self, group: str, row: dict) -> None:
        """A run-log row: training loss (updates/), test metric (eval/), rates (workers/)."""
        if group == "updates":
            b = row.get("batch", 0)
            loss = row.get("loss", 0.0)
            if b and loss == loss:   # not NaN
                self._loss_sum += loss * b
                self._loss_n += b
        elif group == "eval":
            value = row.get("test_metric", row.get("test_accuracy"))
            if value is not None and value == value:
                self.metric = float(value)
        elif group == "workers" and row.get("rate"):
            self.workers[int(row["worker"])] = float(row["rate"])

    def update(self, epoch: int, epoch_samples: int, version: int = 0,
               accuracy: Optional[float] = None, workers: Optional[dict] = None,
               lost: Optional[list] = None) -> None:
        """Where training is: `epoch_samples` applied in `epoch` so far.

        `accuracy` (the test metric) and `workers` (rank -> samples/s) override what the
        log rows said; `lost`: ranks declared lost.
        """
        if not self.enabled:
            return
        if self.start_done is None:
            self.begin(epoch, epoch_samples)
        if accuracy is not None:
            self.metric = accuracy
        if workers:
            self.workers = dict(workers)
        if lost is not None:
            self.lost = list(lost)
        self.epoch = epoch
        done = epoch * self.per_epoch + epoch_samples
        if self._bar is not None:
            if done > self.done:
                self._bar.update(done - self.done)
                self.done = done
                self._bar.set_postfix(self._postfix(), refresh=False)
            return
        self.done = max(self.done, done)
        now = self.clock()
        if now >= self._next_line:
            self._next_line = now + self.interval
            self._print(self.status_line(now))

    def epoch_done(self, epoch: int, accuracy: Optional[float]) -> None:
        self.update(epoch + 1, 0, 0, accuracy)

    # ------------------------------------------------------------------ output
    def rate(self, now: Optional[float] = None) -> float:
        """Samples/s over the samples applied by this process since it began."""
        now = self.clock() if now is None else now
        return (self.done - (self.start_done or 0)) / max(1e-9, now - self.t0)

    def _take_loss(self) -> Optional[float]:
        if self._loss_n:
            self.loss = self._loss_sum / self._loss_n
            self._loss_sum, self._loss_n = 0.0, 0
        return self.loss

    def _postfix(self) -> dict:
        post = {"epoch": f"{min(self.epoch + 1, self.epochs)}/{self.epochs}"}
        loss = self._take_loss()
        if loss is not None:
            post["loss"] = f"{loss:.4f}"
        if self.metric is not None:
            post[self.metric_name[:8]] = f"{self.metric:.4f}"
        if self.lost:
            post["lost"] = ",".join(map(str, self.lost))
        return post

    def status_line(self, now: float) -> str:
        """One line: elapsed, epoch, samples, rate, ETA, loss, metric, rates, lost workers."""
        elapsed = now - self.t0
        rate = self.rate(now)
        parts = [f"epoch {min(self.epoch + 1, self.epochs)}/{self.epochs}",
                 f"{self.done}/{self.total} samples", f"{rate:,.0f} samples/s"]
        if rate > 0:
            eta = (self.total - self.done) / rate
            if self.max_seconds is not None:
                eta = min(eta, self.max_seconds - self.train_t0 - elapsed)
            parts.append(f"ETA {_duration(eta)}")
        loss = self._take_loss()
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if self.metric is not None:
            parts.append(f"{self.metric_name} {self.metric:.4f}")
        if len(self.workers) > 1:
            slow = min(self.workers, key=self.workers.get)
            fast = max(self.workers, key=self.workers.get)
            parts.append(f"slowest rank {slow} ({self.workers[slow]:,.0f}/s), "
                         f"fastest rank {fast} ({self.workers[fast]:,.0f}/s)")
        if self.lost:
            parts.append(f"lost workers {self.lost}")
        return f"mpilb [{elapsed:7.1f} s] " + ", ".join(parts)

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def close(self, summary: Optional[dict] = None) -> None:
        """End the display; with the run's summary, the last figures are the summary's."""
        if not self.enabled:
            return
        if summary is not None:
            if summary.get("final_test_metric") is not None:
                self.metric = summary["final_test_metric"]
            if summary.get("final_train_loss") is not None:
                self.loss, self._loss_n = summary["final_train_loss"], 0
            self.lost = list(summary.get("lost_workers") or [])
        if self._bar is not None:
            self._bar.set_postfix(self._postfix(), refresh=True)
            self._bar.close()
            self._bar = None
        elif summary is not None:
            self._print(self.final_line(summary))

    def final_line(self, summary: dict) -> str:
        """The last line: the summary's figures (over the whole run, resumptions included)."""
        parts = [f"{summary['status']}: {summary['epochs_completed']}/{self.epochs} epochs",
                 f"{summary['samples']} samples in {summary['train_s']:.1f} s",
                 f"{summary['samples_per_s']:,.0f} samples/s"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.metric is not None:
            parts.append(f"{self.metric_name} {self.metric:.4f}")
        if self.lost:
            parts.append(f"lost workers {self.lost}")
        return f"mpilb [{self.clock() - self.t0:7.1f} s] " + ", ".join(parts)
