"""Sitting sync rounds out (owned by the sync rule; pure: no MPI, no log).

With --mode sync and proportional batches, a worker too slow for even --min-batch within a
round's step time holds every round back. It sits rounds out (benched): what is left of its
tasks goes back to the balancer for the others, and its next reply tells it to drop them.
After a while it is tried again (a probe: two steps at half an even share) and either
rejoins the rounds or goes back to the bench.
"""

from __future__ import annotations

from typing import Iterable

PROBE_S = 2.0      # a worker sitting sync rounds out is tried again after this (at least)


class SitOut:
    """The sit-out policy over the live balancer and task ledger.

    Args:
        balancer: the live balancer (bench/unbench/forget, round_step, step_model).
        ledger: the task ledger (take_back).
        batch, min_batch, max_batch: --batch, --min-batch, --max-batch.
        rebalance_interval: --rebalance-interval (benched workers wait 4 of them at least).
    """

    def __init__(self, balancer, ledger, batch: int, min_batch: int, max_batch: int,
                 rebalance_interval: float):
        self.balancer = balancer
        self.ledger = ledger
        self.batch = batch
        self.min_batch = min_batch
        self.max_batch = max_batch
        self.rebalance_interval = rebalance_interval
        self.spans: dict[int, list[list[float]]] = {}   # rank -> [benched at, back at or None]

    def probe_batch(self) -> int:
        """Half an even share: a worker that cannot carry that within the round's step
        has no place in the rounds; one that can is back for proportional sizing."""
        return min(max(self.min_batch, self.batch // 2), self.max_batch)

    def bench(self, peer, peers: Iterable, now: float) -> bool:
        """Bench `peer` unless rows travel to or from it, or it is the last one in the
        rounds. Returns True if it was benched."""
        if peer.benched or not self.ledger.can_take_back(peer.rank):
            return False   # rows on their way to or from it: not now
        if not [o for o in peers if o is not peer and not o.benched]:
            return False
        peer.bench(now)
        self.spans.setdefault(peer.rank, []).append([now, None])
        self.balancer.bench(peer.rank)
        self.ledger.take_back(peer.rank)
        self._resize(peers)
        return True

    def _resize(self, peers: Iterable) -> None:
        """The others in the rounds share the global batch now (after a failed probe they
        would otherwise keep the sizes made while the prober was in, until the next
        rebalance, and the rounds would shrink)."""
        peers = list(peers)
        sitting = frozenset(p.rank for p in peers if not p.benched and p.batch == 0)  # bench due
        sizes = self.balancer.batch_sizes(sitting)
        for p in peers:
            if not p.benched and not p.probing and p.rank in sizes and p.rank not in sitting:
                p.batch = int(sizes[p.rank])

    def benched_s(self, rank: int, start: float, end: float) -> float:
        """Seconds `rank` sat out between `start` and `end` (monotonic): an epoch's
        utilization counts only the seconds each worker was in the rounds."""
        total = 0.0
        for since, back in self.spans.get(rank, ()):
            total += max(0.0, min(end, back if back is not None else end) - max(start, since))
        return total

    def note_lags(self, members: list) -> None:
        """How much longer each member's step was than the longest of the others' (< 0: not
        the straggler): the evidence for sitting out that fitted step times may miss."""
        if len(members) < 2:
            return
        if any(p.last_gap is None for p in members):
            return
        gaps = sorted(members, key=lambda p: p.last_gap)
        p1, p2 = gaps[-1], gaps[-2]
        for p in members:
            p.lags.append(p.last_gap - (p2.last_gap if p is p1 else p1.last_gap))

    def slows_rounds(self, peer, peers: Iterable) -> bool:
        """True when the rounds would be shorter without `peer`: over the last interval its
        step was the longest by more than the others would need to take over its batch."""
        if len(peer.lags) < 10 or peer.batch <= 0:
            return False
        lag = sorted(peer.lags)[len(peer.lags) // 2]
        others = [o for o in peers if o is not peer and not o.benched and o.batch > 0]
        if not others or lag <= 0:
            return False
        # measured, not modelled: early on, rate estimates are not there yet
        per_sample = sum((o.last_gap or 0.0) / o.batch for o in others) / len(others)
        takeover = peer.batch * per_sample / len(others)
        step = self.balancer.round_step or 0.0
        return lag > max(takeover, 0.05 * step)

    def slow(self, peers: Iterable) -> set[int]:
        """Ranks whose rounds were held back over the interval that just ended."""
        peers = list(peers)
        return {p.rank for p in peers if not p.probing and self.slows_rounds(p, peers)}

    def start_probes(self, peers: Iterable, now: float) -> None:
        """Give each worker benched long enough one more try (see end_probe)."""
        wait = max(PROBE_S, 4 * self.rebalance_interval)
        for p in peers:
            if p.benched and now - p.benched_at >= wait:
                p.unbench(self.probe_batch())
                self.spans[p.rank][-1][1] = now
                self.balancer.unbench(p.rank)

    def after_round(self, members: list, peers: Iterable, now: float) -> None:
        """A round closed: count down probes, bench members sized to 0."""
        peers = list(peers)
        for p in members:
            if p.probing:
                p.probing -= 1
                if not p.probing:
                    self.end_probe(p, peers, now)
            elif p.batch == 0 and not p.benched:
                self.bench(p, peers, now)

    def end_probe(self, peer, peers: list, now: float) -> None:
        """After a probing worker's second push: back in the rounds if its step at the probe
        batch (its compute, plus the others' usual per-step overhead: it was woken from an
        idle wait, so its own reply -> push time includes a late wake-up) fits in the
        round's step time; else on the bench again. A probe cut short by the end of a task
        (less than half the probe batch) proves nothing: the worker is back in the rounds
        and the lag check decides at the next rebalance."""
        push = peer.last_push
        done = push.hi - push.lo
        want = self.probe_batch()
        target = self.balancer.round_step
        others = [o for o in peers if o is not peer and not o.benched]
        fits = True
        if target is not None and others and done >= want / 2:
            overhead = sum(self.balancer.step_model(o.rank)[0] for o in others) / len(others)
            step = float(push.compute_s) * want / done + overhead
            fits = step <= target
        if not fits:
            self.bench(peer, peers, now)
            return
        # Back in the rounds, sized at once from what the probe measured (its old estimate
        # was made while it was slow; the others' mean would misjudge it just as much).
        self.balancer.seed_rate(peer.rank, done, float(push.compute_s + push.io_s))
        self._resize(peers)
