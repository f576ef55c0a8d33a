"""Load-balancing policies: which worker consumes which shard, with what batch size.

Pure Python: no MPI, no clocks (times are passed in), so the live server (rank 0), the unit
tests and :mod:`mpilb.simulate` drive the same code. What each policy does is in docs/cli.md
("Modes, corrections, balancers") and docs/balancing.md; the protocol they share:

- ``plan_epoch(epoch, order)`` at each epoch start builds the per-worker queues of
  *unstarted* shards; ``next_shard(w)`` hands one out when a worker needs a new current or
  prefetch ("next") shard. Handed-out shards are *committed* and never move. It may
  answer None to a worker that still holds work, keeping a shard back for a worker that
  will finish it sooner (see :class:`LoadBalancer`); a worker with nothing left always
  gets one if any is queued for it.
- ``observe(...)`` takes every report; ``rebalance(t, committed)`` runs every
  ``rebalance_interval`` seconds and may move unstarted shards; ``batch_sizes()`` follows.
  Between rebalances the balancer keeps its own count of each worker's committed samples
  (handed out minus reported), so steals and hand-outs see the present.
- Projected times are wall-clock: ``samples * (1 / rate + overhead)``, where ``rate`` is
  the worker's compute + I/O speed and ``overhead`` its communication seconds per sample
  (see :mod:`mpilb.core.rates`).
- ``remove_worker(w)`` hands a lost worker's queue to the others; ``requeue(shards)`` takes
  back its committed shards. ``take_moves()`` returns every move made since the last call.

Policies register by name (:data:`BALANCERS`, :func:`build_balancer`); batch-size policies
likewise (:data:`BATCH_POLICIES`).

The package: :mod:`.base` (registry, knobs, moves, queues), :mod:`.estimates` (rates and
projected times), :mod:`.policies` (the policies), :mod:`.sizes` (batch sizes,
:func:`build_balancer`).
"""

from mpilb.core.balancer.base import BALANCERS, BATCH_POLICIES, Balancer, BalancerConfig, Move, register, register_batch_policy
from mpilb.core.balancer.estimates import _EPS, _NONLINEAR, STEP_ALPHA, RateEstimates
from mpilb.core.balancer.policies import DemandBalancer, LoadBalancer, PredictiveBalancer, RoundRobinBalancer, StaticBalancer
from mpilb.core.balancer.sizes import build_balancer, fixed_batches, proportional_batches

__all__ = ["BALANCERS", "BATCH_POLICIES", "Balancer", "BalancerConfig", "Move", "register",
           "register_batch_policy", "STEP_ALPHA", "RateEstimates", "DemandBalancer",
           "LoadBalancer", "PredictiveBalancer", "RoundRobinBalancer", "StaticBalancer",
           "build_balancer", "fixed_batches", "proportional_batches", "_EPS", "_NONLINEAR"]
