"""The parameter server on rank 0: parameters, optimizer, balancer, evaluation, run log.

Protocol (DESIGN.md; field layout in comm.py), per worker w:
  server -> w  REPLY   [header | params]   tasks (epoch, shard, start, end, source rank),
                                           rows to send to others, a cut, batch size, version
  server -> w  ORDERS  [header]            rows to send, for a worker waiting on a reply
  w -> server  PUSH    [header | gradient] the positions [lo, hi) of a shard it covered, timings
A worker waits for a reply after each push (with --pipeline 1 it computes the next gradient
meanwhile). A worker that has nothing left in the epoch idles until the server sends it new
tasks; STOP (header only) ends it. The server owns the shard queues (through the balancer):
a worker holds at most its current task and one more it is prefetching; everything else can
be moved between workers at any time without asking them, and the tail of a started task
can be cut off and handed to an idle worker (see _split_for).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from . import comm as C
from .balancer import build_balancer
from .comm import Cmd, Push, Reply
from .corrections import build_correction
from .progress import LogTap, Progress
from .report import summarize_log
from .runlog import RunLog
from .serial import balancer_config, format_final
from . import checkpoint
from .shards import placement
from .tensorboard import tap_for
from .training import (PREEMPTED, EpochStats, EpochTracker, Evaluator, StopRule, config_model,
                       config_optimizer, epoch_order)

COMMITTED = 2   # shards a worker holds at once: the current one and the one it prefetches
CHORES_S = 0.002   # how often the main loop checks errors, lost workers and timers
FIRST_SIZES_STEPS = 16   # proportional batches are first sized after this many steps each
PROBE_S = 2.0      # a worker sitting sync rounds out is tried again after this (at least)


@dataclass
class Task:
    """Positions [pos, end) of a shard's permuted order still to be applied by one worker."""

    epoch: int
    shard: int
    pos: int        # samples before `pos` are applied (or belong to another task)
    end: int
    src: int = -1   # rank sending the rows (node-local store), -1: read from storage
    start: int = -1

    def __post_init__(self):
        if self.start < 0:
            self.start = self.pos

    @property
    def remaining(self) -> int:
        return self.end - self.pos


@dataclass
class WorkerState:
    rank: int
    recv: tuple = None                      # (buf, header, payload)
    replies: list = field(default_factory=list)   # [(buf, header, payload, version)] x2
    reply_index: int = 0
    reply_req: Optional[object] = None
    recv_req: Optional[object] = None
    tasks: deque = field(default_factory=deque)
    idle: bool = False                      # told it has nothing to do; waits for a message
    held: bool = False                      # pushed; reply held (ssp/sync)
    held_since: float = 0.0
    pending_assign: list = field(default_factory=list)   # (epoch, shard, start, end, src, tag)
    pending_orders: list = field(default_factory=list)   # (epoch, shard, start, end, dst, tag)
    pending_trunc: Optional[tuple] = None                # (epoch, shard, end)
    orders_msg: tuple = None                # header-only buffer for Cmd.ORDERS
    orders_req: Optional[object] = None
    batch_sent: int = 0                     # the batch size its in-flight work uses
    next_shard: int = -1                    # pipeline: the batch it computes now
    next_hi: int = 0
    stopped: bool = False
    lost: bool = False
    step: int = 0
    batch: int = 0
    last_seen: float = 0.0
    awaiting: bool = False   # sent work and parameters, its next push is to come
    push_gap: C.WaitEstimate = field(default_factory=C.WaitEstimate)   # reply -> next push
    last_gap: Optional[float] = None   # reply -> push of its last push (its step's cost)
    # sync + proportional: too slow for even --min-batch within a round, it sits rounds out
    benched: bool = False
    benched_at: float = 0.0
    probing: int = 0         # back from the bench for a try: pushes left until the verdict
    lags: list = field(default_factory=list)   # its step minus the others' longest, per round
    drop: bool = False       # the next reply tells it to forget its tasks
    retry: bool = False      # ask the worker to recompute its last batch
    retried: bool = False    # that batch was already retried once
    # accumulators for the workers/ log (since the last row)
    samples: int = 0
    compute_s: float = 0.0
    io_s: float = 0.0
    comm_s: float = 0.0
    idle_s: float = 0.0
    # per epoch
    epoch_busy: float = 0.0
    epoch_finish: Optional[float] = None


class ParameterServer:
    """Rank 0 of a multi-rank run."""

    def __init__(self, cfg, dataset, comm, run_attrs: dict):
        self.cfg = cfg
        self.dataset = dataset
        self.comm = comm
        self.size = comm.Get_size()
        self.ranks = list(range(1, self.size))
        self.model = config_model(cfg, dataset)
        self.n = self.model.num_params
        self.params = self.model.init_params(cfg.seed)
        self.optimizer = config_optimizer(cfg, self.n)
        self.correction = build_correction(cfg.correction, cfg.dc_lambda)
        self.holders = (placement(len(dataset.shard_sizes), self.ranks, cfg.replicas)
                        if cfg.store == "local" else None)
        self.balancer = build_balancer(cfg.balancer, self.ranks, dataset.shard_sizes,
                                       balancer_config(cfg), self.holders)
        self.tracker = EpochTracker(dataset.shard_sizes)
        test_x, test_y = dataset.load_test()
        self.evaluator = Evaluator(self.model, test_x, test_y)
        self.stop = StopRule(cfg.epochs, cfg.max_seconds, cfg.target_accuracy)
        self.resumed = None
        if cfg.resume:
            self.resumed = checkpoint.load(cfg.checkpoint, self.model, dataset)
            ck = self.resumed
            self.params[:] = ck.params
            self.optimizer.load_state_dict(ck.optimizer)
            checkpoint.restore_balancer(self.balancer, ck.balancer)
        self.progress = Progress(enabled=cfg.progress, total_epochs=cfg.epochs,
                                 samples_per_epoch=self.tracker.total,
                                 interval=cfg.progress_interval, max_seconds=cfg.max_seconds)
        # the progress display and --tensorboard see every row of the run log
        self.log = LogTap(RunLog(cfg.log, run_attrs,
                                 resume_at=self.resumed.train_s if self.resumed else None),
                          self.progress, tap_for(cfg))
        self.eval_version = -1
        self.version = 0
        self.epoch = self.resumed.epoch if self.resumed else 0
        self.accuracy: Optional[float] = None
        # shard -> [(start, end)] still to do when it is next handed out (a lost worker's
        # remainder, or an interrupted epoch's gaps)
        self.pending_ranges: dict[int, list[tuple[int, int]]] = {}
        self.transfers = 0
        self.lost: list[int] = []
        self.rejected = 0
        self.workers = {r: WorkerState(rank=r, batch=cfg.batch) for r in self.ranks}
        for w in self.workers.values():
            w.recv = C.new_message(self.n)
            # pipelined workers compute on the previous reply while the next is sent: two slots
            w.replies = [list(C.new_message(self.n)) + [-1] for _ in range(2 if cfg.pipeline else 1)]
            w.orders_msg = C.new_message(0)
        self.sized_early = False
        if cfg.mode == "sync":
            self.round_grad = np.zeros(self.n, dtype=np.float32)
            self.round_batch = 0
            self.round_members: list[int] = []
            self.round_tasks: list[tuple] = []
        self.preempted = False
        self.backoff = C.Backoff()
        self.sending: list = []    # reply sends not known to be complete

    # ----------------------------------------------------------------- helpers
    def now(self) -> float:
        return time.monotonic() - self.t0

    def active(self):
        return [w for w in self.workers.values() if not (w.lost or w.stopped)]

    def _post_recv(self, w: WorkerState) -> None:
        w.recv_req = self.comm.Irecv(w.recv[0], source=w.rank, tag=C.TAG_PUSH)

    def _reply(self, w: WorkerState, cmd: Cmd = Cmd.PARAMS, held_s: float = 0.0) -> None:
        """Send w the current parameters (or STOP) with its assignments and batch size."""
        w.last_seen = time.monotonic()   # its silence counts from now (--worker-timeout)
        w.awaiting = cmd != Cmd.STOP and not w.idle
        if w.reply_req is not None:
            w.reply_req.Wait()   # the previous reply was received before w pushed again
        slot = w.replies[w.reply_index]
        w.reply_index = 1 - w.reply_index if self.cfg.pipeline else 0
        buf, hdr, payload = slot[0], slot[1], slot[2]
        hdr[:] = 0
        hdr[Reply.CMD] = cmd
        hdr[Reply.VERSION] = self.version
        hdr[Reply.BATCH] = w.batch
        hdr[Reply.HELD_S] = held_s
        hdr[Reply.RETRY] = 1 if w.retry else 0
        hdr[Reply.DROP] = 1 if w.drop else 0
        w.retry = w.drop = False
        if cmd != Cmd.STOP:
            w.batch_sent = max(w.batch_sent, w.batch) if w.tasks else w.batch
            n = C.TASK_FIELDS
            assigns, w.pending_assign = w.pending_assign[:C.MAX_ASSIGN], w.pending_assign[C.MAX_ASSIGN:]
            hdr[Reply.N_ASSIGN] = len(assigns)
            for i, task in enumerate(assigns):
                hdr[Reply.ASSIGN + n * i: Reply.ASSIGN + n * (i + 1)] = task
            orders, w.pending_orders = w.pending_orders[:C.MAX_ORDER], w.pending_orders[C.MAX_ORDER:]
            hdr[Reply.N_ORDER] = len(orders)
            for i, order in enumerate(orders):
                hdr[Reply.ORDER + n * i: Reply.ORDER + n * (i + 1)] = order
            if w.pending_trunc is not None:
                hdr[Reply.TRUNC_EPOCH], hdr[Reply.TRUNC_SHARD], hdr[Reply.TRUNC_END] = w.pending_trunc
                w.pending_trunc = None
        if cmd == Cmd.STOP:
            w.reply_req = self.comm.Isend(buf[:C.HEADER_BYTES], dest=w.rank, tag=C.TAG_REPLY)
            self.sending.append(w.reply_req)
            w.stopped = True
            return
        np.copyto(payload, self.params)
        slot[3] = self.version
        w.reply_req = self.comm.Isend(buf, dest=w.rank, tag=C.TAG_REPLY)
        self.sending.append(w.reply_req)
        if w.pending_orders and w.idle:
            self._send_orders(w)

    def _send_orders(self, w: WorkerState) -> None:
        """Orders to send rows, for a worker that is waiting (idle, or its reply is held)."""
        if w.orders_req is not None:
            w.orders_req.Wait()
        hdr = w.orders_msg[1]
        hdr[:] = 0
        hdr[Reply.CMD] = Cmd.ORDERS
        n = C.TASK_FIELDS
        orders, w.pending_orders = w.pending_orders[:C.MAX_ORDER], w.pending_orders[C.MAX_ORDER:]
        hdr[Reply.N_ORDER] = len(orders)
        for i, order in enumerate(orders):
            hdr[Reply.ORDER + n * i: Reply.ORDER + n * (i + 1)] = order
        w.orders_req = self.comm.Isend(w.orders_msg[0], dest=w.rank, tag=C.TAG_REPLY)
        self.sending.append(w.orders_req)
        if w.pending_orders:
            w.orders_req.Wait()
            self._send_orders(w)

    def _params_then(self, w: WorkerState, version: int) -> Optional[np.ndarray]:
        for slot in w.replies:
            if slot[3] == version:
                return slot[2]
        return None

    def _top_up(self, w: WorkerState) -> None:
        """Hand w shards until it holds COMMITTED of them; with none left, split another's."""
        if self.stop.reason or w.lost or w.benched:
            return
        while len(w.tasks) < COMMITTED:
            shard = self.balancer.next_shard(w.rank)
            if shard is None:
                break
            size = self.dataset.shard_sizes[shard]
            ranges = self.pending_ranges.pop(shard, None) or [(0, size)]
            done = size - sum(hi - lo for lo, hi in ranges)
            if done:   # a remainder (resumed or taken over): only that part is work
                self.balancer.discount(w.rank, done)
            for lo, hi in ranges:
                self._assign(w, shard, lo, hi)
        self._log_moves()
        if not w.tasks:
            self._split_for(w)

    def _assign(self, w: WorkerState, shard: int, lo: int, hi: int, source: Optional[WorkerState] = None,
                event: str = "assign") -> None:
        """Give w positions [lo, hi) of `shard`; with a local store, have a holder send them."""
        src, tag, nbytes = -1, 0, 0
        if self.holders is not None and (source is not None or w.rank not in self.holders[shard]):
            giver = source or self._holder_for(shard, hi - lo)
            src, tag = giver.rank, self._next_tag()
            nbytes = (hi - lo) * self.dataset.row_nbytes
            giver.pending_orders.append((self.epoch, shard, lo, hi, w.rank, tag))
            if giver.idle or giver.held:   # it waits for a message: send the order now
                self._send_orders(giver)
        w.tasks.append(Task(self.epoch, shard, lo, hi, src))
        w.pending_assign.append((self.epoch, shard, lo, hi, src, tag))
        origin = src if src >= 0 else (source.rank if source is not None else -1)
        self.log.append("shards", t=self.now(), epoch=self.epoch, shard=shard, src=origin,
                        dst=w.rank, event=event if origin < 0 else "move", bytes=nbytes)

    def _holder_for(self, shard: int, rows: int) -> WorkerState:
        """The holder of a shard copy that can deliver soonest.

        A holder must read the rows before it sends them; its rate includes its reads, so
        (work it holds + the rows) / rate ranks a slow reader last even when it is idle.
        """
        alive = [self.workers[r] for r in self.holders[shard] if not self.workers[r].lost]
        if not alive:
            raise RuntimeError(f"shard {shard}: every rank holding a copy was lost "
                               f"(use --replicas 2 or more to survive this)")
        return min(alive, key=lambda h: (sum(t.remaining for t in h.tasks) + rows)
                   / max(1e-9, self.balancer.effective_rate(h.rank)))

    def _next_tag(self) -> int:
        self.transfers += 1
        return C.TAG_SHARD_BASE + 2 * (self.transfers % C.SHARD_TAGS)

    def _split_for(self, thief: WorkerState) -> None:
        """Give an idle worker the tail of the task that would finish last (part-way move).

        The donor keeps [pos, cut) and the thief takes [cut, end), with the cut chosen so both
        finish together; `cut` lies past anything the donor may already be computing, and the
        donor learns of it in its next reply, before it could reach it.
        """
        if self.cfg.balancer in ("static", "round-robin") or self.stop.reason or thief.lost:
            return
        best = None
        for d in self.active():
            if d is thief or not d.tasks or d.pending_trunc is not None:
                continue
            task = d.tasks[-1]
            if task.epoch != self.epoch:
                continue
            current = len(d.tasks) == 1
            if self.holders is not None and not current and d.rank not in self.holders[task.shard]:
                continue   # its rows are not in the donor's memory or store: nothing to send
            # How far the donor may get before it reads the cut: one batch past what it is
            # computing now; pipelined, two (the batch it announced may not have reached us,
            # and it computes one more while waiting), possibly into a task it has not
            # started. Without pipelining a task it has not started stays untouched.
            if self.cfg.pipeline:
                reach = d.next_hi if d.next_shard == task.shard else task.pos
                cut_min = max(task.pos, reach) + 2 * d.batch_sent
            else:
                cut_min = task.pos + (d.batch_sent if current else 0)
            splittable = task.end - cut_min
            if splittable < max(2 * d.batch_sent, thief.batch):
                continue
            r_d = max(1e-9, self.balancer.effective_rate(d.rank))
            r_t = max(1e-9, self.balancer.effective_rate(thief.rank))
            before = sum(t.remaining for t in d.tasks) - splittable
            keep = int((splittable * r_d - before * r_t) / (r_d + r_t))
            keep = min(max(keep, 0), splittable)
            give = splittable - keep
            finish = (before + splittable) / r_d
            if give >= thief.batch and (best is None or finish > best[0]):
                best = (finish, d, task, cut_min + keep)
        if best is None:
            return
        _, donor, task, cut = best
        end = task.end
        self.balancer.discount(donor.rank, end - cut)
        task.end = cut
        donor.pending_trunc = (task.epoch, task.shard, cut)
        if task.remaining <= 0 and task is donor.tasks[-1] and len(donor.tasks) > 1:
            donor.tasks.pop()
        self._assign(thief, task.shard, cut, end, source=donor, event="move")

    def _log_moves(self) -> None:
        for mv in self.balancer.take_moves():
            self.log.append("shards", t=self.now(), epoch=self.epoch, shard=mv.shard,
                            src=mv.src, dst=mv.dst, event="reassign" if mv.reason == "lost" else "move")

    # ----------------------------------------------------------------- epochs
    def _begin_epoch(self, epoch: int, resume_counts=None) -> None:
        self.epoch = epoch
        order = epoch_order(self.cfg.seed, epoch, len(self.dataset.shard_sizes))
        if resume_counts is None:
            self.tracker.begin(epoch, self.now())
        else:   # an interrupted epoch: only what was not applied yet
            self.tracker.begin(epoch, self.now(), resume_counts)
            order, self.pending_ranges = checkpoint.resume_plan(
                order, resume_counts, self.tracker.offsets, self.dataset.shard_sizes)
        self.balancer.plan_epoch(epoch, order)
        self._update_batches()
        if self.tracker.complete:   # resumed from a checkpoint taken as the epoch ended
            self._end_epoch()
            return
        self._log_moves()
        for w in self.active():
            w.epoch_busy = 0.0
            w.epoch_finish = None
        floor = min((w.step for w in self.active() if not w.idle), default=None)
        for w in self.active():
            if w.idle:
                self._top_up(w)
                if w.pending_assign:
                    if floor is not None:
                        w.step = max(w.step, floor)
                    w.idle = False
                    self._reply(w)

    def _wake_idle(self) -> None:
        """Send work to idle workers that the balancer has given shards to (e.g. by a move)."""
        if self.stop.reason:
            return
        for w in self.active():
            if w.idle:
                self._top_up(w)
                if w.pending_assign:
                    w.idle = False
                    self._reply(w)

    def _end_epoch(self) -> None:
        t = self.now()
        stats = self.tracker.end(t)
        span = max(1e-9, stats.t_end - stats.t_start)
        active = [w for w in self.workers.values() if not w.lost]
        busy = sum(w.epoch_busy for w in active)
        util = min(1.0, busy / (len(active) * span)) if active else 0.0
        finishes = [w.epoch_finish for w in active if w.epoch_finish is not None]
        imbalance = (max(finishes) - min(finishes)) if finishes else 0.0
        self.log.append("epochs", epoch=stats.epoch, t_start=stats.t_start, t_end=stats.t_end,
                        samples=stats.samples, utilization=util, imbalance_s=imbalance)
        self._evaluate()
        self.progress.epoch_done(stats.epoch, self.accuracy)
        if self.stop.check(stats.epoch + 1, t, self.accuracy):
            self._begin_stop()
        else:
            self._begin_epoch(stats.epoch + 1)

    def _evaluate(self) -> None:
        loss, acc = self.evaluator(self.params)
        self.accuracy = acc
        self.log.append("eval", t=self.now(), version=self.version, epoch=self.epoch,
                        test_loss=loss, test_accuracy=acc)
        self.last_eval = time.monotonic()
        self.eval_version = self.version

    # ----------------------------------------------------------------- pushes
    def _on_push(self, w: WorkerState) -> None:
        _, hdr, grad = w.recv
        now = self.now()
        mono = time.monotonic()
        w.last_gap = None
        if w.awaiting:
            w.last_gap = mono - w.last_seen
            # The gap seen here includes how late this loop noticed the push; the worker's
            # own busy time does not (waking later for having woken late would feed on itself).
            w.push_gap.update(min(w.last_gap, float(hdr[Push.COMPUTE_S] + hdr[Push.IO_S])))
            w.awaiting = False
        w.last_seen = mono
        if w.lost:
            return
        b = int(hdr[Push.BATCH])
        epoch, shard, lo, hi = (int(hdr[Push.EPOCH]), int(hdr[Push.SHARD]),
                                int(hdr[Push.LO]), int(hdr[Push.HI]))
        busy = hdr[Push.COMPUTE_S] + hdr[Push.IO_S]
        w.compute_s += hdr[Push.COMPUTE_S]
        w.io_s += hdr[Push.IO_S]
        w.comm_s += hdr[Push.COMM_S]
        w.idle_s += hdr[Push.IDLE_S]
        w.epoch_busy += busy + hdr[Push.COMM_S]
        if self.stop.reason:
            self._reply(w, Cmd.STOP)
            return
        # Workers send the mean gradient and check it is finite themselves (in parallel,
        # off the server's hot path); the flag says whether it was.
        if hdr[Push.NONFINITE]:
            self.rejected += 1
            print(f"mpilb: warning: rank {w.rank}: non-finite gradient for shard {shard} "
                  f"[{lo}, {hi}) rejected" + ("" if w.retried else "; retrying the batch"),
                  file=sys.stderr, flush=True)
            if w.retried:  # the retry failed too: give up on this run
                raise RuntimeError(f"rank {w.rank}: non-finite gradient for shard {shard} "
                                   f"[{lo}, {hi}) twice (also after a retry); lower --lr?")
            w.retry = w.retried = True
            self._reply(w)
            return
        w.retried = False
        # Without pipelining, reply -> push is what the step cost whoever waits for it.
        step_s = None if self.cfg.pipeline or w.last_gap is None else w.last_gap
        self.balancer.observe(w.rank, now, hi - lo, busy, comm_s=float(hdr[Push.COMM_S]),
                              step_s=step_s)
        w.next_shard, w.next_hi = int(hdr[Push.NEXT_SHARD]), int(hdr[Push.NEXT_HI])
        w.samples += hi - lo
        w.step += 1
        task = w.tasks[0] if w.tasks else None
        if task is None or task.shard != shard or task.epoch != epoch:
            # a batch from a shard this worker no longer holds (e.g. reassigned): drop it
            self.tracker.stray += hi - lo
            self._reply(w)
            return
        staleness = self.version - int(hdr[Push.VERSION])
        if self.cfg.mode == "sync":
            np.multiply(grad, b, out=grad)      # back to the sum: rounds weight by batch
            self.round_grad += grad
            self.round_batch += b
            self.round_members.append(w.rank)
            self.round_tasks.append((w.rank, epoch, shard, lo, hi, b, float(hdr[Push.LOSS]), staleness))
            w.held = True
            w.held_since = time.monotonic()
            if w.pending_orders:   # rows others wait for must not wait for this round
                self._send_orders(w)
            self._advance(w, hi)
            if self._round_complete():
                self._apply_round()
            return
        lr_scale = b / self.cfg.batch
        then = self._params_then(w, int(hdr[Push.VERSION])) if self.correction.needs_old_params else None
        lr_scale *= self.correction.apply(grad, staleness, self.params, then)
        self.optimizer.step(self.params, grad, lr_scale)
        self.version += 1
        self.tracker.record(epoch, shard, lo, hi)
        self.log.append("updates", t=now, worker=w.rank, version=self.version, staleness=staleness,
                        batch=b, loss=float(hdr[Push.LOSS]) / max(1, b), lr_scale=lr_scale,
                        epoch=epoch, shard=shard)
        self._advance(w, hi)
        if self.tracker.complete:
            self._end_epoch()
        self._respond(w)

    def _advance(self, w: WorkerState, hi: int) -> None:
        task = w.tasks[0]
        first = task.pos == 0
        task.pos = hi
        if first:
            self.log.append("shards", t=self.now(), epoch=task.epoch, shard=task.shard, src=-1,
                            dst=w.rank, event="start")
        if task.pos >= task.end:
            w.tasks.popleft()
            w.epoch_finish = self.now()
            self.log.append("shards", t=self.now(), epoch=task.epoch, shard=task.shard, src=-1,
                            dst=w.rank, event="done")

    def _respond(self, w: WorkerState) -> None:
        """Reply to w's push now, or hold it (ssp) until the slowest worker catches up."""
        if w.stopped:
            return
        if self.stop.reason:
            self._reply(w, Cmd.STOP)
            return
        self._top_up(w)
        if self.cfg.mode == "ssp" and self._too_far_ahead(w):
            w.held = True
            w.held_since = time.monotonic()
            if w.pending_orders:   # rows others wait for must not wait for this round
                self._send_orders(w)
            return
        self._send_reply(w)

    def _send_reply(self, w: WorkerState) -> None:
        held_s = time.monotonic() - w.held_since if w.held else 0.0
        w.held = False
        if not w.tasks and not w.pending_assign:
            w.idle = True
        self._reply(w, held_s=held_s)
        if self.cfg.mode == "ssp":
            self._release_held()

    def _too_far_ahead(self, w: WorkerState) -> bool:
        others = [o.step for o in self.active() if o is not w and not o.idle and (o.tasks or o.pending_assign)]
        return bool(others) and w.step - min(others) > self.cfg.staleness_bound

    def _release_held(self) -> None:
        for o in self.active():
            if o.held and not self._too_far_ahead(o):
                self._send_reply(o)

    # ----------------------------------------------------------------- sync rounds
    def _round_complete(self) -> bool:
        expected = [w.rank for w in self.active() if not w.idle]
        return set(expected) <= set(self.round_members)

    def _apply_round(self) -> None:
        b = self.round_batch
        grad = self.round_grad
        grad /= max(1, b)
        members = self.round_members
        # The same learning rate per sample as async and serial runs: a round of W batches
        # moves the parameters as far as W async updates would (linear scaling rule).
        lr_scale = b / self.cfg.batch
        self.optimizer.step(self.params, grad, lr_scale)
        self.version += 1
        now = self.now()
        for rank, epoch, shard, lo, hi, bb, loss, staleness in self.round_tasks:
            self.tracker.record(epoch, shard, lo, hi)
            self.log.append("updates", t=now, worker=rank, version=self.version, staleness=staleness,
                            batch=bb, loss=loss / max(1, bb), lr_scale=lr_scale, epoch=epoch, shard=shard)
        grad[:] = 0
        self.round_batch = 0
        self.round_members = []
        self.round_tasks = []
        self._note_lags(members)
        for rank in members:
            w = self.workers[rank]
            if w.probing:
                w.probing -= 1
                if not w.probing:
                    self._end_probe(w)
            elif w.batch == 0 and not w.benched:
                self._bench(w)
        if self.tracker.complete:
            self._end_epoch()
        for rank in members:
            w = self.workers[rank]
            if w.held and not w.stopped:
                if self.stop.reason:
                    self._reply(w, Cmd.STOP)
                else:
                    self._top_up(w)
                    self._send_reply(w)

    def _next_push_due(self) -> tuple[Optional[float], float]:
        """(due, grace) of the next push expected, for the backoff (see C.Backoff)."""
        now = time.monotonic()
        best: tuple[Optional[float], float] = (None, 0.0)
        for w in self.workers.values():
            if not w.awaiting or w.lost:
                continue
            due, grace = w.push_gap.window(w.last_seen)
            if due is not None and due + grace > now and (best[0] is None or due < best[0]):
                best = (due, grace)
        return best

    # ----------------------------------------------------------------- sitting out
    def _bench(self, w: WorkerState) -> None:
        """w sits sync rounds out (proportional batches gave it 0): what is left of its tasks
        goes back to the balancer for the others; its next reply tells it to drop them."""
        if w.benched or any(t.src >= 0 for t in w.tasks) or w.pending_orders:
            return   # rows on their way to or from it: not now
        if not [o for o in self.active() if o is not w and not o.benched]:
            return
        w.pending_assign.clear()
        w.pending_trunc = None
        w.drop = True
        w.benched, w.probing = True, 0
        w.benched_at = time.monotonic()
        w.batch = 0
        self.balancer.bench(w.rank)
        self._take_back(w)

    def _note_lags(self, members: list[int]) -> None:
        """How much longer each member's step was than the longest of the others' (< 0: not
        the straggler): the evidence for sitting out that fitted step times may miss."""
        if not self.balancer.config.sit_out or len(members) < 2:
            return
        gaps = [(r, self.workers[r].last_gap) for r in members]
        if any(g is None for _, g in gaps):
            return
        gaps.sort(key=lambda rg: rg[1])
        (r1, g1), (_, g2) = gaps[-1], gaps[-2]
        for r, g in gaps:
            self.workers[r].lags.append(g - (g2 if r == r1 else g1))

    def _slows_rounds(self, w: WorkerState) -> bool:
        """True when the rounds would be shorter without w: over the last interval its step
        was the longest by more than the others would need to take over its batch."""
        if len(w.lags) < 10 or w.batch <= 0:
            return False
        lag = sorted(w.lags)[len(w.lags) // 2]
        others = [o for o in self.active() if o is not w and not o.benched and o.batch > 0]
        if not others or lag <= 0:
            return False
        # measured, not modelled: early on, rate estimates are not there yet
        per_sample = sum((o.last_gap or 0.0) / o.batch for o in others) / len(others)
        takeover = w.batch * per_sample / len(others)
        step = self.balancer.round_step or 0.0
        return lag > max(takeover, 0.05 * step)

    def _probe_batch(self) -> int:
        """Half an even share: a worker that cannot carry that within the round's step
        has no place in the rounds; one that can is back for proportional sizing."""
        return min(max(self.cfg.min_batch, self.cfg.batch // 2), self.cfg.max_batch)

    def _take_back(self, w: WorkerState) -> None:
        """What is left of w's tasks this epoch goes back to the balancer, as ranges for
        whoever gets the shard next (w lost or benched, and already out of the balancer)."""
        requeue = []
        for task in w.tasks:
            if task.epoch == self.epoch and task.remaining > 0:
                self.pending_ranges.setdefault(task.shard, []).append((task.pos, task.end))
                if task.shard not in requeue:
                    requeue.append(task.shard)
                self.log.append("shards", t=self.now(), epoch=task.epoch, shard=task.shard,
                                src=w.rank, dst=-1, event="reassign")
        w.tasks.clear()
        if requeue:
            self.balancer.requeue(requeue)
        self._log_moves()

    def _start_probes(self, mono: float) -> None:
        """Give each worker benched long enough one more try (see _end_probe)."""
        wait = max(PROBE_S, 4 * self.cfg.rebalance_interval)
        for w in self.active():
            if w.benched and mono - w.benched_at >= wait:
                # two steps: the first after a long idle wait runs cold (caches, pages)
                w.benched, w.probing = False, 2
                w.batch = self._probe_batch()
                self.balancer.unbench(w.rank)

    def _end_probe(self, w: WorkerState) -> None:
        """After a probing worker's second push: back in the rounds if its step at the probe batch
        (its compute, plus the others' usual per-step overhead: it was woken from an idle
        wait, so its own reply -> push time includes a late wake-up) fits in the round's
        step time; else on the bench again. A probe cut short by the end of a task (less
        than half the probe batch) proves nothing: the worker is back in the rounds and
        the lag check decides at the next rebalance."""
        hdr = w.recv[1]
        done = int(hdr[Push.HI] - hdr[Push.LO])
        want = self._probe_batch()
        target = self.balancer.round_step
        others = [o for o in self.active() if o is not w and not o.benched]
        fits = True
        if target is not None and others and done >= want / 2:
            overhead = sum(self.balancer.step_model(o.rank)[0] for o in others) / len(others)
            step = float(hdr[Push.COMPUTE_S]) * want / done + overhead
            fits = step <= target
        if fits:
            self.balancer.forget(w.rank)   # measured while it was slow
        else:
            self._bench(w)

    # ----------------------------------------------------------------- timers
    def _timers(self) -> None:
        mono = time.monotonic()
        if PREEMPTED.is_set() and not self.preempted:
            self._preempt()
        if (self.cfg.checkpoint and not self.stop.reason
                and mono - self.last_checkpoint >= self.cfg.checkpoint_interval):
            self._checkpoint()
        if mono - self.last_rebalance >= self.cfg.rebalance_interval or self._first_sizes_due():
            self._rebalance(mono)
        if mono - self.last_eval >= self.cfg.eval_interval:
            self._evaluate()
            if self.stop.check(self.tracker.epoch, self.now(), self.accuracy):
                self._begin_stop()
        if self.cfg.max_seconds is not None and self.now() >= self.cfg.max_seconds and not self.stop.reason:
            self.stop.check(self.tracker.epoch, self.now(), self.accuracy)
            self._begin_stop()
        self.log.maybe_flush()
        rates = {w.rank: self.balancer.rate(w.rank) for w in self.active()}
        self.progress.update(self.epoch, self.tracker.distinct, self.version, self.accuracy, rates,
                             lost=self.lost)

    def _first_sizes_due(self) -> bool:
        """Proportional batches: size them as soon as every worker has taken a few steps,
        not only at the first --rebalance-interval (a slow worker costs every round)."""
        if self.sized_early or self.cfg.batch_policy != "proportional":
            return False
        busy = [w for w in self.active() if not w.idle]
        if busy and all(w.step >= FIRST_SIZES_STEPS for w in busy):
            self.sized_early = True
        return self.sized_early

    def _rebalance(self, mono: float) -> None:
        self.last_rebalance = mono
        t = self.now()
        committed = {w.rank: sum(task.remaining for task in w.tasks) for w in self.active()}
        if self.cfg.mode == "sync":
            self._start_probes(mono)
        self.balancer.rebalance(t, committed)
        self._log_moves()
        self._wake_idle()
        self._update_batches()
        self._log_worker_rows()

    def _update_batches(self) -> None:
        slow = {w.rank for w in self.active() if self.balancer.config.sit_out and not w.probing
                and self._slows_rounds(w)}   # judged on the interval that just ended
        sizes = self.balancer.batch_sizes(frozenset(slow))
        for w in self.active():
            w.batch = int(sizes.get(w.rank, self.cfg.batch))
            if w.probing:
                w.batch = self._probe_batch()
            elif w.rank in slow:
                w.batch = 0
            if w.batch == 0 and not w.benched and w.idle and not w.held:
                self._bench(w)   # nothing in flight: at once (else after its next push)
            w.lags.clear()

    def _log_worker_rows(self) -> None:
        """One `workers/` row per worker with what it reported since the previous row."""
        t = self.now()
        for w in self.workers.values():
            if w.lost:
                continue
            self.log.append("workers", t=t, worker=w.rank, samples=w.samples, compute_s=w.compute_s,
                            io_s=w.io_s, comm_s=w.comm_s, idle_s=w.idle_s, batch=w.batch,
                            rate=self.balancer.rate(w.rank),
                            predicted_rate=self.balancer.predicted_rate(w.rank))
            w.samples, w.compute_s, w.io_s, w.comm_s, w.idle_s = 0, 0.0, 0.0, 0.0, 0.0

    def _check_lost(self) -> None:
        mono = time.monotonic()
        for w in self.active():
            if w.idle or w.held:
                continue
            if mono - w.last_seen > self.cfg.worker_timeout:
                self._declare_lost(w)

    def _check_stalled(self) -> None:
        """Every worker idle with the epoch unfinished would wait forever: a bug, say so."""
        if self.stop.reason or self.tracker.complete:
            return
        active = self.active()
        if active and all(w.idle for w in active) and not any(self.balancer.queued(w.rank) for w in active):
            missing = self.tracker.total - self.tracker.distinct
            raise RuntimeError(f"epoch {self.epoch}: every worker is idle but {missing} samples "
                               f"were never handed out (balancer {self.cfg.balancer})")

    def _declare_lost(self, w: WorkerState) -> None:
        print(f"mpilb: rank {w.rank} silent for {self.cfg.worker_timeout:g} s: declared lost; "
              f"its shards go to the other workers", file=sys.stderr, flush=True)
        w.lost = True
        self.lost.append(w.rank)
        self.balancer.remove_worker(w.rank)
        self._take_back(w)
        if all(o.lost for o in self.workers.values()):
            raise RuntimeError("every worker was lost")
        for o in self.active():   # rows it was to send can no longer arrive
            for t in o.tasks:
                if t.src == w.rank and t.pos == t.start:
                    raise RuntimeError(
                        f"rank {w.rank} was lost before sending rows of shard {t.shard} to rank "
                        f"{o.rank}, which waits for them; this run cannot continue: resume from "
                        f"the last checkpoint")
        self._wake_idle()
        if self.cfg.mode == "sync" and self.round_members and self._round_complete():
            self._apply_round()
        if self.cfg.mode == "ssp":
            self._release_held()

    # ----------------------------------------------------------------- stop
    def _begin_stop(self) -> None:
        if not self.stop.reason:
            self.stop.reason = "stopped"
        for w in self.active():
            if w.idle or w.held:
                self._reply(w, Cmd.STOP)

    def _all_stopped(self) -> bool:
        return all(w.stopped or w.lost for w in self.workers.values())

    # ----------------------------------------------------------------- main loop
    def run(self) -> str:
        """Serve until training ends. Returns the final status."""
        self.t0 = time.monotonic() - (self.resumed.train_s if self.resumed else 0.0)
        self.cpu0 = time.process_time()
        self.last_checkpoint = time.monotonic()
        self.last_eval = self.last_rebalance = self.t0
        for w in self.workers.values():
            w.last_seen = self.t0
            self._post_recv(w)
        for w in self.workers.values():
            w.idle = True
        ck = self.resumed
        self.progress.begin(ck.epoch if ck else 0, int((ck.counts > 0).sum()) if ck else 0, self.now())
        if ck is None:
            self._begin_epoch(0)
        else:
            self.version = ck.version
            self.tracker.completed = [EpochStats(**e) for e in ck.completed]
            if ck.epoch >= self.cfg.epochs or self.stop.check(ck.epoch, self.now(), None):
                self.stop.reason = self.stop.reason or "epochs"
                self._begin_stop()
            else:
                self._begin_epoch(ck.epoch, ck.counts)
        reqs = [w.recv_req for w in self.workers.values()]
        order = list(self.workers.values())
        next_chores = 0.0
        while not (self.stop.reason and self._all_stopped()):
            done = C.Request.Testsome(reqs)
            if done:
                for i in done:
                    w = order[i]
                    self._on_push(w)
                    if not (w.stopped or w.lost):
                        self._post_recv(w)
                        reqs[i] = w.recv_req
                self.backoff.reset(*self._next_push_due())
            else:
                # While replies are still being transferred keep MPI progressing (yield the
                # core, don't sleep); when nothing is under way, back off.
                self.sending = [r for r in self.sending if not r.Test()]
                if self.sending:
                    self.backoff.short()
                else:
                    self.backoff.sleep()
            mono = time.monotonic()
            if mono >= next_chores:   # a few hundred times a second, not at every poll
                next_chores = mono + CHORES_S
                err = C.poll_error(self.comm)
                if err is not None:
                    raise WorkerFailed(*err)
                if C.poll_preempt(self.comm):
                    PREEMPTED.set()
                self._check_lost()
                self._check_stalled()
                self._timers()
        self.train_s = self.now()
        if self.eval_version != self.version:   # every stop ends with the final metric
            self._evaluate()
        self._log_worker_rows()
        C.drain(self.comm)
        for i, w in enumerate(order):
            if w.reply_req is not None and not w.lost:
                C.wait(w.reply_req, timeout=5.0)
            if reqs[i] is not None and not reqs[i].Test():
                reqs[i].Cancel()   # the receive preposted for a push that never came
                C.wait(reqs[i], timeout=1.0)
        if self.preempted:
            return "preempted"
        if self.cfg.checkpoint:
            self._checkpoint()
        return "degraded" if self.lost else "finished"

    def _checkpoint(self) -> None:
        self.last_checkpoint = time.monotonic()
        if not self.cfg.checkpoint:
            return
        self.log.flush()   # the log holds everything up to the checkpoint: a resume continues it
        checkpoint.save(self.cfg.checkpoint, cfg=self.cfg, model=self.model, dataset=self.dataset,
                        params=self.params, optimizer=self.optimizer, version=self.version,
                        epoch=self.epoch, tracker=self.tracker, balancer=self.balancer,
                        train_s=self.now())

    def _preempt(self) -> None:
        """SIGTERM/SIGUSR1 on some rank: checkpoint, tell every worker to stop, exit 0."""
        self.preempted = True
        print("mpilb: preemption signal: checkpointing and stopping", file=sys.stderr, flush=True)
        if not self.stop.reason:
            self._checkpoint()
        self.stop.reason = self.stop.reason or "preempted"
        self._begin_stop()

    def abandon(self) -> None:
        """Set-up failed elsewhere: close the run log as failed."""
        self.log.close("failed")

    def finish(self, status: str) -> dict:
        attrs = {
            "train_s": getattr(self, "train_s", self.now()),
            "wall_s": self.now(),
            "server_cpu_s": time.process_time() - self.cpu0,
            "coverage": json.dumps(self.tracker.coverage()),
            "lost_workers": json.dumps(self.lost),
            "stop_reason": self.stop.reason,
            "rejected_gradients": self.rejected,
            "eval_s": self.evaluator.seconds,
            "stray_samples": self.tracker.stray,
        }
        self.log.close(status, attrs)
        summary = summarize_log(self.cfg.log)
        self.log.write_summary(summary)
        self.progress.close(summary)
        return summary


class WorkerFailed(Exception):
    def __init__(self, rank: int, text: str):
        super().__init__(f"rank {rank}: {text}")
        self.rank = rank
        self.text = text


def serve(server: ParameterServer) -> int:
    """Run the server; returns the exit code (0 finished, 3 degraded)."""
    try:
        status = server.run()
    except WorkerFailed as exc:
        server.train_s = server.now()
        try:
            server.finish("failed")
        finally:
            print(f"mpilb: error: {exc}", file=sys.stderr, flush=True)
            C.abort(1)
            os._exit(1)
    except BaseException:
        try:
            server.finish("failed")
        except Exception:  # noqa: BLE001 - the original error matters more
            pass
        raise
    summary = server.finish(status)
    print(format_final(summary), flush=True)
    if server.lost:
        # A lost (hung) rank never exits by itself and would keep the job alive.
        sys.stdout.flush()
        C.abort(3)
        os._exit(3)
    return 0
