"""The parameter server on rank 0: the protocol of docs/architecture.md, one push at a time.

Per worker w (messages in wire.py):
  w -> server  PUSH    [header | gradient] the positions [lo, hi) of a shard it covered, timings
  server -> w  REPLY   [header | params]   tasks, rows to send to others, a cut, batch size,
                                           version
  server -> w  ORDERS  [header]            rows to send, for a worker waiting on a reply
A push is decoded, handed to the update rule (modes.py: apply now, or join a sync round),
counted in the task ledger (tasks.py), and answered: at once, or held until the rule lets it
go (ssp bound, sync round). A worker with nothing left in the epoch idles until the server
sends it new tasks; STOP ends it. Between pushes the chores (chores.py) watch for errors,
lost workers and timers: rebalancing, evaluation, checkpoints, the stop rules.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

from mpilb.mpi import comm as C
from mpilb.mpi import doorbell
from mpilb.mpi import wire
from mpilb.run.session import Session
from mpilb.data.shards import placement
from mpilb.core.topology import workers_of
from mpilb.mpi.wire import Cmd
from mpilb.server.chores import Chores
from mpilb.server.epochs import Epochs
from mpilb.server.lifecycle import Lifecycle
from mpilb.server.modes import Update, build_rule
from mpilb.server.outbox import Outbox
from mpilb.server.peers import Link, Peer
from mpilb.core.sitout import SitOut
from mpilb.server.group import StoreGroup
from mpilb.core.tasks import TaskLedger


class ParameterServer(Epochs, Lifecycle, Chores):
    """Rank 0 of a multi-rank run."""

    # replies in flight are progressed this long after a send or a poke
    PROGRESS_S = doorbell.POKE_PROGRESS_S

    def __init__(self, cfg, dataset, comm, run_attrs: dict):
        self.cfg = cfg
        self.dataset = dataset
        self.comm = comm
        self.size = comm.Get_size()
        self.ranks = workers_of(cfg, self.size)   # the others hold parameters (--servers)
        holders = (placement(len(dataset.shard_sizes), self.ranks, cfg.replicas,
                             json.loads(run_attrs.get("hostnames", "[]")))   # copies on other nodes
                   if cfg.store == "local" else None)
        self.session = s = Session(cfg, dataset, run_attrs, self.ranks, holders)
        hosts = json.loads(run_attrs.get("hostnames", "[]"))
        self.ranks_here = hosts.count(hosts[0]) if hosts else comm.Get_size()   # on rank 0's node
        self.model, self.optimizer, self.balancer = s.model, s.optimizer, s.balancer
        self.tracker, self.evaluator, self.stop = s.tracker, s.evaluator, s.stop
        self.resumed, self.log, self.progress = s.resumed, s.log, s.progress
        self.n = self.model.num_params
        self.stores = StoreGroup(cfg, s, comm)   # --servers K: rank 0's slice and the others
        self.store, self.remote = self.stores.local, self.stores.remote
        # the factor on --lr (--lr-schedule, --warmup) at each version, on rank 0's clock
        self.store.schedule = lambda version: s.schedule(version, self.now())
        self.ledger = TaskLedger(self.balancer, dataset.shard_sizes, self.ranks, holders=holders,
                                 row_nbytes=dataset.row_nbytes if holders is not None else 0,
                                 pipeline=bool(cfg.pipeline),
                                 split=cfg.balancer not in ("static", "round-robin"))
        self.ledger.epoch = self.resumed.epoch if self.resumed else 0
        sitout = (SitOut(self.balancer, self.ledger, cfg.batch, cfg.min_batch, cfg.max_batch,
                         cfg.rebalance_interval) if self.balancer.config.sit_out else None)
        self.rule = build_rule(cfg.mode, self.store, lambda r: self.ledger.of[r].owed,
                               cfg.staleness_bound, sitout)
        # a push carries the gradient (rank 0's slice), then the model's state (e.g. BatchNorm
        # statistics; only with one store, see server/store.py check_servers)
        self.peers = {r: Peer(rank=r, batch=cfg.batch, link=Link.allocate(
                          self.stores.n0, bool(cfg.pipeline), push_floats=self.stores.push_floats))
                      for r in self.ranks}
        self.bell = doorbell.current()
        self.outbox = Outbox(comm, self.ledger, self.remote, self.bell)
        self.lost: list[int] = []
        self.rejected = 0
        self.sized_early = False
        self.preempted = False
        self.store_lost = False   # a parameter store stopped answering: the run ends
        self.checkpointed_at: Optional[int] = None   # version of the last checkpoint written
        self.backoff = C.Backoff(bell=self.bell)

    # ----------------------------------------------------------------- state
    @property
    def params(self):
        """The whole parameter vector (gathered from every store with --servers K > 1)."""
        return self.stores.full_params()

    @property
    def version(self) -> int:
        return self.store.version

    @property
    def epoch(self) -> int:
        return self.ledger.epoch

    @property
    def accuracy(self) -> Optional[float]:
        return self.session.accuracy

    def now(self) -> float:
        return time.monotonic() - self.t0

    def present(self) -> list[Peer]:
        """Workers still in the run (active or benched; not stopped, not lost)."""
        return [p for p in self.peers.values() if p.present]

    # ----------------------------------------------------------------- messages
    def _post_recv(self, w: Peer) -> None:
        wire.clear_push(w.link.recv[1])   # the buffer may hold an old push (see _failed_receives)
        w.link.recv_req = self.comm.Irecv(w.link.recv[0], source=w.rank, tag=wire.TAG_PUSH)

    def _reply(self, w: Peer, cmd: Cmd = Cmd.PARAMS, held_s: float = 0.0) -> None:
        """Send w the current parameters (or STOP) with its assignments and batch size."""
        w.last_seen = time.monotonic()   # its silence counts from now (--worker-timeout)
        w.awaiting = cmd != Cmd.STOP and not w.idle
        self.outbox.reply(w, self.store, cmd, held_s)
        if cmd == Cmd.STOP:
            w.stop()
        elif w.idle and self.ledger.has_orders(w.rank):
            self.outbox.orders(w)

    def _send_orders_to_waiting(self) -> None:
        """Workers given send orders that wait for a message must be told now: idle or held
        ones, and those that may be blocked waiting for rows themselves (they serve orders
        while they wait, and push nothing that a reply could carry the orders on)."""
        for r in self.ledger.take_ordered():
            w = self.peers[r]
            if not self.ledger.has_orders(r) or not w.present:
                continue
            if w.waits_for_message or self.ledger.awaits_rows(r) is not None:
                self.outbox.orders(w)

    # ----------------------------------------------------------------- pushes
    def _on_push(self, w: Peer) -> None:
        _, hdr, payload = w.link.recv
        grad = payload[:self.stores.n0]   # rank 0's slice of the gradient
        push = wire.decode_push(hdr)
        self.store.bytes_in += w.link.recv[0].nbytes
        self.remote.pushed(w.rank)
        w.last_push = push
        now = self.now()
        mono = time.monotonic()
        w.pushed_at = mono
        w.last_gap = None
        if w.awaiting:
            w.last_gap = mono - w.last_seen
            # The gap seen here includes how late this loop noticed the push; the worker's
            # own busy time does not (waking later for having woken late would feed on itself).
            w.push_gap.update(min(w.last_gap, push.compute_s + push.io_s))
            w.awaiting = False
        w.last_seen = mono
        if w.lost:
            return
        busy = push.compute_s + push.io_s
        w.compute_s += push.compute_s
        w.io_s += push.io_s
        w.comm_s += push.comm_s
        w.idle_s += push.idle_s
        w.epoch_busy += busy + push.comm_s
        if self.stop.reason:
            self._reply(w, Cmd.STOP)
            return
        if push.nonfinite:
            self._reject(w, push)
            return
        w.retried = False
        # Without pipelining, reply -> push is what the step cost whoever waits for it.
        step_s = None if self.cfg.pipeline or w.last_gap is None else w.last_gap
        self.balancer.observe(w.rank, now, push.hi - push.lo, busy, comm_s=push.comm_s, step_s=step_s)
        self.ledger.note_next(w.rank, push.next_shard, push.next_hi)
        w.samples += push.hi - push.lo
        w.step += 1
        if not self.ledger.matches(w.rank, push.epoch, push.shard, push.lo, push.hi):
            # a batch from a shard this worker no longer holds (e.g. reassigned): drop it
            self.tracker.stray += push.hi - push.lo
            task = self.ledger.current(w.rank)
            if self.ledger.matches(w.rank, push.epoch, push.shard):   # never, or a bug
                print(f"mpilb: warning: rank {w.rank}: batch [{push.lo}, {push.hi}) of shard "
                      f"{push.shard} lies outside its task [{task.pos}, {task.end}): dropped, "
                      f"not applied", file=sys.stderr, flush=True)
            self._reply(w)
            return
        update = Update(w.rank, push.epoch, push.shard, push.lo, push.hi, push.batch, push.loss,
                        self.version - push.version)
        then = self.store.params_of(push.version) if self.rule.needs_old_params else None
        if self.model.num_state:   # the server keeps the latest state pushed
            self.model.set_state(payload[self.stores.n0:])
        self.remote.gradient(w.rank, update.batch, update.staleness, push.version, self.rule.rounds,
                             self.store.factor())
        applied = self.rule.push(w, update, grad, then, consume=True)
        given = self.store.exchange()
        if given is not None:   # the push's buffer holds the parameters now: receive in this
            w.link.recv = wire.message_of(given)
        if applied is None:   # it joined a round that is not complete yet
            w.hold(time.monotonic())
            if self.ledger.has_orders(w.rank):   # rows others wait for must not wait for the round
                self.outbox.orders(w)
            self._advance(w, push.hi)
            if self.rule.round_complete(self.present()):
                self._close_round()
            return
        self._record(*applied, now)
        self._advance(w, push.hi)
        if self.tracker.complete:
            self._end_epoch()
        self._respond(w)

    def _failed_receives(self, order: list, reqs: list) -> list[int]:
        """MPI failed a receive of pushes: where the launcher keeps the job running after
        a rank's process ended (MPICH's -disable-auto-cleanup), MPICH may say so here, as
        MPI_ERR_IN_STATUS from Testsome, instead of leaving the receive pending. Test each
        receive on its own: a worker whose receive failed is gone, and is declared lost now
        (not after --worker-timeout). Returns the receives that completed.

        The failed Testsome has already freed every request it completed, the failed one
        too: their handles are MPI_REQUEST_NULL, which tests as complete. Only the buffer
        tells a push that arrived from a receive that failed (nothing written since
        _post_recv cleared it); taken for a push, the failed one handled the worker's
        previous push again (a batch "outside its task", or a stale gradient)."""
        done = []
        for i, w in enumerate(order):
            if w.stopped:
                continue   # no receive posted since its last push
            try:
                if not reqs[i].Test():
                    continue
                error = None if wire.holds_push(w.link.recv[1]) else "receive failed, nothing received"
            except C.MPIError as exc:
                error = exc.Get_error_string().strip()
            if error is None:
                if not w.lost:
                    done.append(i)
                continue
            reqs[i] = w.link.recv_req = C.REQUEST_NULL
            if not w.lost:
                self._declare_lost(w, f"ended (MPI: {error})")
        return [i for i in done if not order[i].lost]

    def _reject(self, w: Peer, push: wire.PushMsg) -> None:
        """Workers send the mean gradient and check it is finite themselves (in parallel,
        off the server's hot path); a non-finite one is recomputed once, then fatal."""
        self.rejected += 1
        where = f"shard {push.shard} [{push.lo}, {push.hi})"
        print(f"mpilb: warning: rank {w.rank}: non-finite gradient for {where} rejected"
              + ("" if w.retried else "; retrying the batch"), file=sys.stderr, flush=True)
        if w.retried:  # the retry failed too: give up on this run
            raise RuntimeError(f"rank {w.rank}: non-finite gradient for {where} twice "
                               f"(also after a retry); lower --lr?")
        w.retry = w.retried = True
        self._reply(w)

    def _record(self, updates: list[Update], lr_scale: float, t: float) -> None:
        for u in updates:
            self.tracker.record(u.epoch, u.shard, u.lo, u.hi)
            self.log.append("updates", t=t, worker=u.rank, version=self.version, staleness=u.staleness,
                            batch=u.batch, loss=u.loss / max(1, u.batch), lr_scale=lr_scale,
                            epoch=u.epoch, shard=u.shard, lo=u.lo, hi=u.hi)

    def _advance(self, w: Peer, hi: int) -> None:
        if self.ledger.advance(w.rank, hi):
            w.epoch_finish = self.now()
        self._log_shards()

    def _respond(self, w: Peer) -> None:
        """Reply to w's push now, or hold it (ssp) until the slowest worker catches up."""
        if w.stopped:
            return
        if self.stop.reason:
            self._reply(w, Cmd.STOP)
            return
        self._top_up(w)
        if self.rule.holds_replies and self.rule.holds(w, self.present()):
            w.hold(time.monotonic())
            if self.ledger.has_orders(w.rank):   # rows others wait for must not wait
                self.outbox.orders(w)
            return
        self._send_reply(w)

    def _send_reply(self, w: Peer) -> None:
        held_s = w.release(time.monotonic())
        if not self.ledger.of[w.rank].owed:
            w.go_idle()
        self._reply(w, held_s=held_s)
        self._release_held()

    def _release_held(self) -> None:
        """Send the held replies the rule lets go now (after another reply went, or a loss).

        A held worker was topped up when it pushed, but much may have changed since: the
        epoch it pushed in may have ended meanwhile (the one who ended it was the push that
        released it). It is topped up again, as a sync round's members are, before its reply
        goes out: else, owed nothing, it would go idle with the new epoch's shards still
        queued for it (_begin_epoch hands them only to workers idle at the time), and with
        the others done (a fixed plan, or no steal that pays) every worker would wait for
        the next rebalance's _wake_idle with the epoch unfinished."""
        if not self.rule.holds_replies:
            return
        for o in self.rule.releasable(self.present()):
            if self.stop.reason:
                self._reply(o, Cmd.STOP)
                continue
            self._top_up(o)
            self._send_reply(o)

    def _close_round(self) -> None:
        """Apply a complete sync round and release its members."""
        self.remote.round(self.rule.batch, self.store.factor())
        updates, lr_scale, ranks = self.rule.close_round()
        self._record(updates, lr_scale, self.now())
        members = [self.peers[r] for r in ranks]
        if self.rule.sitout is not None:
            self.rule.sitout.note_lags(members)
            self.rule.sitout.after_round(members, self.present(), time.monotonic())
            self._log_shards()
        if self.tracker.complete:
            self._end_epoch()
        for w in members:
            if w.held and not w.stopped:
                if self.stop.reason:
                    self._reply(w, Cmd.STOP)
                else:
                    self._top_up(w)
                    self._send_reply(w)

    # ----------------------------------------------------------------- main loop
    def run(self) -> str:
        """Serve until training ends. Returns the final status."""
        self._start()
        order = list(self.peers.values())
        reqs = [w.link.recv_req for w in order]
        # Every worker rings when it pushes: sleep until one does (or the chores are due)
        # instead of polling for pushes on a schedule.
        rung = all(self.bell.rings_with(w.rank) for w in order)
        progress_until = spin_until = 0.0
        chores_s = self.CHORES_RUNG_S if rung else self.CHORES_S
        next_chores = chores_at = 0.0
        while not (self.stop.reason and self._all_stopped()):
            try:
                done = C.Request.Testsome(reqs)
            except C.MPIError:   # a worker's process ended (see _failed_receives)
                done = self._failed_receives(order, reqs)
            if done:
                for i in done:
                    w = order[i]
                    self.bell.took(w.rank)
                    self._on_push(w)
                    self.remote.settle(w.rank)   # a gradient not taken is dropped everywhere
                    if not (w.stopped or w.lost):
                        self._post_recv(w)
                        reqs[i] = w.link.recv_req
                self.backoff.reset(*self._next_push_due())
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
            elif rung:
                self.bell.rest(chores_at + self.RUNG_NAP_S - time.monotonic())
                if self.bell.take_poke():
                    progress_until = time.monotonic() + self.PROGRESS_S
            else:
                self.backoff.sleep()   # a ring from a worker on this node ends a sleep early
            mono = time.monotonic()
            if mono >= next_chores:   # every 10 or 25 ms at most, not at every poll
                next_chores, chores_at = mono + chores_s, mono
                self._chores()
        self.train_s = self.now()
        self.session.collect(wait=True)
        if self.session.eval_version != self.version:   # every stop ends with the final metric
            self._evaluate()
        self._log_worker_rows()
        C.drain(self.comm)
        # replies and parameters still in flight; a lost worker's last reply never completes
        # (a hung worker does not receive it): not waited for, else a degraded run ended 5 s
        # after its last epoch
        gone = {id(r) for w in order if w.lost for r in (w.link.reply_req, w.link.params_req)}
        deadline = time.monotonic() + 5.0
        backoff = C.Backoff()
        for req in self.store.pending() + self.outbox.sending:
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
        # Every run ends with its final parameters in the checkpoint; a preemption that
        # came while the run was already stopping did not write one.
        if self.cfg.checkpoint and (not self.preempted or self.checkpointed_at != self.version):
            self._checkpoint()
        if self.preempted:
            return "preempted"
        return "degraded" if self.lost else "finished"
