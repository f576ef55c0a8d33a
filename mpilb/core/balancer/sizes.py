"""Batch-size policies (``--batch-policy``) and :func:`build_balancer`."""

from __future__ import annotations

from mpilb.errors import UsageError
from mpilb.core.balancer.base import BALANCERS, BalancerConfig, Balancer, register_batch_policy


@register_batch_policy("fixed")
def fixed_batches(balancer: Balancer, sitting: frozenset = frozenset()) -> dict[int, int]:
    """Every worker uses ``config.batch`` (nobody sits out)."""
    return {w: balancer.config.batch for w in balancer.workers}


@register_batch_policy("proportional")
def proportional_batches(balancer: Balancer, sitting: frozenset = frozenset()) -> dict[int, int]:
    """Batches sized so step times match: ``batch = (T - a) / c`` for a common step time T.

    Each worker's step time is modelled as ``a + c * batch`` (see
    :meth:`Balancer.step_model`: ``c = 1 / rate``, ``a`` its per-step overhead; without
    overheads the batches are in proportion to the rates). T is chosen so the batches add up to ``batch * workers`` (exactly when the clamp
    to ``[min_batch, max_batch]`` allows it; largest remainders round to integers).

    With ``sit_out``, a worker that could not finish even ``min_batch`` samples within T
    gets 0: it sits sync rounds out, and benched workers (:meth:`Balancer.bench`) get 0.
    """
    cfg = balancer.config
    out = set(balancer.benched) | (set(sitting) & set(balancer.workers))
    workers = [w for w in balancer.workers if w not in out]
    if not workers:   # nobody left in the rounds: ignore `sitting`
        out, workers = set(balancer.benched), list(balancer.workers)
    sizes_out = {w: 0 for w in out}
    lo, hi = cfg.min_batch, max(cfg.min_batch, cfg.max_batch)
    # the global batch counts benched workers too: sitting out does not change the step
    total = min(max(cfg.batch * (len(workers) + len(out)), lo * len(workers)),
                hi * len(workers))
    if not balancer.has_rates():
        even = {w: total // len(workers) + (1 if i < total % len(workers) else 0)
                for i, w in enumerate(workers)}
        return {**sizes_out, **even}
    models = {w: balancer.step_model(w) for w in workers}

    def clamped(step: float) -> dict[int, float]:
        out = {}
        for w, (a, c) in models.items():
            b = (step - a) / c
            out[w] = 0.0 if cfg.sit_out and b < lo else min(max(b, lo), hi)
        return out

    # The shares grow with T (a sitting-out worker joins once it can do `lo`): bisect.
    low, high = 0.0, max(a + hi * c for a, c in models.values())
    for _ in range(100):
        mid = (low + high) / 2.0
        if sum(clamped(mid).values()) < total:
            low = mid
        else:
            high = mid
    balancer.round_step = high
    share = clamped(high)
    sizes = {w: int(share[w]) for w in workers}
    by_remainder = sorted(workers, key=lambda w: share[w] - sizes[w], reverse=True)
    deficit = total - sum(sizes.values())
    for w in by_remainder:
        if deficit <= 0:
            break
        if 0 < sizes[w] < hi:
            sizes[w] += 1
            deficit -= 1
    sizes = {w: 0 if share[w] == 0 else min(max(sizes[w], lo), hi) for w in workers}
    return {**sizes_out, **sizes}


def build_balancer(name: str, workers: list[int], shard_sizes: list[int],
                   config: BalancerConfig | None = None,
                   holders: dict[int, list[int]] | None = None) -> Balancer:
    """Make the balancer registered as ``name`` (``holders``: see :class:`Balancer`).

    Raises:
        UsageError: for an unknown name, listing the valid ones.
    """
    if name not in BALANCERS:
        raise UsageError(f"unknown balancer {name!r}; valid: {', '.join(BALANCERS)}")
    return BALANCERS[name](workers, shard_sizes, config or BalancerConfig(), holders)
