"""The Balancer base: policy registry, knobs, moves, per-worker queues and checkpoints.

Rate estimates and projected times are mixed in from :mod:`.estimates`; the policies
(:mod:`.policies`) subclass :class:`Balancer`; batch-size policies are in :mod:`.sizes`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from mpilb.errors import MpilbError, UsageError
from mpilb.core.balancer.estimates import RateEstimates

BALANCERS: dict[str, type["Balancer"]] = {}
BATCH_POLICIES: dict[str, Callable[["Balancer"], dict[int, int]]] = {}



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
            :mod:`mpilb.core.rates`).
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

    @classmethod
    def of_run(cls, s, mode: str) -> "BalancerConfig":
        """A run's balancer settings from `s` (its balancing options: batch, batch_policy,
        min_batch, max_batch, sit_out, rebalance_interval) and its --mode: workers sit
        rounds out only in sync rounds with proportional batches. The server and the
        simulator both build theirs here."""
        return cls(batch=s.batch, batch_policy=s.batch_policy, min_batch=s.min_batch,
                   max_batch=s.max_batch, rebalance_interval=s.rebalance_interval,
                   sit_out=bool(s.sit_out) and mode == "sync" and s.batch_policy == "proportional")


@dataclass(frozen=True)
class Move:
    """One shard moved from ``src``'s queue to ``dst``'s (reason: rebalance, steal, lost, probe)."""

    shard: int
    src: int
    dst: int
    reason: str


class Balancer(RateEstimates):
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
        # when each worker without an overhead estimate was first handed work (see observe)
        self._handed: dict[int, float] = {}
        self._queues: dict[int, list[int]] = {w: [] for w in self.workers}
        self._committed: dict[int, int] = {w: 0 for w in self.workers}
        self._requeued: set[int] = set()    # shards of a lost worker, maybe partly done
        self._given_back: dict[int, set[int]] = {}   # worker -> tails it gave up this epoch
        self._moves: list[Move] = []
        self.benched: set[int] = set()      # sitting sync rounds out: no shards, no batch
        self._probed: dict[int, float] = {}        # when each silent worker was last probed
        self._probe_owed: dict[int, float] = {}    # probes a rebalance could not make (load)
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

    # -- queues -----------------------------------------------------------------------------
    def plan_epoch(self, epoch: int, order: list[int]) -> dict[int, list[int]]:
        """Build this epoch's queues from ``order`` (a shuffle of all shards); returns copies."""
        self.epoch = epoch
        self._committed = {w: 0 for w in self.workers}
        self._requeued = set()
        self._given_back = {}
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

    def next_shard(self, worker: int, prefetch: bool = False) -> int | None:
        """Hand ``worker`` its next shard, or None when it has nothing left this epoch.
        ``prefetch``: it asks while it still holds a task (a policy may make it wait)."""
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
        if worker not in self._handed and not self._overhead_known(worker):
            self._handed[worker] = self.now

    def _steal(self, worker: int) -> int | None:
        return None

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

    def keep_of_tail(self, worker: int, before: int, tail: int,
                     batch: int) -> tuple[int, int | None]:
        """How much of the ``tail`` samples of its last task ``worker`` should keep
        (``before``: what it holds ahead of them), and who takes the rest (see
        :meth:`mpilb.core.tasks.TaskLedger.trim_tail`). The base policy keeps everything."""
        return tail, None

    def give_back(self, shard: int, giver: int, taker: int) -> None:
        """``giver`` gave the tail of its started ``shard`` up for ``taker`` (who holds work
        now, so it asks again at its next push); the ledger knows which positions. The
        giver does not steal it back this epoch."""
        self._queues[taker].append(shard)
        self._touch(taker)
        self._given_back.setdefault(giver, set()).add(shard)

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

    def add_worker(self, worker: int) -> None:
        """A worker joined the run: no queue until a steal or the next rebalance gives it one."""
        if worker in self.workers:
            return
        self.workers.append(worker)
        self._rates[worker] = self._new_estimator()
        self._step_over[worker] = None
        self._queues[worker] = []
        self._committed[worker] = 0
        self._touch(worker)
        self._estimates_changed(None)   # the vectors over the workers are rebuilt

    def remove_worker(self, worker: int) -> list[Move]:
        """Drop a lost worker; its queued shards go to the others (moves with reason "lost")."""
        self.benched.discard(worker)
        if worker not in self.workers:
            return []
        self.workers.remove(worker)
        orphans = self._queues.pop(worker, [])
        self._touch(worker)
        self._rates.pop(worker, None)
        self._handed.pop(worker, None)
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
