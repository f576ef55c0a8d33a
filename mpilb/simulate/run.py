"""Run one simulated configuration (the engine, or on a network the network engine)."""

from __future__ import annotations

from mpilb.simulate.engine import Engine
from mpilb.simulate.netengine import NetEngine
from mpilb.simulate.workers import SimConfig


def simulate(profiles, shard_sizes, replay: bool = False, layout=None, **config) -> dict:
    """Simulate one configuration (keywords: :class:`.workers.SimConfig` fields) on
    ``profiles`` (:class:`.cluster.Profile`, one per worker; with ``layout``, one per MPI
    rank); returns its figures."""
    return run(SimConfig(**config), profiles, shard_sizes, replay, layout)


def run(cfg: SimConfig, profiles, shard_sizes, replay: bool = False, layout=None) -> dict:
    """Simulate ``cfg`` on ``profiles``; returns its figures (see docs/simulate.md). With a
    :class:`.network.Layout`, on its network (``profiles``: one per MPI rank)."""
    if layout is not None:
        return NetEngine(cfg, profiles, shard_sizes, replay, layout=layout).run()
    return Engine(cfg, profiles, shard_sizes, replay).run()
