"""Expected staleness of asynchronous updates from the workers' rates (pure).

In async mode every gradient is applied on arrival, so a gradient computed by worker i
(samples per second r_i, all workers together R) finds the parameters moved on by the
updates the others applied while it computed: (R - r_i) / r_i of them. Computing ahead
(--pipeline 1) starts the next gradient before the previous push is applied, on parameters
one compute period older: R / r_i more. Averaged over the gradients applied (worker i
applies a share r_i / R of them) this is W - 1 without pipelining and 2W - 1 with it, whatever
the rates; a slow worker's own gradients are the stalest. Measured means lie a little
below (docs/benchmarks/staleness.md: the pushes of workers that share a core bunch up).
"""

from __future__ import annotations

from typing import Sequence


def worker_staleness(rates: Sequence[float], pipeline: int = 0) -> list[float]:
    """Expected staleness of each worker's gradients, given the workers' rates."""
    total = float(sum(rates))
    return [(total - r) / r + (total / r if pipeline else 0.0) for r in rates]


def mean_staleness(rates: Sequence[float], pipeline: int = 0) -> float:
    """Expected mean staleness over all applied gradients (each worker weighted by rate)."""
    total = float(sum(rates))
    return sum(r / total * s for r, s in zip(rates, worker_staleness(rates, pipeline)))
