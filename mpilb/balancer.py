"""Load-balancing policies: which worker consumes which shard, with what batch size.

Pure Python: no MPI, no clocks (times are passed in), so the live server (rank 0), the unit
tests and :mod:`mpilb.simulate` drive the same code. The protocol (DESIGN.md, "Training
modes, corrections, balancing"):

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
  (see :mod:`mpilb.rates`).
- ``remove_worker(w)`` hands a lost worker's queue to the others; ``requeue(shards)`` takes
  back its committed shards. ``take_moves()`` returns every move made since the last call.

Policies register by name (:data:`BALANCERS`, :func:`build_balancer`); batch-size policies
likewise (:data:`BATCH_POLICIES`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from .errors import MpilbError, UsageError
from .rates import TrendRate

BALANCERS: dict[str, type["Balancer"]] = {}
BATCH_POLICIES: dict[str, Callable[["Balancer"], dict[int, int]]] = {}

# Gains smaller than this many seconds are rounding, not improvement.
_EPS = 1e-9
# A worker's projected time is not linear in its samples (a forecast slowdown).
_NONLINEAR = -1.0


def register(name: str):
    """Class decorator: make a :class:`Balancer` subclass available as ``--balancer name``."""
    def deco(cls):
        cls.name = name
        BALANCERS[name] = cls
        return cls
    return deco


def register_batch_policy(name: str):
    """Function decorator: make ``fn(balancer) -> {worker: batch}`` a ``--batch-policy``."""
    def deco(fn):
        BATCH_POLICIES[name] = fn
        return fn
    return deco


STEP_ALPHA = 0.1   # EWMA weight of a new per-step overhead


@dataclass
class BalancerConfig:
    """Knobs of the balancer.

    Attributes:
        batch: per-worker batch size (the global batch is ``batch * workers``).
        batch_policy: ``fixed`` or ``proportional``.
        min_batch, max_batch: clamp for proportional batches.
        sit_out: proportional batches may be 0 for a worker whose step at ``min_batch``
            would take longer than everyone else's step: it sits sync rounds out (the
            server then benches it, see :meth:`Balancer.bench`).
        rebalance_interval: seconds between rebalance calls; also the forecast horizon of
            the ``predictive`` policy.
        hysteresis: a rebalance commits its moves only if they bring the projected epoch
            end forward by more than this fraction of the remaining time, so estimate
            noise does not shuffle shards back and forth.
        ewma_alpha: weight of the newest bucket in the rate EWMA (0 < alpha <= 1). The
            default 0.1, with the estimator's level-shift reset, keeps +-20% jitter within
            10% and still follows a 2x change of speed within 3 buckets (see
            :mod:`mpilb.rates`).
        window: buckets the ``predictive`` policy fits its trend on (24 buckets of 50 ms
            busy time: a trend over about 1.5 s of a busy worker's reports).
        rate_bucket_s: busy seconds of reports pooled before they update a rate estimate.
            A worker pushing every millisecond on a shared node has heavy-tailed per-step
            times (preemption); 50 ms buckets average that out, and 3 buckets (the shift
            detector) still notice a 4x slowdown within about a fifth of a second.
    """

    batch: int = 32
    batch_policy: str = "fixed"
    min_batch: int = 1
    max_batch: int = 4096
    sit_out: bool = False
    rebalance_interval: float = 2.0
    hysteresis: float = 0.05
    ewma_alpha: float = 0.1
    window: int = 24
    rate_bucket_s: float = 0.05


@dataclass(frozen=True)
class Move:
    """One shard moved from ``src``'s queue to ``dst``'s (reason: rebalance, steal, lost, probe)."""

    shard: int
    src: int
    dst: int
    reason: str


class Balancer:
    """Base policy: per-worker queues of unstarted shards and per-worker rate estimates.

    Subclasses override :meth:`_build_queues` (the epoch plan) and, when they migrate
    shards, :meth:`rebalance` and :meth:`_steal`.

    Args:
        workers: worker ranks.
        shard_sizes: samples in each shard, indexed by shard.
        config: the knobs.
    """

    name = "base"

    def __init__(self, workers: list[int], shard_sizes: list[int], config: BalancerConfig,
                 holders: dict[int, list[int]] | None = None):
        if not workers:
            raise MpilbError("a balancer needs at least one worker")
        if config.batch_policy not in BATCH_POLICIES:
            raise UsageError(f"unknown batch policy {config.batch_policy!r}; "
                             f"valid: {', '.join(sorted(BATCH_POLICIES))}")
        self.workers = list(workers)
        self.shard_sizes = [int(s) for s in shard_sizes]
        self.config = config
        # --store local: the ranks holding a copy of each shard. Plans put shards on their
        # holders; a shard placed elsewhere must be sent over MPI, so it moves only when
        # that brings the epoch end forward (by more than the hysteresis).
        self.holders = holders
        self.epoch = -1
        self.now = 0.0
        self._rates = {w: self._new_estimator() for w in self.workers}
        # per-step cost beyond compute and I/O (transfers, waiting to be noticed): EWMA
        self._step_over: dict[int, float | None] = {w: None for w in self.workers}
        self._queues: dict[int, list[int]] = {w: [] for w in self.workers}
        self._committed: dict[int, int] = {w: 0 for w in self.workers}
        self._requeued: set[int] = set()    # shards of a lost worker, maybe partly done
        self._moves: list[Move] = []
        self.benched: set[int] = set()      # sitting sync rounds out: no shards, no batch
        self._probed: dict[int, float] = {}        # when each silent worker was last probed
        self.round_step: float | None = None   # step time the last proportional sizes aim at
        # Caches that keep a decision at 10^3 workers cheap (docs/simulate.md, "cost"):
        # each worker's projected seconds per sample (dropped when its estimate changes),
        # the mean rate and overhead that stand in for workers without estimates, and
        # each queue's samples (dropped whenever the queue changes).
        self._spp: dict[int, float] = {}
        self._spp_fallback: set[int] = set()
        self._means: tuple | None = None
        self._qsum: dict[int, int] = {}
        # The same per worker as vectors over self.workers (refreshed where touched).
        self._vec: tuple | None = None      # (workers, position, load, seconds/sample, queued?)
        self._dirty: set[int] = set()

    # -- rates ------------------------------------------------------------------------------
    def _new_estimator(self) -> TrendRate:
        return TrendRate(self.config.ewma_alpha, self.config.window, self.config.rate_bucket_s)

    def observe(self, worker: int, t: float, samples: int, busy_s: float,
                comm_s: float | None = None, step_s: float | None = None) -> None:
        """Take one report: ``samples`` done in ``busy_s`` seconds of compute + I/O, at ``t``.

        ``comm_s``, when the caller knows it, is the communication time that went with them
        (not idle or held time); otherwise the overhead is inferred from report times.
        ``step_s``: what the step cost whoever waits for it, from the parameters sent to
        the gradient received (compute, I/O and both transfers); the step-time fit of
        proportional batches uses it when given, ``busy_s`` otherwise.
        """
        self.now = max(self.now, t)
        if worker in self._rates:
            est = self._rates[worker]
            est.update(t, samples, busy_s, comm_s)
            if est.ewma.closed:
                self._estimates_changed(worker)
            if step_s is not None:
                over = max(0.0, step_s - busy_s)
                old = self._step_over.get(worker)
                self._step_over[worker] = over if old is None else old + STEP_ALPHA * (over - old)
        if worker in self._committed:
            self._committed[worker] = max(0, self._committed[worker] - int(samples))
            self._dirty.add(worker)

    def step_model(self, worker: int) -> tuple[float, float]:
        """(a, c): ``worker``'s step at batch b is expected to take ``a + c * b`` seconds.

        c is 1 / its (forecast) rate, a its per-step cost beyond compute and I/O. Both are
        measured at the batch it uses now, so the model is exact there and proportional
        sizes converge to equal step times over successive rebalances; a slow worker's
        fixed costs, which a fit over small batches could not pin down, show up in the
        rounds it slows (the server's sit-out check) rather than here.
        """
        return self._step_over.get(worker) or 0.0, 1.0 / self._planning_rate(worker)

    def rate_known(self, worker: int) -> bool:
        """True once ``worker`` has a rate estimate of its own."""
        est = self._rates.get(worker)
        return est is not None and est.value is not None

    def _estimates_changed(self, worker: int | None = None) -> None:
        """A worker's estimates changed (None: any may have): drop what was derived."""
        if worker is None:
            self._spp.clear()
            self._spp_fallback.clear()
            self._vec = None
        else:
            self._spp.pop(worker, None)
            self._dirty.add(worker)
        self._means = None
        for w in self._spp_fallback:
            self._spp.pop(w, None)
            self._dirty.add(w)
        self._spp_fallback.clear()

    def _touch(self, worker: int) -> None:
        """``worker``'s queue or committed samples changed."""
        self._qsum.pop(worker, None)
        self._dirty.add(worker)

    def _vectors(self) -> tuple:
        """(workers, position of each, load, seconds per sample, has a queue), as arrays over
        ``self.workers``, brought up to date for the workers touched since the last call."""
        vec = self._vec
        if vec is None or vec[0] != self.workers:
            workers = list(self.workers)
            pos = {w: i for i, w in enumerate(workers)}
            load = np.array([self._load(w) for w in workers], dtype=float)
            spp = np.array([self._seconds_per_sample(w) for w in workers], dtype=float)
            queued = np.array([bool(self._queues.get(w)) for w in workers])
            self._vec = vec = (workers, pos, load, spp, queued)
        else:
            _, pos, load, spp, queued = vec
            for w in self._dirty:
                i = pos.get(w)
                if i is not None:
                    load[i] = self._load(w)
                    spp[i] = self._seconds_per_sample(w)
                    queued[i] = bool(self._queues.get(w))
        self._dirty.clear()
        return vec

    def _times_at(self, vec: tuple, samples: np.ndarray) -> np.ndarray:
        """``_time_for`` of every worker of ``vec`` for its entry of ``samples``."""
        workers, _, _, spp, _ = vec
        out = samples * spp
        for i in np.flatnonzero(spp < 0.0):
            out[i] = self._time_nonlinear(workers[i], float(samples[i]))
        return out

    def _mean_estimates(self) -> tuple[float, float]:
        """(mean rate, mean overhead) over the workers that have them (1.0 and 0 if none)."""
        if self._means is None:
            rates = [e.value for e in self._rates.values() if e.value is not None]
            overs = [e.overhead for e in self._rates.values() if e.overhead is not None]
            self._means = (sum(rates) / len(rates) if rates else 1.0,
                           sum(overs) / len(overs) if overs else 0.0)
        return self._means

    def has_rates(self) -> bool:
        """True once any worker has reported."""
        return any(est.value is not None for est in self._rates.values())

    def _fallback_rate(self, worker: int) -> float:
        est = self._rates.get(worker)
        if est is None or est.value is None:   # the mean over all is the others' mean
            return self._mean_estimates()[0]
        known = [e.value for w, e in self._rates.items() if w != worker and e.value is not None]
        return sum(known) / len(known) if known else 1.0

    def rate(self, worker: int) -> float:
        """Current rate estimate in samples/s (before any report: the others' mean, or 1.0)."""
        value = self._rates[worker].value if worker in self._rates else None
        return value if value is not None else self._fallback_rate(worker)

    def predicted_rate(self, worker: int) -> float:
        """Forecast rate over the next interval (equal to :meth:`rate` unless predictive)."""
        return self.rate(worker)

    def overhead(self, worker: int) -> float:
        """Seconds per sample ``worker`` spends outside compute and I/O (communication).

        Before its first estimate: the others' mean, or 0.
        """
        est = self._rates.get(worker)
        if est is not None and est.overhead is not None:
            return est.overhead
        # no estimate of its own: the mean over all the others' (cached)
        return self._mean_estimates()[1]

    def effective_rate(self, worker: int) -> float:
        """Samples per wall-clock second, communication included: what to split work by."""
        return 1.0 / (1.0 / self._planning_rate(worker) + self.overhead(worker))

    def _planning_rate(self, worker: int) -> float:
        return max(self.predicted_rate(worker), 1e-12)

    # -- queues -----------------------------------------------------------------------------
    def plan_epoch(self, epoch: int, order: list[int]) -> dict[int, list[int]]:
        """Build this epoch's queues from ``order`` (a shuffle of all shards); returns copies."""
        self.epoch = epoch
        self._committed = {w: 0 for w in self.workers}
        self._requeued = set()
        self._vec = None
        self._queues = self._build_queues(list(order))
        self._qsum.clear()
        self._vec = None
        return {w: list(q) for w, q in self._queues.items()}

    def _build_queues(self, order: list[int]) -> dict[int, list[int]]:
        raise NotImplementedError

    def _home(self, shard: int) -> list[int]:
        """Workers that hold `shard` (all of them with a shared store, or if none is left)."""
        if self.holders is None:
            return self.workers
        return [w for w in self.holders[shard] if w in self.workers] or self.workers

    def _by_holder(self, order: list[int]) -> dict[int, list[int]]:
        """Each shard on its first live holder: the plan of the fixed policies with --store local."""
        queues = {w: [] for w in self.workers}
        for shard in order:
            queues[self._home(shard)[0]].append(shard)
        return queues

    def queued(self, worker: int) -> list[int]:
        """Unstarted shards now queued for ``worker`` (a copy)."""
        return list(self._queues.get(worker, ()))

    def next_shard(self, worker: int) -> int | None:
        """Hand ``worker`` its next shard, or None when it has nothing left this epoch."""
        if worker not in self.workers:
            return None
        queue = self._queues[worker]
        shard = queue.pop(0) if queue else self._steal(worker)
        self._touch(worker)
        if shard is not None:
            self._commit(worker, shard)
        return shard

    def discount(self, worker: int, samples: int) -> None:
        """``samples`` of the shard just handed to ``worker`` were applied before (a remainder
        resumed from a checkpoint or taken over from a lost worker): not committed work."""
        if worker in self._committed:
            self._committed[worker] = max(0, self._committed[worker] - int(samples))
            self._dirty.add(worker)

    def _commit(self, worker: int, shard: int) -> None:
        # A requeued shard may be partly done already: counting none of it errs on the side
        # of "this worker may run dry", never on the side of leaving it without work.
        if shard in self._requeued:
            self._requeued.discard(shard)
        else:
            self._committed[worker] = self._committed.get(worker, 0) + self.shard_sizes[shard]
            self._dirty.add(worker)

    def _steal(self, worker: int) -> int | None:
        return None

    def _time_for(self, worker: int, samples: float) -> float:
        """Projected wall-clock seconds for ``worker`` to do ``samples`` more samples."""
        spp = self._seconds_per_sample(worker)
        return samples * spp if spp >= 0.0 else self._time_nonlinear(worker, samples)

    def _seconds_per_sample(self, worker: int) -> float:
        """``_time_for(worker, n) / n`` when that is the same for every n (cached), else
        ``_NONLINEAR``."""
        spp = self._spp.get(worker)
        if spp is None:
            spp = self._spp[worker] = self._linear_cost(worker)
            est = self._rates.get(worker)
            if est is None or est.value is None or est.overhead is None:
                self._spp_fallback.add(worker)   # depends on the others' means
        return spp

    def _linear_cost(self, worker: int) -> float:
        return 1.0 / self._planning_rate(worker) + self.overhead(worker)

    def _time_nonlinear(self, worker: int, samples: float) -> float:
        raise NotImplementedError

    def _queued_samples(self, worker: int) -> int:
        total = self._qsum.get(worker)
        if total is None:
            total = self._qsum[worker] = sum(self.shard_sizes[s] for s in self._queues.get(worker, ()))
        return total

    def _finish(self, worker: int) -> float:
        """Projected seconds until ``worker`` has done its committed and queued samples."""
        return self._time_for(worker, self._load(worker))

    def _load(self, worker: int) -> int:
        return self._committed.get(worker, 0) + self._queued_samples(worker)

    def _least_loaded(self, size: int) -> int:
        vec = self._vectors()
        return vec[0][int(np.argmin(self._times_at(vec, vec[2] + size)))]

    def rebalance(self, t: float, committed: dict[int, int]) -> list[Move]:
        """Move unstarted shards if that helps; ``committed[w]`` = samples w still must do.

        The base policy never moves. Returns the moves (also kept for :meth:`take_moves`).
        """
        self.now = max(self.now, t)
        self._committed = {w: int(committed.get(w, 0)) for w in self.workers}
        self._vec = None
        return []

    def requeue(self, shards: list[int]) -> None:
        """Take back shards handed out to a lost worker; each goes where it ends soonest."""
        self._requeued.update(shards)
        for shard in shards:
            self._place(shard)

    def _place(self, shard: int) -> int:
        if not self.workers:
            raise MpilbError(f"no workers left to take shard {shard}")
        dst = self._least_loaded(self.shard_sizes[shard])
        self._queues[dst].append(shard)
        self._touch(dst)
        return dst

    def bench(self, worker: int) -> list[Move]:
        """``worker`` sits out for now: its queued shards go to the others (moves), it gets
        none until :meth:`unbench`; its rate and step estimates are kept."""
        if worker not in self.workers or len(self.workers) < 2:
            return []
        self.workers.remove(worker)
        self.benched.add(worker)
        orphans = self._queues.pop(worker, [])
        self._touch(worker)
        self._committed.pop(worker, None)
        self._vec = None
        moves = [Move(shard, worker, self._place(shard), "rebalance") for shard in orphans]
        self._moves.extend(moves)
        return moves

    def unbench(self, worker: int) -> None:
        """Take a benched worker back (with an empty queue; shards reach it by moves and
        steals)."""
        if worker not in self.benched:
            return
        self.benched.discard(worker)
        self.workers.append(worker)
        self._queues[worker] = []
        self._touch(worker)
        self._committed[worker] = 0

    def seed_rate(self, worker: int, samples: float, busy_s: float) -> None:
        """Start ``worker``'s estimates afresh from one measurement (a readmitted worker's
        probe step): it is planned and sized at that rate at once, not at the others' mean
        until 50 ms of busy time have filled a bucket."""
        self.forget(worker)
        est = self._rates.get(worker)
        if est is not None and samples > 0 and busy_s > 0:
            bucket = est.ewma.bucket_s
            est.ewma.bucket_s = 0.0      # this one measurement is the first bucket
            est.update(self.now, samples, busy_s)
            est.ewma.bucket_s = bucket
            self._estimates_changed(worker)

    def forget(self, worker: int) -> None:
        """Drop ``worker``'s rate and per-step overhead (it changed speed, e.g. back from
        the bench): until it reports again it is planned at the others' mean rate."""
        self._step_over[worker] = None
        if worker in self._rates:
            self._rates[worker] = self._new_estimator()
        self._estimates_changed(worker)

    def remove_worker(self, worker: int) -> list[Move]:
        """Drop a lost worker; its queued shards go to the others (moves with reason "lost")."""
        self.benched.discard(worker)
        if worker not in self.workers:
            return []
        self.workers.remove(worker)
        orphans = self._queues.pop(worker, [])
        self._touch(worker)
        self._rates.pop(worker, None)
        self._estimates_changed(worker)
        self._committed.pop(worker, None)
        moves = [Move(shard, worker, self._place(shard), "lost") for shard in orphans]
        self._moves.extend(moves)
        return moves

    def take_moves(self) -> list[Move]:
        """Every move made since the last call (rebalance, steals, lost workers)."""
        moves, self._moves = self._moves, []
        return moves

    # -- batches ----------------------------------------------------------------------------
    def batch_sizes(self, sitting: frozenset = frozenset()) -> dict[int, int]:
        """Per-worker batch size under the configured batch policy; ``sitting``: workers
        about to sit out (batch 0, as if benched)."""
        return BATCH_POLICIES[self.config.batch_policy](self, sitting)

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-serialisable state (worker keys as strings, as JSON needs)."""
        return {
            "name": self.name,
            "config": asdict(self.config),
            "workers": list(self.workers) + sorted(self.benched),   # benching restarts afresh
            "epoch": self.epoch,
            "now": self.now,
            "queues": {**{str(w): [] for w in self.benched},
                       **{str(w): list(q) for w, q in self._queues.items()}},
            "committed": {str(w): c for w, c in self._committed.items()},
            "requeued": sorted(self._requeued),
            "rates": {str(w): est.state_dict() for w, est in self._rates.items()},
            "moves": [asdict(m) for m in self._moves],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (possibly after a JSON round trip)."""
        if state.get("name") != self.name:
            raise MpilbError(f"balancer state is for {state.get('name')!r}, not {self.name!r}")
        self.config = BalancerConfig(**state["config"])
        self.workers = [int(w) for w in state["workers"]]
        self.benched = set()
        self.epoch = int(state["epoch"])
        self.now = float(state["now"])
        self._queues = {int(w): [int(s) for s in q] for w, q in state["queues"].items()}
        self._committed = {w: 0 for w in self.workers}
        self._committed.update({int(w): int(c) for w, c in state["committed"].items()})
        self._requeued = {int(s) for s in state.get("requeued", [])}
        self._rates = {}
        for w, est_state in state["rates"].items():
            est = self._new_estimator()
            est.load_state_dict(est_state)
            self._rates[int(w)] = est
        self._moves = [Move(**m) for m in state["moves"]]
        self._qsum.clear()
        self._estimates_changed()
        self._vec = None


@register("static")
class StaticBalancer(Balancer):
    """Even contiguous split of the epoch's order, fixed at its start; never moves."""

    def _build_queues(self, order):
        if self.holders is not None:
            return self._by_holder(order)
        n, k = len(order), len(self.workers)
        queues, start = {}, 0
        for i, w in enumerate(self.workers):
            count = n // k + (1 if i < n % k else 0)
            queues[w] = order[start:start + count]
            start += count
        return queues


@register("round-robin")
class RoundRobinBalancer(Balancer):
    """Shards dealt in turn: ``order[k]`` goes to ``workers[k % W]``; never moves."""

    def _build_queues(self, order):
        if self.holders is not None:
            return self._by_holder(order)
        k = len(self.workers)
        return {w: order[i::k] for i, w in enumerate(self.workers)}


@register("demand")
class DemandBalancer(Balancer):
    """One central queue; whoever asks first gets its head. No per-worker queues, no moves."""

    def __init__(self, workers, shard_sizes, config, holders=None):
        super().__init__(workers, shard_sizes, config, holders)
        self._central: list[int] = []

    def _build_queues(self, order):
        self._central = order
        return {w: [] for w in self.workers}

    def next_shard(self, worker):
        if worker not in self.workers or not self._central:
            return None
        # With a node-local store, take the first shard this worker holds, if any is left.
        pick = next((i for i, s in enumerate(self._central) if worker in self._home(s)), 0)
        shard = self._central.pop(pick)
        self._commit(worker, shard)
        return shard

    def requeue(self, shards):
        # A lost worker's shards go first: they are the ones most likely to end the epoch late.
        self._requeued.update(shards)
        self._central[:0] = list(shards)

    def _place(self, shard):
        self._central.append(shard)
        return -1

    def central(self) -> list[int]:
        """The central queue (a copy)."""
        return list(self._central)

    def state_dict(self):
        state = super().state_dict()
        state["central"] = list(self._central)
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self._central = [int(s) for s in state["central"]]


@register("load")
class LoadBalancer(Balancer):
    """Queues sized so every worker is projected to finish together, at its measured rate.

    Plan: each shard of ``order`` in turn goes to the worker that would finish it earliest
    (greedy earliest-finish), so queue lengths follow the rates. Rebalance: repeatedly move
    the last unstarted shard of the worker projected to finish last to the worker that would
    finish it earliest, while that brings the last finisher forward; keep the moves only if
    together they bring the projected epoch end forward by more than ``hysteresis`` of the
    remaining time. Moving single shards one at a time and judging the whole set lets many
    small shards move even when each alone gains less than the hysteresis. A worker whose
    queue runs dry steals from the worker projected to finish last, if that ends sooner.

    End of the epoch: a worker that still holds work and asks for one more shard (its
    prefetch) does not get it when another worker, after everything it holds and has
    queued, would finish that shard sooner. The shard stays queued where that worker can
    steal it, and the asker gets it anyway if it runs dry first. Without this a slow worker
    commits to two shards near the end (its current one and its prefetch) and ends the
    epoch late while the fast ones idle; committed shards never move.
    """

    def next_shard(self, worker):
        if worker not in self.workers:
            return None
        queue = self._queues[worker]
        if queue and self._committed.get(worker, 0) > 0 and self._sooner_elsewhere(worker, queue[0]):
            return None
        return super().next_shard(worker)

    def _sooner_elsewhere(self, worker: int, shard: int) -> bool:
        size = self.shard_sizes[shard]
        mine = self._time_for(worker, self._committed.get(worker, 0) + size)
        vec = self._vectors()
        others = self._times_at(vec, vec[2] + size)
        others[vec[1][worker]] = np.inf
        return bool((others < mine - _EPS).any())

    def _build_queues(self, order):
        queues = {w: [] for w in self.workers}
        if self.holders is None:   # every worker is a home: one vector op per shard
            vec = self._vectors()
            workers = vec[0]
            loads = np.zeros(len(workers))
            for shard in order:
                size = self.shard_sizes[shard]
                i = int(np.argmin(self._times_at(vec, loads + size)))
                queues[workers[i]].append(shard)
                loads[i] += size
            return queues
        load = {w: 0 for w in self.workers}
        for shard in order:
            size = self.shard_sizes[shard]
            w = min(self._home(shard), key=lambda v: self._time_for(v, load[v] + size))
            queues[w].append(shard)
            load[w] += size
        if self.holders is not None and len(self.workers) > 1:
            # Holders first; then send shards elsewhere only where that ends the epoch
            # sooner by more than the hysteresis (rebalance's rule).
            self._queues = queues
            self._qsum.clear()
            self._vec = None
            self.rebalance(self.now, {})
            queues = self._queues
        return queues

    def rebalance(self, t, committed):
        super().rebalance(t, committed)
        if len(self.workers) < 2:
            return []
        moves = self._moves_by_rate()
        self._moves.extend(moves)
        probes = self._probe_silent(t)
        self._moves.extend(probes)
        return moves + probes

    def _probe_silent(self, t: float) -> list[Move]:
        """A worker left without work while others still have shards queued (projected too
        slow for even one, e.g. a slow reader) sends no reports, so its rate would never
        recover when it speeds up. At a rebalance it gets one queued shard (a probe: the
        smallest at the tail of the last finisher's queue), at most one per interval; its
        old estimate is then replaced by what the probe measures. A worker idle for any
        other reason would have stolen that shard already."""
        wait = self.config.rebalance_interval
        moves = []
        for w in self.workers:
            if self._queues[w] or self._committed.get(w, 0) > 0:
                continue
            if t - self._probed.get(w, -wait) < wait or not self.rate_known(w):
                continue
            donors = [v for v in self.workers if v != w and self._queues[v]]
            if not donors:
                break
            src = max(donors, key=self._finish)
            shard = min(self._queues[src][-3:], key=lambda s: self.shard_sizes[s])
            self._queues[src].remove(shard)
            self._queues[w].append(shard)
            self._touch(src)
            self._touch(w)
            self._probed[w] = t
            self._rates[w].ewma.mark_stale()
            moves.append(Move(shard, src, w, "probe"))
        return moves

    def _moves_by_rate(self) -> list[Move]:
        """The rebalance proper (see the class docstring); moves not yet recorded."""
        # Vectors over self.workers: argmax/argmin take the first of equals, as max/min do.
        vec = self._vectors()
        workers = vec[0]
        load = vec[2].copy()
        finish = self._times_at(vec, load)
        before = float(finish.max())
        moves: list[Move] = []
        for _ in range(sum(len(q) for q in self._queues.values())):
            s = int(np.argmax(finish))
            src = workers[s]
            if not self._queues[src]:
                break                       # the last finisher has only committed work left
            shard = self._queues[src][-1]
            size = self.shard_sizes[shard]
            after_dst = self._times_at(vec, load + size)
            after_dst[s] = np.inf
            d = int(np.argmin(after_dst))
            dst, dst_after = workers[d], float(after_dst[d])
            if dst_after >= finish[s] - _EPS:
                break                       # it would only move the late finish elsewhere
            self._queues[src].pop()
            self._queues[dst].append(shard)
            load[s] -= size
            load[d] += size
            finish[s] = self._time_for(src, float(load[s]))
            finish[d] = dst_after
            moves.append(Move(shard, src, dst, "rebalance"))
        after = float(finish.max())
        if moves and before - after <= self.config.hysteresis * before + _EPS:
            for move in reversed(moves):    # not worth it: undo, newest first
                self._queues[move.dst].pop()
                self._queues[move.src].append(move.shard)
            moves = []
        for move in moves:
            self._touch(move.src)
            self._touch(move.dst)
        return moves

    def _steal(self, worker):
        vec = self._vectors()
        workers, pos, load, _, queued = vec
        finish = self._times_at(vec, load)
        finish[~queued] = -np.inf
        finish[pos[worker]] = -np.inf
        if not np.isfinite(finish).any():
            return None
        victim = workers[int(np.argmax(finish))]
        shard = self._queues[victim][-1]
        size = self.shard_sizes[shard]
        before = self._finish(victim)
        thief_after = self._time_for(worker, self._committed.get(worker, 0) + size)
        victim_after = self._time_for(victim, self._load(victim) - size)
        if max(thief_after, victim_after) >= before - _EPS:
            return None
        self._queues[victim].pop()
        self._touch(victim)
        self._moves.append(Move(shard, victim, worker, "steal"))
        return shard


@register("predictive")
class PredictiveBalancer(LoadBalancer):
    """Like ``load``, but plans on forecast rates (see :class:`mpilb.rates.TrendRate`).

    ``predicted_rate`` is the forecast mean rate over the next ``rebalance_interval`` (it
    drives proportional batches and the logs). Projected finish times follow the trend over
    the whole remaining work, so a worker that is slowing down is unloaded before it falls
    behind (and one that is speeding up is not trusted with more until it has).
    """

    def predicted_rate(self, worker):
        est = self._rates.get(worker)
        forecast = est.forecast(self.now, self.config.rebalance_interval) if est else None
        return forecast if forecast is not None else self.rate(worker)

    def _linear_cost(self, worker):
        # A worker that is slowing down keeps slowing while it works through its queue:
        # integrate the trend over the whole job rather than assume the next interval's rate.
        est = self._rates.get(worker)
        if est is None or est.value is None:
            return super()._linear_cost(worker)
        if est.slope() < 0.0:
            return _NONLINEAR
        return 1.0 / est.value + self.overhead(worker)   # a flat or rising trend: its EWMA

    def _time_nonlinear(self, worker, samples):
        if samples <= 0:
            return 0.0
        return self._rates[worker].time_for(samples, self.now) + samples * self.overhead(worker)


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
