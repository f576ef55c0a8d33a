"""--save-best: the checkpoint of the best evaluation so far, beside the run's checkpoint.

The metric that decides is the one --target-* look at (``Evaluation.decides``): the
validation metric with --validation-fraction, else the test metric; higher is better (as
for --target-metric). The file has the checkpoint format with the evaluated parameters, and
a ``best`` attribute (metric, its name, epoch and update of the eval row), so that
``mpilb export``, ``mpilb evaluate`` and ``mpilb.load`` read it like any checkpoint, while
``--resume`` refuses it: with a background evaluation its coverage and optimizer state are
the run's a moment later than its parameters.

    keeper = BestCheckpoint(cfg)
    keeper.offer(evaluation, params, epoch, version, save)   # after each eval row
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional

import h5py
import numpy as np


def best_path(checkpoint: str) -> str:
    """``runs/007.ckpt.h5`` -> ``runs/007.best.ckpt.h5`` (``x.h5`` -> ``x.best.h5``)."""
    p = Path(checkpoint)
    for suffix in (".ckpt.h5", ".h5"):
        if p.name.endswith(suffix):
            return str(p.with_name(p.name[:-len(suffix)] + ".best" + suffix))
    return str(p.with_name(p.name + ".best"))


def read_best(path: str) -> Optional[dict]:
    """The ``best`` attribute of a best checkpoint, or None (no such file, or not one)."""
    try:
        with h5py.File(path, "r", locking=False) as f:
            text = f.attrs.get("best")
    except OSError:
        return None
    return json.loads(text) if text is not None else None


class BestCheckpoint:
    """Keeps RUN.best.ckpt.h5 at the best evaluation of the run (--save-best).

    A new run (or --overwrite) starts from nothing and replaces an older file of that
    name at its first evaluation; --resume continues from the file's recorded best.
    """

    def __init__(self, cfg):
        self.path = best_path(cfg.checkpoint or cfg.log)
        self.best = read_best(self.path) if cfg.resume else None
        if not cfg.resume:   # an older run's of this name would be reported as this one's
            Path(self.path).unlink(missing_ok=True)

    @property
    def metric(self) -> float:
        return -math.inf if self.best is None else float(self.best["metric"])

    def offer(self, evaluation, params: np.ndarray, epoch: int, version: int,
              save: Callable[[str, np.ndarray, dict], None]) -> bool:
        """After an eval row of `params` (update `version`, in `epoch`): when its deciding
        metric beats the best so far, ``save(path, params, best)`` writes the checkpoint."""
        value = float(evaluation.decides[1])
        if not value > self.metric:   # (NaN never is)
            return False
        which = "validation" if evaluation.val_metric is not None else "test"
        best = {"metric": value, "metric_name": f"{which} {evaluation.metric_name}",
                "epoch": int(epoch), "version": int(version)}
        save(self.path, params, best)
        self.best = best
        return True


def best_line(cfg) -> str:
    """What the run's last lines say of its best checkpoint ('' without --save-best)."""
    if not getattr(cfg, "save_best", False):
        return ""
    path = best_path(cfg.checkpoint or cfg.log)
    best = read_best(path)
    if best is None:
        return "mpilb: --save-best: no evaluation was made, no best checkpoint written"
    return (f"mpilb: best {best['metric_name']} {best['metric']:.4f} at update "
            f"{best['version']} (epoch {best['epoch']} in the run log): {path}")
