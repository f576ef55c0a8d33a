"""Learning-rate schedules, applied by the server on its update counter (``--lr-schedule``,
``--warmup``).

A schedule is a factor on ``--lr`` as a function of the server's version (the number of
updates applied so far) and of the training time; the server multiplies each update's
``lr_scale`` by it, so every optimizer and every mode gets the same schedule, and it is
logged in ``updates/lr_scale``. Pure: no MPI, no clock of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("constant", "step", "cosine")
STEP_AT = (0.5, 0.75)     # the step schedule divides by 10 at these fractions of the run
STEP_GAMMA = 0.1


def parse_warmup(text) -> tuple[int, float]:
    """``"200"`` -> (200 updates, 0 s); ``"5s"`` -> (0, 5.0 seconds)."""
    text = str(text).strip()
    if text.endswith("s"):
        return 0, float(text[:-1])
    return int(text), 0.0


@dataclass
class Schedule:
    """The factor on the learning rate at an update.

    Attributes:
        kind: "constant", "step" or "cosine".
        total_updates: the updates the run is expected to apply (epochs x updates per
            epoch); "step" and "cosine" are laid out over it.
        warmup_updates: linear warmup from 1/warmup_updates to 1 over this many updates.
        warmup_s: or over this many seconds of training.
    """

    kind: str = "constant"
    total_updates: int = 1
    warmup_updates: int = 0
    warmup_s: float = 0.0

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.kind!r}; expected one of {', '.join(SCHEDULES)}")
        self.total_updates = max(1, int(self.total_updates))

    @property
    def is_constant(self) -> bool:
        return self.kind == "constant" and not self.warmup_updates and not self.warmup_s

    def __call__(self, version: int, elapsed_s: float = 0.0) -> float:
        """Factor for the update that takes the server from ``version`` to ``version + 1``."""
        factor = 1.0
        frac = min(1.0, max(0, version) / self.total_updates)
        if self.kind == "step":
            factor = STEP_GAMMA ** sum(frac >= at for at in STEP_AT)
        elif self.kind == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * frac))
        if self.warmup_updates and version < self.warmup_updates:
            factor *= (version + 1) / self.warmup_updates
        if self.warmup_s and elapsed_s < self.warmup_s:
            factor *= max(elapsed_s, 1e-3 * self.warmup_s) / self.warmup_s
        return factor


def build_schedule(cfg, shard_sizes, workers: int = 1) -> Schedule:
    """The run's schedule from the config: an update is one worker's batch (async, ssp: each
    shard ends with a smaller one) or one round of every worker's batch (sync).

    Args:
        shard_sizes: samples per shard (a list), or samples per epoch (an int).
    """
    sizes = [shard_sizes] if isinstance(shard_sizes, int) else list(shard_sizes)
    if cfg.updates.mode == "sync":
        updates_per_epoch = math.ceil(sum(sizes) / max(1, cfg.balancing.batch * workers))
    else:
        updates_per_epoch = sum(math.ceil(s / cfg.balancing.batch) for s in sizes)
    steps, seconds = parse_warmup(cfg.optim.warmup)
    return Schedule(cfg.optim.lr_schedule, cfg.stopping.epochs * updates_per_epoch, steps, seconds)
