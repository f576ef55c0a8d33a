"""Live progress on rank 0: a tqdm bar on a terminal, a status line every few seconds otherwise."""

from __future__ import annotations

import sys
import time
from typing import Optional


class Progress:
    """Progress display.

    Args:
        enabled: False for --no-progress.
        total_epochs: epochs planned.
        samples_per_epoch: samples in one epoch.
        line_interval: seconds between status lines when stderr is not a terminal.
    """

    def __init__(self, enabled: bool, total_epochs: int, samples_per_epoch: int,
                 line_interval: float = 5.0, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.total = total_epochs * samples_per_epoch
        self.per_epoch = samples_per_epoch
        self.line_interval = line_interval
        self.t0 = time.monotonic()
        self._last_line = self.t0
        self._bar = None
        self._done = 0
        self.accuracy: Optional[float] = None
        self.metric = "accuracy"   # the model's metric, which `accuracy` holds
        if enabled and hasattr(self.stream, "isatty") and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, unit="sample", unit_scale=True,
                             file=self.stream, dynamic_ncols=True, leave=True)

    def update(self, epoch: int, epoch_samples: int, version: int,
               accuracy: Optional[float] = None, workers: Optional[dict] = None) -> None:
        """Report progress: samples applied in `epoch` so far; `workers`: rank -> samples/s."""
        if not self.enabled:
            return
        if accuracy is not None:
            self.accuracy = accuracy
        done = epoch * self.per_epoch + epoch_samples
        now = time.monotonic()
        if self._bar is not None:
            if done > self._done:
                self._bar.update(done - self._done)
                self._done = done
                post = {"epoch": epoch}
                if self.accuracy is not None:
                    post["acc" if self.metric == "accuracy" else self.metric] = f"{self.accuracy:.3f}"
                self._bar.set_postfix(post, refresh=False)
            return
        if now - self._last_line < self.line_interval:
            return
        self._last_line = now
        rate = done / max(1e-9, now - self.t0)
        parts = [f"epoch {epoch}", f"{done}/{self.total} samples", f"{rate:.0f} samples/s"]
        if self.accuracy is not None:
            parts.append(f"{self.metric} {self.accuracy:.4f}")
        if workers:
            slow = min(workers, key=workers.get)
            fast = max(workers, key=workers.get)
            parts.append(f"slowest rank {slow} ({workers[slow]:.0f}/s), fastest rank {fast} ({workers[fast]:.0f}/s)")
        print("mpilb: " + ", ".join(parts), file=self.stream, flush=True)

    def epoch_done(self, epoch: int, accuracy: Optional[float]) -> None:
        if accuracy is not None:
            self.accuracy = accuracy
        self.update(epoch + 1, 0, 0, accuracy)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
