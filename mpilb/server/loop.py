"""The parameter server on rank 0: the protocol of docs/architecture.md, one push at a time.

Per worker w (messages in wire.py):
  w -> server  PUSH    [header | gradient] the positions [lo, hi) of a shard it covered, timings
  server -> w  REPLY   [header | params]   tasks, rows to send to others, a cut, batch size,
                                           version
  server -> w  ORDERS  [header]            rows to send, for a worker waiting on a reply
A push is decoded, handed to the update rule (modes.py: apply now, or join a sync round),
counted in the task ledger (core/tasks.py), and answered: at once, or held until the rule lets
it go (ssp bound, sync round). A worker with nothing left in the epoch idles until the server
sends it new tasks; STOP ends it.

The server is composed of parts, each owning its state (built in ``__init__`` below):
receive.py (the receives and the waits between pushes), epochs.py (epochs, handing out
tasks, and the pure decisions of core/decisions.py), chores.py (the timers between pushes,
checkpoints), liveness.py (lost workers), stopsignals.py (stop signals and their votes),
lifecycle.py (the clock, start and finish), outbox.py (replies and send orders), group.py
(rank 0's parameter stores), peers.py (each worker's link and state), roster.py (workers
that leave while the run goes on).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

from mpilb.core.decisions import Interval
from mpilb.core.sitout import SitOut
from mpilb.core.tasks import TaskLedger
from mpilb.core.topology import workers_of
from mpilb.data.shards import placement
from mpilb.mpi import doorbell
from mpilb.mpi import wire
from mpilb.mpi.wire import Cmd
from mpilb.run.session import Session
from mpilb.server.chores import Checkpoints, Chores
from mpilb.server.epochs import Epochs
from mpilb.server.group import SliceGroup
from mpilb.server.lifecycle import Clock, Lifecycle
from mpilb.server.liveness import Liveness
from mpilb.server.modes import Update, build_rule
from mpilb.server.outbox import Outbox
from mpilb.server.peers import Peer, Roster
from mpilb.server.receive import Receiver
from mpilb.server.roster import Members
from mpilb.server.stopsignals import StopSignals


class ParameterServer:
    """Rank 0 of a multi-rank run: the protocol, over the parts it is built of."""

    def __init__(self, cfg, dataset, comm, run_attrs: dict):
        self.cfg = cfg
        self.dataset = dataset
        self.comm = comm
        self.ranks = workers_of(cfg, comm.Get_size())   # the others hold parameters (--servers)
        self.hostnames = hosts = json.loads(run_attrs.get("hostnames", "[]"))   # by rank
        holders = (placement(len(dataset.shard_sizes), self.ranks, cfg.inputs.replicas, hosts)
                   if cfg.inputs.store == "local" else None)   # copies on other nodes
        self.session = s = Session(cfg, dataset, run_attrs, self.ranks, holders)
        ranks_here = hosts.count(hosts[0]) if hosts else comm.Get_size()   # on rank 0's node
        self.model, self.balancer, self.tracker = s.model, s.balancer, s.tracker
        self.stop, self.log = s.stop, s.log
        self.clock = Clock()
        self.slices = SliceGroup(cfg, s, comm)   # --servers K: rank 0's slice and the others
        self.ring, self.remote = self.slices.local, self.slices.remote
        # the factor on --lr (--lr-schedule, --warmup) at each version, on rank 0's clock
        self.ring.schedule = lambda version: s.schedule(version, self.now())
        self.ledger = TaskLedger(self.balancer, dataset.shard_sizes, self.ranks, holders=holders,
                                 row_nbytes=dataset.row_nbytes if holders is not None else 0,
                                 pipeline=bool(cfg.updates.pipeline),
                                 split=cfg.balancing.balancer not in ("static", "round-robin"))
        self.ledger.epoch = s.resumed.epoch if s.resumed else 0
        bal = cfg.balancing
        sitout = (SitOut(self.balancer, self.ledger, bal.batch, bal.min_batch, bal.max_batch,
                         bal.rebalance_interval) if self.balancer.config.sit_out else None)
        self.rule = build_rule(cfg.updates.mode, self.ring, lambda r: self.ledger.of[r].owed,
                               cfg.updates.staleness_bound, sitout)
        # a push carries the gradient (rank 0's slice), then the model's state (e.g. BatchNorm
        # statistics; only with one store, see server/store.py check_servers)
        self.roster = Roster({r: Peer(rank=r, batch=cfg.balancing.batch,
                                      link=self.slices.new_link(bool(cfg.updates.pipeline), r))
                              for r in self.ranks})
        self.peers = self.roster.peers
        bell = doorbell.current()
        self.outbox = Outbox(comm, self.ledger, self.remote, bell, self.slices)
        self.rejected = 0
        eval_timer = Interval(cfg.stopping.eval_interval)
        self.epochs = Epochs(cfg, dataset, s, self.ledger, self.roster, self.clock, self.slices,
                             sitout, self, eval_timer)
        self.members = Members.of_server(self, json.loads(run_attrs.get("nodes", "[]")))
        signals = StopSignals(comm, self.roster, self.clock, on_leave=self.members.request)
        self.liveness = Liveness(cfg, self.roster, self.ledger, self.balancer, self.remote, bell,
                                 self.outbox, self.tracker, self.stop, signals,
                                 self.epochs.log_shards, self.after_loss, self.members, self.ring)
        self.receiver = Receiver(comm, self.roster, bell, self.outbox, self.remote,
                                 self.liveness.declare_lost, self.slices)
        self.checkpoints = Checkpoints(cfg, s, self)
        self.chores = Chores(cfg, comm, s, self.clock, self.roster, self.slices, self.epochs,
                             self.liveness, signals, self.checkpoints, eval_timer, self.begin_stop)
        self.lifecycle = Lifecycle(cfg, s, self.clock, self.roster, self.slices, self.receiver,
                                   self.epochs, self.chores, self, ranks_here)

    # ----------------------------------------------------------------- state
    @property
    def params(self):
        """The whole parameter vector (gathered from every store with --servers K > 1)."""
        return self.slices.full_params()

    @property
    def version(self) -> int:
        return self.ring.version

    @property
    def epoch(self) -> int:
        return self.ledger.epoch

    @property
    def lost(self) -> list[int]:
        return self.roster.lost

    @property
    def train_s(self) -> Optional[float]:
        return self.lifecycle.train_s

    def now(self) -> float:
        return self.clock.now()

    def present(self) -> list[Peer]:
        """Workers still in the run (active or benched; not stopped, not lost)."""
        return self.roster.present()

    # ----------------------------------------------------------------- the run
    def run(self) -> str:
        """Serve until training ends. Returns the final status."""
        self.lifecycle.start()
        self.receiver.serve(lambda: bool(self.stop.reason) and self.roster.all_stopped(),
                            self.on_push, self.chores)
        self.lifecycle.wind_down()
        self.receiver.drain(self.slices.pending() + self.outbox.sending)
        self.members.close()
        return self.lifecycle.status()

    def finish(self, status: str) -> dict:
        """Close the session with the run's summary attributes (``status``: how it ended)."""
        return self.lifecycle.finish(status)

    def abandon(self) -> None:
        """Set-up failed elsewhere: close the run log as failed."""
        self.lifecycle.abandon()

    # ----------------------------------------------------------------- messages
    def reply(self, w: Peer, cmd: Cmd = Cmd.PARAMS, held_s: float = 0.0) -> None:
        """Send w the current parameters (or STOP; LEAVE if it asked) with its tasks and batch."""
        if cmd == Cmd.PARAMS and w.leaving:
            return self.members.depart(w)
        w.last_seen = time.monotonic()   # its silence counts from now (--worker-timeout)
        w.awaiting = cmd != Cmd.STOP and not w.idle
        self.outbox.reply(w, self.ring, cmd, held_s)
        if cmd == Cmd.STOP:
            w.stop()
        elif w.idle and self.ledger.has_orders(w.rank):
            self.outbox.orders(w)

    def send_orders_to_waiting(self) -> None:
        """Workers given send orders that wait for a message must be told now: idle or held
        ones, and those that may be blocked waiting for rows themselves (they serve orders
        while they wait, and push nothing that a reply could carry the orders on)."""
        for r in self.ledger.take_ordered():
            w = self.peers[r]
            if not self.ledger.has_orders(r) or not w.present:
                continue
            if w.waits_for_message or self.ledger.awaits_rows(r) is not None:
                self.outbox.orders(w)

    def begin_stop(self) -> None:
        """A stop rule fired (or a preemption): STOP to those waiting, the others at their push."""
        if not self.stop.reason:
            self.stop.reason = "stopped"
        for w in self.present():
            if w.idle or w.held:
                self.reply(w, Cmd.STOP)

    def after_loss(self) -> None:
        """A worker was lost: its shards may wake the idle, its round may be complete, and
        replies held for it may go."""
        self.epochs.wake_idle()
        if self.rule.round_complete(self.present()):
            self._close_round()
        self._release_held()

    # ----------------------------------------------------------------- pushes
    def on_push(self, w: Peer) -> None:
        push = wire.decode_push(w.link.recv.header)
        self.ring.bytes_in += w.link.recv.buf.nbytes
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
            return self.reply(w, Cmd.STOP)
        if push.nonfinite:
            return self._reject(w, push)
        w.retried = False
        # Without pipelining, reply -> push is what the step cost whoever waits for it.
        step_s = None if self.cfg.updates.pipeline or w.last_gap is None else w.last_gap
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
            return self.reply(w)
        update = Update(w.rank, push.epoch, push.shard, push.lo, push.hi, push.batch, push.loss,
                        self.version - push.version)
        then = self.ring.params_then(push.version, push.predicted)
        if self.model.num_state:   # the server keeps the latest state pushed
            self.model.set_state(self.slices.state(w.link))
        stream = self.slices.streams(w, self.rule, bool(self.stop.reason))
        self.remote.gradient(w.rank, update.batch, update.staleness, push.version, self.rule.rounds,
                             self.ring.factor(), stream, push.predicted)
        applied = self.slices.push(w, update, then, self.rule, self.outbox if stream else None)
        given = self.ring.exchange()
        if given is not None:   # the gradient's buffer holds the parameters now: this replaces it
            self.slices.took(w.link, given)
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
            self.epochs.end()
        self._respond(w)

    def _reject(self, w: Peer, push: wire.PushMsg) -> None:
        """Workers send the mean gradient and check it is finite themselves (in parallel,
        off the server's hot path); a non-finite one is recomputed once, then fatal."""
        self.rejected += 1
        where = f"shard {push.shard} [{push.lo}, {push.hi})"
        print(f"mpilb: warning: rank {w.rank}: non-finite gradient for {where} rejected"
              + ("" if w.retried else "; retrying the batch"), file=sys.stderr, flush=True)
        if w.retried:  # the retry failed too: give up on this run
            hint = " (--wire fp16 ends at 65504: or --wire bf16)" if self.cfg.updates.wire == "fp16" else ""
            raise RuntimeError(f"rank {w.rank}: non-finite gradient for {where} twice "
                               f"(also after a retry); {self.cfg.optim.divergence_hint()}{hint}")
        w.retry = w.retried = True
        self.reply(w)

    def _record(self, updates: list[Update], lr_scale: float, t: float) -> None:
        for u in updates:
            self.tracker.record(u.epoch, u.shard, u.lo, u.hi)
            self.log.append("updates", t=t, worker=u.rank, version=self.version, staleness=u.staleness,
                            batch=u.batch, loss=u.loss / max(1, u.batch), lr_scale=lr_scale,
                            epoch=u.epoch, shard=u.shard, lo=u.lo, hi=u.hi)
        self.epochs.applied(sum(u.batch for u in updates))   # --eval-every

    def _advance(self, w: Peer, hi: int) -> None:
        if self.ledger.advance(w.rank, hi):
            w.epoch_finish = self.now()
        self.epochs.log_shards()

    def _respond(self, w: Peer) -> None:
        """Reply to w's push now, or hold it (ssp) until the slowest worker catches up."""
        if w.stopped:
            return
        if self.stop.reason:
            return self.reply(w, Cmd.STOP)
        self.epochs.top_up(w)
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
        self.reply(w, held_s=held_s)
        self._release_held()

    def _release_held(self) -> None:
        """Send the held replies the rule lets go now (after another reply went, or a loss).

        A held worker was topped up when it pushed, but its epoch may have ended since (by
        the push that released it). It is topped up again, as a sync round's members are,
        before its reply goes out: else, owed nothing, it would go idle with the new epoch's
        shards still queued for it (Epochs.begin hands them only to workers idle then), and
        with the others done (a fixed plan, or no steal that pays) every worker would wait
        for the next rebalance's wake_idle with the epoch unfinished."""
        if not self.rule.holds_replies:
            return
        for o in self.rule.releasable(self.present()):
            if self.stop.reason:
                self.reply(o, Cmd.STOP)
                continue
            self.epochs.top_up(o)
            self._send_reply(o)

    def _close_round(self) -> None:
        """Apply a complete sync round and release its members."""
        self.remote.round(self.rule.batch, self.ring.factor())
        updates, lr_scale, ranks = self.rule.close_round()
        self._record(updates, lr_scale, self.now())
        members = [self.peers[r] for r in ranks]
        if self.rule.sitout is not None:
            self.rule.sitout.note_lags(members)
            self.rule.sitout.after_round(members, self.present(), time.monotonic())
            self.epochs.log_shards()
        if self.tracker.complete:
            self.epochs.end()
        for w in members:
            if w.held and not w.stopped:
                if self.stop.reason:
                    self.reply(w, Cmd.STOP)
                else:
                    self.epochs.top_up(w)
                    self._send_reply(w)
        self.members.admissions.round_closed()   # joiners that waited for it (round_entry.py)
