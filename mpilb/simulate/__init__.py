"""`mpilb simulate`: what-if replays of real runs, and simulated clusters of 10^3 workers.

The engine (:mod:`.engine`) drives the live server's balancer (:mod:`mpilb.balancer`),
rate estimators (:mod:`mpilb.rates`), batch policies and coverage tracker on simulated
workers (:mod:`.cluster`: profiles and parameter stores); :mod:`.ledger` is the task ledger;
:mod:`.replay` reads a run log for ``--from``; :mod:`.main` is the command. The model and its
assumptions: docs/simulate.md.

This package imports nothing heavy at import time, so ``mpilb --help`` stays quick.
"""

from __future__ import annotations


def simulate(profiles, shard_sizes, replay: bool = False, **config) -> dict:
    """Simulate one configuration (keywords: :class:`.engine.SimConfig` fields) on
    ``profiles`` (:class:`.cluster.Profile`, one per worker); returns its figures."""
    from .engine import Engine, SimConfig

    return Engine(SimConfig(**config), profiles, shard_sizes, replay=replay).run()
