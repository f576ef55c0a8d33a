"""Run one simulated configuration with the server's epoch order and coverage counter."""

from __future__ import annotations

from mpilb.run.training import EpochTracker, epoch_order
from mpilb.simulate.engine import Engine, SimConfig
from mpilb.simulate.netengine import NetEngine


def simulate(profiles, shard_sizes, replay: bool = False, layout=None, **config) -> dict:
    """Simulate one configuration (keywords: :class:`.engine.SimConfig` fields) on
    ``profiles`` (:class:`.cluster.Profile`, one per worker; with ``layout``, one per MPI
    rank); returns its figures."""
    return run(SimConfig(**config), profiles, shard_sizes, replay, layout)


def run(cfg: SimConfig, profiles, shard_sizes, replay: bool = False, layout=None) -> dict:
    """Simulate ``cfg`` on ``profiles``; returns its figures (see docs/simulate.md). With a
    :class:`.network.Layout`, on its network (``profiles``: one per MPI rank)."""
    tracker = EpochTracker(list(shard_sizes))
    if layout is not None:
        return NetEngine(cfg, profiles, shard_sizes, replay, order=epoch_order,
                         tracker=tracker, layout=layout).run()
    return Engine(cfg, profiles, shard_sizes, replay, order=epoch_order, tracker=tracker).run()
