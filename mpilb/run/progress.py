"""Live progress on rank 0: a tqdm bar on a terminal, a timestamped status line otherwise.

Under ``mpiexec`` the launcher pipes every rank's stderr, so rank 0 almost never sees a
terminal there: it then prints a line when training starts and one per
``--progress-interval`` seconds, the first of them a second after the start (sooner for a
shorter interval). The interval defaults to 5 s when a terminal is upstream (an interactive
``mpiexec``) and to 60 s in a batch job, whose output file would otherwise fill with lines.
The run's one last line (``mpilb: finished: ...``, on standard output) is the driver's, not
this display's. The rate is computed over the samples applied by this process since it
started, so a resumed run does not count its predecessor's samples; the slowest and fastest
workers' rates are their samples applied per second since the previous line, so that the
workers' rates add up to the job's.

Epochs are numbered from 1 here, as in ``mpilb report``; the run log stores the index from 0.

Progress learns the training loss and the test metric from the run-log rows it is shown
(:meth:`Progress.row`, fed by :class:`LogTap`), so the training loops only tell it where
they are in the epoch.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Iterable, Optional, TextIO

# The first status line comes at most this many seconds after the start.
FIRST_LINE_S = 1.0
# --progress-interval's default: someone at a terminal, or a batch job's output file
WATCHED_INTERVAL_S = 5.0
BATCH_INTERVAL_S = 60.0


def terminal_upstream(stream: TextIO, proc: str = "/proc") -> bool:
    """Whether the lines written to `stream` end up on a terminal: `stream` is one, or it is
    a pipe to a launcher (mpiexec, its proxy) whose standard error is one. The launcher's
    plumbing is followed up the parent processes (Linux /proc) while it is pipes; a file
    (a batch job's output), a socket or an unreadable process (slurmstepd) ends the search."""
    if hasattr(stream, "isatty") and stream.isatty():
        return True
    try:
        pid, target = os.getpid(), os.readlink(f"{proc}/self/fd/{stream.fileno()}")
        for _ in range(8):
            if not target.startswith("pipe:"):
                return target.startswith(("/dev/pts/", "/dev/tty"))
            with open(f"{proc}/{pid}/stat") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])   # the parent
            if pid <= 1:
                return False
            target = os.readlink(f"{proc}/{pid}/fd/2")
    except (OSError, ValueError, IndexError, AttributeError):   # (io.UnsupportedOperation too)
        return False
    return False


def default_interval(stream: TextIO) -> float:
    """--progress-interval's default: 5 s when someone can watch, 60 s in a batch job."""
    return WATCHED_INTERVAL_S if terminal_upstream(stream) else BATCH_INTERVAL_S


class LogTap:
    """A run log that also shows every row it appends to a few observers.

    Wraps a :class:`~mpilb.runfiles.runlog.RunLog`; `append` passes each row on to every observer's
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
        interval: seconds between status lines (--progress-interval); None: 5 s when a
            terminal is upstream, else 60 s (:func:`default_interval`).
        stream: where to write (stderr).
        bar: True for a tqdm bar, False for lines; None: a bar when `stream` is a terminal.
        metric: name of the test metric ("accuracy").
        max_seconds: --max-seconds, for the ETA.
        clock: time source (tests).
    """

    def __init__(self, enabled: bool, total_epochs: int, samples_per_epoch: int,
                 interval: Optional[float] = None, stream: Optional[TextIO] = None,
                 bar: Optional[bool] = None,
                 metric: str = "accuracy", max_seconds: Optional[float] = None, clock=time.monotonic):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.total = total_epochs * samples_per_epoch
        self.epochs = total_epochs
        self.per_epoch = samples_per_epoch
        self.interval = default_interval(self.stream) if interval is None else interval
        self.metric_name = metric
        self.max_seconds = max_seconds
        self.clock = clock
        self.t0 = clock()
        self.train_t0 = 0.0          # training seconds already done before this process
        self.start_done: Optional[int] = None
        self._next_line = self.t0 + min(FIRST_LINE_S, self.interval)
        self.done = 0
        self.epoch = 0
        self.metric: Optional[float] = None
        self.lost: list[int] = []
        self.workers: set[int] = set()        # the ranks working now
        self._applied: dict[int, int] = {}    # samples each applied since the last line
        self._window_t0 = self.t0
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
        self.t0 = self._window_t0 = self.clock()
        self._next_line = self.t0 + min(FIRST_LINE_S, self.interval)
        self._applied = {}
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
        """A run-log row: training loss and each worker's applied samples (updates/), test
        metric (eval/)."""
        if group == "updates":
            b = row.get("batch", 0)
            loss = row.get("loss", 0.0)
            if b and loss == loss:   # not NaN
                self._loss_sum += loss * b
                self._loss_n += b
            if b and "worker" in row:
                w = int(row["worker"])
                self._applied[w] = self._applied.get(w, 0) + int(b)
        elif group == "eval":
            value = row.get("test_metric", row.get("test_accuracy"))
            if value is not None and value == value:
                self.metric = float(value)
        elif group == "workers":
            self.workers.add(int(row["worker"]))

    def update(self, epoch: int, epoch_samples: int, version: int = 0,
               accuracy: Optional[float] = None, workers: Optional[Iterable[int]] = None,
               lost: Optional[list] = None) -> None:
        """Where training is: `epoch_samples` applied in `epoch` so far (`epoch` counts
        from 0, as the log does).

        `accuracy` (the test metric) overrides what the log rows said; `workers`: the ranks
        working now (one that applied nothing since the last line shows a rate of 0);
        `lost`: ranks declared lost.
        """
        if not self.enabled:
            return
        if self.start_done is None:
            self.begin(epoch, epoch_samples)
        if accuracy is not None:
            self.metric = accuracy
        if workers is not None:
            self.workers = set(workers)
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

    def worker_rates(self, now: float) -> dict[int, float]:
        """Samples each worker applied per second since the previous line (they add up to
        the job's rate over that time); the count starts again."""
        seconds = max(1e-9, now - self._window_t0)
        ranks = self.workers | set(self._applied)
        rates = {r: self._applied.get(r, 0) / seconds for r in sorted(ranks)}
        self._applied, self._window_t0 = {}, now
        return rates

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
        rates = self.worker_rates(now)
        if len(rates) > 1:
            slow, fast = min(rates, key=rates.get), max(rates, key=rates.get)
            parts.append(f"slowest rank {slow} ({rates[slow]:,.0f}/s), "
                         f"fastest rank {fast} ({rates[fast]:,.0f}/s)")
        if self.lost:
            parts.append(f"lost workers {self.lost}")
        return f"mpilb [{elapsed:7.1f} s] " + ", ".join(parts)

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def close(self, summary: Optional[dict] = None) -> None:
        """End the display; a bar ends on the summary's figures. Lines end without a line of
        their own: the run's last line, on standard output, says how it ended (one
        `finished`, not two that `2>&1` puts side by side)."""
        if not self.enabled or self._bar is None:
            return
        if summary is not None:
            if summary.get("final_test_metric") is not None:
                self.metric = summary["final_test_metric"]
            if summary.get("final_train_loss") is not None:
                self.loss, self._loss_n = summary["final_train_loss"], 0
            self.lost = list(summary.get("lost_workers") or [])
        self._bar.set_postfix(self._postfix(), refresh=True)
        self._bar.close()
        self._bar = None
