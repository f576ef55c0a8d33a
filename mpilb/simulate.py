"""Discrete-event simulator that drives a :class:`~mpilb.balancer.Balancer` like the server.

W workers process shards at rates ``rate_w(t)`` (samples/s), one step of ``batch`` samples at
a time, each step reported to the balancer. A worker holds a current shard and prefetches one
"next" shard (both committed); epochs are strict (an idle worker waits for the epoch to end);
the balancer rebalances every ``rebalance_interval`` seconds and at epoch boundaries. Workers
may be lost at given times: their queue is reassigned (``remove_worker``) and their committed
shards requeued, as the server does.

``python -m mpilb.simulate`` prints a table comparing the policies on two scenarios.
"""

from __future__ import annotations


from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .balancer import BALANCERS, BalancerConfig, Move, build_balancer


@dataclass
class SimResult:
    """What a simulated run did.

    Attributes:
        epoch_s: duration of each epoch.
        busy_s: per worker, total busy (compute) seconds.
        utilization: per epoch, busy seconds / (workers * epoch seconds).
        moves: every move the balancer reported.
        processed: per epoch, Counter of shard -> times fully processed.
        handed: per epoch, Counter of shard -> times handed out by next_shard.
    """

    epoch_s: list[float] = field(default_factory=list)
    busy_s: dict[int, float] = field(default_factory=dict)
    utilization: list[float] = field(default_factory=list)
    moves: list[Move] = field(default_factory=list)
    processed: list[Counter] = field(default_factory=list)
    handed: list[Counter] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        """Wall time of the whole run."""
        return float(sum(self.epoch_s))


def simulate(policy: str, rate_fns: list[Callable[[float], float]], shard_sizes: list[int],
             epochs: int = 1, config: BalancerConfig | None = None, seed: int = 0,
             noise: float = 0.0, lost: dict[int, float] | None = None) -> SimResult:
    """Run ``epochs`` strict epochs under balancer ``policy``.

    Args:
        policy: a registered balancer name.
        rate_fns: one function per worker (ranks 1..W) giving samples/s at time t.
        shard_sizes: samples per shard.
        epochs: epochs to run.
        config: balancer knobs (batch, interval, ...).
        seed: seeds the epoch shuffles and the noise.
        noise: each step's duration is multiplied by uniform(1-noise, 1+noise).
        lost: {worker rank: time} at which that worker disappears.

    Returns:
        A :class:`SimResult`.
    """
    config = config or BalancerConfig()
    rng = np.random.default_rng(seed)
    workers = list(range(1, len(rate_fns) + 1))
    rate_of = dict(zip(workers, rate_fns))
    bal = build_balancer(policy, workers, shard_sizes, config)
    result = SimResult(busy_s={w: 0.0 for w in workers})
    lost = dict(lost or {})
    alive = set(workers)
    t = 0.0
    next_rebalance = config.rebalance_interval

    for epoch in range(epochs):
        order = [int(s) for s in rng.permutation(len(shard_sizes))]
        bal.rebalance(t, {w: 0 for w in alive})
        bal.plan_epoch(epoch, order)
        t_start = t
        busy_epoch = 0.0
        handed: Counter = Counter()
        processed: Counter = Counter()
        held: dict[int, list[int]] = {w: [] for w in alive}     # current (+ next) shard
        left: dict[int, int] = {}                               # samples left in current
        free_at: dict[int, float] = {w: t for w in alive}       # when the worker next acts

        def fetch(w: int) -> None:
            shard = bal.next_shard(w)
            if shard is not None:
                handed[shard] += 1
                held[w].append(shard)
                if len(held[w]) == 1:
                    left[w] = shard_sizes[shard]

        def refill(now: float) -> None:
            # Like the server after a rebalance or a loss: top every worker up to a current
            # and a next shard, waking idle ones if shards were moved to them.
            for v in sorted(alive):
                while len(held[v]) < 2:
                    count = len(held[v])
                    fetch(v)
                    if len(held[v]) == count:
                        break
                free_at[v] = max(free_at[v], now)

        refill(t)
        while True:
            active = [w for w in alive if held[w]]
            if not active:
                break
            w = min(active, key=lambda v: (free_at[v], v))
            now = free_at[w]
            # Events due before this step: losses, then rebalances.
            due_loss = [v for v, when in lost.items() if v in alive and when <= now]
            if due_loss:
                for v in due_loss:
                    alive.discard(v)
                    del lost[v]
                    bal.remove_worker(v)
                    bal.requeue(held.pop(v))
                    left.pop(v, None)
                refill(now)
                continue
            if now >= next_rebalance:
                committed = {v: (left.get(v, 0) + sum(shard_sizes[s] for s in held[v][1:])
                                 if held[v] else 0) for v in alive}
                bal.rebalance(next_rebalance, committed)
                result.moves.extend(bal.take_moves())
                next_rebalance += config.rebalance_interval
                refill(now)
                continue
            batch = bal.batch_sizes().get(w, config.batch)
            n = min(batch, left[w])
            step = n / max(rate_of[w](now), 1e-9)
            if noise:
                step *= rng.uniform(1.0 - noise, 1.0 + noise)
            end = now + step
            free_at[w] = end
            left[w] -= n
            result.busy_s[w] += step
            busy_epoch += step
            bal.observe(w, end, n, step)
            if left[w] == 0:
                processed[held[w].pop(0)] += 1
                if held[w]:
                    left[w] = shard_sizes[held[w][0]]
                fetch(w)
                if len(held[w]) == 1:       # keep one prefetched
                    fetch(w)
            result.moves.extend(bal.take_moves())
        t = max([t_start] + [free_at[w] for w in alive])
        result.epoch_s.append(t - t_start)
        result.utilization.append(busy_epoch / (len(alive) * (t - t_start)) if t > t_start else 0.0)
        result.processed.append(processed)
        result.handed.append(handed)
    result.moves.extend(bal.take_moves())
    return result


def scenarios() -> dict[str, tuple[list[Callable[[float], float]], list[int]]]:
    """Named scenarios for three workers: (rates in samples/s, shard sizes)."""
    return {
        "1 slow of 3 (100, 100, 25 samples/s), 48 shards x 100": (
            [lambda t: 100.0, lambda t: 100.0, lambda t: 25.0], [100] * 48),
        "1 ramping down (100 - 6t, floor 5 samples/s), 96 shards x 50": (
            [lambda t: 100.0, lambda t: 100.0, lambda t: max(5.0, 100.0 - 6.0 * t)], [50] * 96),
        "1 ramping down (100 - 6t, floor 5 samples/s), 48 shards x 100": (
            [lambda t: 100.0, lambda t: 100.0, lambda t: max(5.0, 100.0 - 6.0 * t)], [100] * 48),
    }


def main() -> None:
    """Print epoch times and utilization of every policy on each scenario."""
    config = BalancerConfig(batch=10, rebalance_interval=2.0)
    for title, (rates, shards) in scenarios().items():
        print(f"\n{title}; batch 10, rebalance every 2 s, 2 epochs")
        print(f"{'policy':<12} {'epoch 1 s':>10} {'epoch 2 s':>10} {'total s':>9} "
              f"{'util':>6} {'moves':>6}")
        for name in BALANCERS:
            res = simulate(name, rates, shards, epochs=2, config=config)
            util = sum(res.utilization) / len(res.utilization)
            print(f"{name:<12} {res.epoch_s[0]:>10.1f} {res.epoch_s[1]:>10.1f} "
                  f"{res.total_s:>9.1f} {util:>6.2f} {len(res.moves):>6}")


if __name__ == "__main__":
    main()
