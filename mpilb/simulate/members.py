"""Who is in the simulated run: workers lost (a hang or crash, noticed after
``--worker-timeout`` of silence), and a replayed run's membership changes at their recorded
times (``members/``, docs/simulate.md):

- ``join`` and ``respawn``: the worker is not in the simulated run before its time; then
  it enters as the server admits a joiner: a place in the balancer and the task ledger,
  no work until it is woken (it steals, as an idle worker does), its measured rate from
  its own ``workers/`` rows.
- ``leave``: at its time the worker is let go as the server lets one go: at once when
  idle, else when its reply is due (the push it computes is applied); what it holds and
  has not started goes back to the ledger for the others.
- ``lost``: the worker falls silent ``--worker-timeout`` before its recorded time, so
  that it is declared lost then (a hang or crash the run's ``--inject`` gave it is
  replayed by the injection instead).
"""

from __future__ import annotations

from mpilb.simulate.workers import JOIN, LEAVE, LOST

ARRIVALS = ("join", "respawn")


class MemberChanges:
    """Losses and the changes the engine replays, and the workers they concern.

    Args:
        changes: (t, worker, event) rows, ``worker`` numbered as the engine's workers.
    """

    def __init__(self, changes=()):
        self.changes = sorted((float(t), int(w), str(e)) for t, w, e in changes)
        self.arrivals = {w: t for t, w, e in self.changes if e in ARRIVALS}
        self.outside: dict = {}          # workers that have not joined yet, by rank
        self.leaving: set[int] = set()   # told to go, going when their reply is due
        self.left: list[int] = []
        self.lost: list[int] = []
        self.pending = 0                 # hung or crashed workers not yet declared lost

    def at_start(self, ranks) -> list[int]:
        """The workers in the run from its start (those that join later left out)."""
        return [r for r in ranks if r not in self.arrivals]

    def schedule(self, engine) -> None:
        """Hold the joiners out of ``engine.workers`` until their time; put the joins and
        leaves on its heap; set the silence of the workers it lost."""
        for rank in list(self.arrivals):
            if rank not in engine.workers:      # (an id that never worked: no worker)
                del self.arrivals[rank]
                continue
            self.outside[rank] = engine.workers.pop(rank)
        for t, rank, event in self.changes:
            if event in ARRIVALS and rank in self.arrivals:
                engine._at(t, JOIN, rank)
            elif event in ("leave", "resume"):   # (resume: a joiner the resumed launch lacks)
                engine._at(t, LEAVE, rank)
            elif event == "lost":
                w = engine.workers.get(rank) or self.outside.get(rank)
                if w is not None and w.fault_t == float("inf"):
                    w.fault_t = max(0.0, t - engine.cfg.worker_timeout)

    def die(self, engine, w, t: float) -> None:
        """``w`` hangs or crashes: the server notices after --worker-timeout of silence."""
        w.die()
        self.pending += 1
        engine._at(max(t, w.fault_t) + engine.cfg.worker_timeout, LOST, w.rank)

    def event(self, engine, kind: int, rank: int, t: float) -> None:
        """A loss is declared, or a join or a leave is due, at ``t``."""
        if kind == LOST:
            self.pending -= 1
            w = engine.workers[rank]
            w.lose()
            self.lost.append(rank)
            if all(o.lost for o in engine.workers.values()):
                raise RuntimeError("every simulated worker was lost")
            engine._drop(w, t)
            return
        if kind == JOIN:
            w = self.outside.pop(rank)
            engine.workers[rank] = w
            engine.balancer.add_worker(rank)
            engine.ledger.add_worker(rank)
            engine.decisions.wake_idle(t)
            return
        w = engine.workers.get(rank)
        if w is None or not w.present:
            return
        self.leaving.add(rank)
        if w.idle:
            self.depart(engine, w, t)

    def departs(self, engine, w, t: float) -> bool:
        """``w``'s reply is due at ``t``: True when it goes instead (it was told to)."""
        if w.rank not in self.leaving:
            return False
        self.depart(engine, w, t)
        return True

    def depart(self, engine, w, t: float) -> None:
        """``w`` leaves now: its unstarted work goes to the others."""
        self.leaving.discard(w.rank)
        w.leave()
        w.go_idle()
        self.left.append(w.rank)
        engine._drop(w, t)
