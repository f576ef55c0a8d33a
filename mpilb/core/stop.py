"""When a run stops: --epochs, --max-seconds, --target-accuracy, --target-metric.

Pure: the server and the serial trainer decide with the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class StopRule:
    """--epochs, --max-seconds, --target-accuracy, --target-metric: whichever comes first.

    ``check`` takes the latest :class:`mpilb.run.evaluation.Evaluation` (or a plain accuracy, or None).
    """

    epochs: int
    max_seconds: Optional[float]
    target_accuracy: Optional[float]
    target_metric: Optional[float] = None
    reason: str = ""

    @property
    def waits_on_evaluations(self) -> bool:
        """A --target-* stop: an epoch's evaluation decides whether the run goes on."""
        return self.target_accuracy is not None or self.target_metric is not None

    def check(self, epochs_done: int, elapsed: float, evaluation=None) -> bool:
        if hasattr(evaluation, "decides"):   # an Evaluation (mpilb.run.evaluation)
            accuracy, metric = evaluation.decides
        else:
            accuracy, metric = evaluation, None
        if epochs_done >= self.epochs:
            self.reason = "epochs"
        elif self.max_seconds is not None and elapsed >= self.max_seconds:
            self.reason = "max_seconds"
        elif (self.target_accuracy is not None and accuracy is not None
              and accuracy >= self.target_accuracy):
            self.reason = "target_accuracy"
        elif (self.target_metric is not None and metric is not None
              and metric >= self.target_metric):
            self.reason = "target_metric"
        return bool(self.reason)


def build_stop_rule(cfg) -> StopRule:
    """The stop rule of a run's configuration (--epochs, --max-seconds, --target-*)."""
    return StopRule(cfg.epochs, cfg.max_seconds, cfg.target_accuracy, cfg.target_metric)
