"""Pushes coming in to rank 0: a receive posted per worker, tested together, and the waits
between them (doorbells, backoff, MPI progress for replies in flight).

The :class:`Receiver` hands each push that arrived to the protocol
(:meth:`~mpilb.server.loop.ParameterServer.on_push`) and runs the chores when due; at the end
it drains what is still in flight.
"""

from __future__ import annotations

import time
from typing import Callable

from mpilb.core.decisions import DEFER_S
from mpilb.mpi import comm as C
from mpilb.mpi import chunks, doorbell
from mpilb.mpi import wire


class Receiver:
    """The receives of every worker's pushes on `comm`.

    Args:
        comm: the world communicator.
        roster: the workers (their links hold the buffers).
        bell: the doorbell (doorbell.py).
        outbox: the replies in flight (kept progressing).
        remote: the other parameter stores (a gradient not taken is dropped everywhere).
        lose: declares a worker lost (a receive MPI failed: its process ended).
    """

    # replies in flight are progressed this long after a send or a poke
    PROGRESS_S = doorbell.POKE_PROGRESS_S

    def __init__(self, comm, roster, bell, outbox, remote, lose: Callable, slices=None):
        self.comm = comm
        self.slices = slices   # rank 0's stores (SliceGroup): chunked pushes (mpi/chunks.py)
        self.roster = roster
        self.bell = bell
        self.outbox = outbox
        self.remote = remote
        self.lose = lose
        self.backoff = C.Backoff(bell=bell)
        self.order: list = []   # the workers, in the order of `reqs`
        self.reqs: list = []
        self.rung = self.lossy = False   # (see rings)
        self.late: list = []   # workers whose last push's chunks are still coming
        self.deferred: dict = {}   # rank -> (its index, when its header came): see DEFER_S

    def post(self, w) -> None:
        wire.clear_push(w.link.recv.header)   # the buffer may hold an old push (see failed)
        comm, source = w.link.address(self.comm, w.rank)
        w.link.recv_req = comm.Irecv(w.link.recv.buf, source=source, tag=wire.TAG_PUSH)
        if self.slices is not None:   # the rest of rank 0's slice, in chunks (mpi/chunks.py)
            self.slices.waits.post(w.link, comm, source)

    def add(self, w) -> None:
        """A worker joined while serving: its receive goes into the ones tested, and how
        rank 0 waits follows whether it rings (server/admission.py)."""
        self.post(w)
        self.order.append(w)
        self.reqs.append(w.link.recv_req)
        self.rings()

    def rings(self) -> None:
        """Every worker rings when it pushes (`rung`): sleep until one does (or the chores
        are due) instead of polling for pushes on a schedule; a ring over the network may
        be lost (`lossy`): then the push is also looked for when it was due."""
        self.rung = all(self.bell.rings_with(w.rank) for w in self.order)
        self.lossy = any(self.bell.via(w.rank) == doorbell.NETWORK for w in self.order)

    def serve(self, done: Callable[[], bool], on_push: Callable, chores) -> None:
        """Hand every push to ``on_push`` until ``done()``; ``chores``: the
        :class:`~mpilb.server.chores.Chores`, run every CHORES_S (or CHORES_RUNG_S)."""
        order = self.order = list(self.roster.peers.values())
        reqs = self.reqs = [w.link.recv_req for w in order]
        self.rings()
        progress_until = spin_until = 0.0
        next_chores = chores_at = 0.0
        while not done():
            rung = self.rung   # (a worker that joins may change it)
            try:
                arrived = C.Request.Testsome(reqs)
            except C.MPIError:   # a worker's process ended (see failed)
                arrived = self.failed(order, reqs)
            if self.deferred:
                arrived = (arrived or []) + self._deferred_in()
            if arrived:
                for i in arrived:
                    w = order[i]
                    if w.rank not in self.deferred:
                        self.bell.took(w.rank)
                        if w.link.defer and w.link.rest and not self.slices.waits.all_in(w.link):
                            self.deferred[w.rank] = (i, time.monotonic())
                            continue
                    self._take(w, i, reqs, on_push)
                self.backoff.reset(*chores.next_push_due())
                progress_until = time.monotonic() + self.PROGRESS_S
                spin_until = time.monotonic() + self.backoff.spin_s
            elif time.monotonic() < spin_until:
                # a CPU of its own (cores.py): poll on for the next push without sleeping,
                # keeping the list of replies in flight short
                self.outbox.in_flight()
            elif self.outbox.in_flight() and (not rung or time.monotonic() < progress_until):
                # A reply still being transferred may need this rank's MPI progress (a
                # message copied through shared memory in pieces): keep progressing it,
                # yielding the core between polls. With doorbells, only for a moment after
                # sending and while a worker says it is receiving (a poke); a reply whose
                # worker computes meanwhile would otherwise be polled all that time.
                self.backoff.short()
            elif self.deferred:
                self.backoff.short()   # chunks of a deferred push are on their way
            elif rung:
                until = chores_at + chores.RUNG_NAP_S
                if self.lossy:
                    due, grace, _ = chores.next_push_due()
                    until = until if due is None else min(until, due + grace)
                self.bell.rest(until - time.monotonic())
                if self.bell.take_poke():
                    progress_until = time.monotonic() + self.PROGRESS_S
            else:
                self.backoff.sleep()   # a ring from a worker on this node ends a sleep early
            if self.late:
                self._late_in(order, reqs)
            mono = time.monotonic()
            if mono >= next_chores:   # every 10 or 25 ms at most, not at every poll
                next_chores = mono + (chores.CHORES_RUNG_S if rung else chores.CHORES_S)
                chores_at = mono
                chores.run()

    def _take(self, w, i: int, reqs: list, on_push: Callable) -> None:
        """Hand w's push (its receive, index i) to ``on_push``, then post its next."""
        came = self.deferred.pop(w.rank, None)
        # a deferred push waited for its chunks here, from its header until now (not in
        # its stream, and not counting its step below)
        waited = time.monotonic() - came[1] if came else None
        on_push(w)
        self.remote.settle(w.rank)   # a gradient not taken is dropped everywhere
        w.link.defer = (w.link.waited if waited is None else waited) > DEFER_S
        late = bool(w.link.rest) and not self.slices.waits.finish(w.link, w.lost)
        if w.link.broken and not w.lost:   # it ended part-way through a push
            self.lose(w, w.link.broken)
        if late:   # its next push once the last one's chunks are in (below)
            self.late.append(w)
        elif w.present:   # (not stopped, lost or left)
            self.post(w)
            reqs[i] = w.link.recv_req

    def _deferred_in(self) -> list[int]:
        """The deferred pushes whose chunks are all in now (their indices), or that waited
        chunks.STALL_S for them (then handed over: the stream's own waits decide, a stall
        or a loss); a worker lost meanwhile has its chunks' receives cancelled."""
        out = []
        now = time.monotonic()
        for rank, (i, came) in list(self.deferred.items()):
            w = self.order[i]
            if not w.present:
                del self.deferred[rank]
                self.slices.waits.finish(w.link, lost=True)
            elif now - came > chunks.STALL_S or self.slices.waits.all_in(w.link):
                out.append(i)
        return out

    def _late_in(self, order: list, reqs: list) -> None:
        """Workers whose last push's chunks came late (SliceGroup: chunks.STALL_S): once
        they are all in, the worker's next push is received; a worker lost meanwhile has
        them cancelled."""
        for w in list(self.late):
            if not w.present:
                self.slices.waits.finish(w.link, lost=True)
            elif not self.slices.waits.taken_late(w.link):
                continue
            else:
                self.post(w)
                reqs[order.index(w)] = w.link.recv_req
            self.late.remove(w)

    def failed(self, order: list, reqs: list) -> list[int]:
        """MPI failed a receive of pushes: where the launcher keeps the job running after
        a rank's process ended (MPICH's -disable-auto-cleanup), MPICH may say so here, as
        MPI_ERR_IN_STATUS from Testsome, instead of leaving the receive pending. Test each
        receive on its own: a worker whose receive failed is gone, and is declared lost now
        (not after --worker-timeout). Returns the receives that completed.

        The failed Testsome has already freed every request it completed, the failed one
        too: their handles are MPI_REQUEST_NULL, which tests as complete. Only the buffer
        tells a push that arrived from a receive that failed (nothing written since
        post cleared it); taken for a push, the failed one handled the worker's
        previous push again (a batch "outside its task", or a stale gradient)."""
        done = []
        for i, w in enumerate(order):
            if w.stopped or w.left or w.rank in self.deferred:
                continue   # no receive posted since its last push (or its header is in)
            try:
                if not reqs[i].Test():
                    continue
                error = None if wire.holds_push(w.link.recv.header) else "receive failed, nothing received"
            except C.MPIError as exc:
                error = exc.Get_error_string().strip()
            if error is None:
                if not w.lost:
                    done.append(i)
                continue
            reqs[i] = w.link.recv_req = C.REQUEST_NULL
            if not w.lost:
                self.lose(w, f"ended (MPI: {error})")
        return [i for i in done if not order[i].lost]

    def drain(self, sends: list) -> None:
        """Serving ended: the messages still to come are drained, the replies and parameters
        in flight (``sends``) given a moment, the receives still posted cancelled."""
        order, reqs = self.order, self.reqs
        C.drain(self.comm)
        # replies and parameters still in flight; a lost worker's never complete
        # (a hung worker does not receive it): not waited for, else a degraded run ended 5 s
        # after its last epoch
        gone = {id(r) for w in order if w.lost for r in w.link.pending(C.finished)}
        deadline = time.monotonic() + 5.0
        backoff = C.Backoff()
        for req in sends:
            if id(req) in gone:
                continue
            backoff.reset()
            while not C.finished(req) and time.monotonic() < deadline:
                backoff.sleep()
        for i, w in enumerate(order):
            if w.link.reply_req is not None and not w.lost:
                C.wait(w.link.reply_req, timeout=5.0)
            if reqs[i] is not None and not C.finished(reqs[i]):
                reqs[i].Cancel()   # the receive preposted for a push that never came
                C.wait(reqs[i], timeout=1.0)
            for req in w.link.rest:   # (and its chunks)
                if not C.finished(req):
                    req.Cancel()
                    C.wait(req, timeout=1.0)
            w.link.rest = []
