"""The simulated server's chores: rebalances, batch sizes, idle workers, lost workers.

As the live server's :mod:`mpilb.server.chores` (rebalance every ``rebalance_interval``,
the first proportional sizing, sit-out benching, a lost worker's tasks taken back).
Mixed into :class:`~mpilb.simulate.engine.Engine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpilb.simulate.engine import _Worker

PUSH, REBALANCE, LOST = 0, 1, 2
# as mpilb.server.chores.FIRST_SIZES_STEPS (chores is not pure: it imports MPI); a test
# checks they agree
FIRST_SIZES_STEPS = 16


class EngineChores:
    """Rebalances, batch sizes and lost workers of the simulated server (a mixin: it reads
    the engine's state)."""

    # ------------------------------------------------------------------ server chores
    def _first_sizes_due(self) -> bool:
        """Proportional batches: sized as soon as every busy worker has taken 16 steps
        (checked as each worker reaches them)."""
        busy = [w for w in self.workers.values() if w.state in ("run", "held")]
        if busy and all(w.steps >= FIRST_SIZES_STEPS for w in busy):
            self.sized_early = True
        return self.sized_early

    def _rebalance(self, t: float) -> None:
        committed = {w.rank: self.ledger.remaining(w.rank) for w in self._present()}
        if self.sitout is not None:
            self.sitout.start_probes(self._present(), t)
        self.balancer.rebalance(t, committed)
        self._count_moves()
        self._wake_idle(t)
        self._update_batches(t)

    def _wake_idle(self, t: float) -> None:
        for w in self.workers.values():
            if w.state == "idle":
                self.ledger.top_up(w.rank, w.batch)
                if self.ledger.tasks(w.rank):
                    self._start(w, t + self._link(w, t))
        self._count_moves()

    def _update_batches(self, t: float) -> None:
        present = self._present()
        slow = self.sitout.slow(present) if self.sitout is not None else set()
        sizes = self.balancer.batch_sizes(frozenset(slow))
        for w in present:
            w.batch = int(sizes.get(w.rank, self.cfg.batch))
            if w.probing:
                w.batch = self.sitout.probe_batch()
            elif w.rank in slow:
                w.batch = 0
            if w.batch == 0 and self.sitout is not None and not w.benched and w.state == "idle":
                self.sitout.bench(w, present, t)   # nothing in flight: at once
            w.lags.clear()

    # ------------------------------------------------------------------ lost workers
    def _take_back(self, w: _Worker, lost: bool = False) -> None:
        w.ready.clear()
        self.ledger.take_back(w.rank, lost=lost)
        self._count_moves()

    def _die(self, w: _Worker, t: float) -> None:
        """w hangs or crashes: the server notices after --worker-timeout of silence."""
        w.state = "dead"
        self.pending_lost += 1
        self._at(max(t, w.fault_t) + self.cfg.worker_timeout, LOST, w.rank)

    def _declare_lost(self, w: _Worker, t: float) -> None:
        w.state = "lost"
        self.lost.append(w.rank)
        if all(o.state == "lost" for o in self.workers.values()):
            raise RuntimeError("every simulated worker was lost")
        self.balancer.remove_worker(w.rank)
        self._take_back(w, lost=True)
        self._wake_idle(t)
        if self.sync and self.members and self.running == 0:
            self._apply_round(t)
