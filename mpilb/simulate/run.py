"""Run one simulated configuration with the server's epoch order and coverage counter."""

from __future__ import annotations

from ..training import EpochTracker, epoch_order
from .engine import Engine, SimConfig


def simulate(profiles, shard_sizes, replay: bool = False, **config) -> dict:
    """Simulate one configuration (keywords: :class:`.engine.SimConfig` fields) on
    ``profiles`` (:class:`.cluster.Profile`, one per worker); returns its figures."""
    return run(SimConfig(**config), profiles, shard_sizes, replay)


def run(cfg: SimConfig, profiles, shard_sizes, replay: bool = False) -> dict:
    """Simulate ``cfg`` on ``profiles``; returns its figures (see docs/simulate.md)."""
    return Engine(cfg, profiles, shard_sizes, replay, order=epoch_order,
                  tracker=EpochTracker(list(shard_sizes))).run()
