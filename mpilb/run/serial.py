"""One-rank training, in process: the baseline and the debugging path.

Same model, optimizer, shards, batches, balancer plan, evaluation, checkpoints and run log as
a multi-rank job, without a server. The one "worker" is rank 0 itself.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Optional

from mpilb.runfiles import checkpoint
from mpilb.run import signals
from mpilb.backend import select_backend
from mpilb.config.sections import Config
from mpilb.errors import LogWriteError, MpilbError
from mpilb.core.batches import GradientStep, ShardFeed
from mpilb.core.inject import Injector, parse_injects
from mpilb.core.optimizers import clip_grad_norm
from mpilb.run.session import Session, files_line, format_final
from mpilb.data.shards import ShardReader
from mpilb.core.epochs import EpochStats, epoch_order


class SerialTrainer:
    """Train with one process; `run()` returns the final status.

    Its set-up is the parameter server's (:class:`~mpilb.run.session.Session`: model,
    optimizer, balancer, tracker, evaluator, stop rule, resume, run log, progress), with one
    worker, rank 0, whose parameters and optimizer state live on its device.
    """

    def __init__(self, cfg: Config, dataset, run_attrs: dict):
        self.cfg = cfg
        self.dataset = dataset
        self.backend = select_backend(cfg.network.device, 0)
        self.session = s = Session(cfg, dataset, run_attrs, [0], xp=self.backend.xp)
        self.model, self.optimizer, self.balancer = s.model, s.optimizer, s.balancer
        self.tracker, self.evaluator, self.stop = s.tracker, s.evaluator, s.stop
        self.resumed, self.log, self.progress = s.resumed, s.log, s.progress
        self.schedule = s.schedule
        self.params = self.backend.asarray(s.params)
        self.injector = Injector(parse_injects(cfg.experiment.inject, 1), 0, cfg.experiment.seed)
        inj = self.injector
        self.reader = ShardReader(dataset, seed=cfg.experiment.seed,
                                 io_delay=lambda nbytes, shard: inj.io_extra(time.monotonic(), nbytes, shard),
                                 cache_mb=cfg.inputs.cache_mb)
        self.feed = ShardFeed(self.reader, self.backend)
        self.step = GradientStep(self.model, self.backend, self.injector)
        self.version = self.resumed.version if self.resumed else 0
        self.epoch = self.resumed.epoch if self.resumed else 0
        # accumulators for the workers/ log rows and the epoch's utilization
        self.rejected = 0
        self.window_samples = 0
        self.window_compute = 0.0
        self.io_reported = 0.0
        self.epoch_busy = 0.0
        # the clocks, started by run(): train_s counts from a resumed run's own
        self.t0 = self.cpu0 = 0.0
        self.train_s: Optional[float] = None
        self.last_eval = self.last_report = self.last_checkpoint = 0.0

    @property
    def accuracy(self) -> Optional[float]:
        return self.session.accuracy

    @property
    def evaluation(self):
        return self.session.evaluation

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------ loop
    def run(self) -> str:
        self.t0 = time.monotonic() - (self.resumed.train_s if self.resumed else 0.0)
        self.cpu0 = time.process_time()
        self.last_eval = self.last_report = self.last_checkpoint = time.monotonic()
        self.injector.start(time.monotonic())
        first, counts = 0, None
        if self.resumed is not None:
            first, counts = self.resumed.epoch, self.resumed.counts
            self.tracker.completed = [EpochStats(**e) for e in self.resumed.completed]
            # restored now: a run that stops at once (fewer --epochs, --max-seconds spent)
            # must checkpoint the interrupted epoch's counts, not zeros
            self.tracker.begin(first, self.now(), counts)
        self.progress.begin(first, 0 if counts is None else int((counts > 0).sum()), self.now())
        for epoch in range(first, self.cfg.stopping.epochs):
            self._run_epoch(epoch, counts)
            counts = None
            if self.stop.reason:
                break
        self.train_s = self.now()
        self._report_window()
        if self.session.eval_version != self.version:   # every stop ends with the final metric
            self._evaluate()
        if signals.PREEMPTED.is_set():
            return "preempted"
        self._checkpoint()
        return "finished"

    def _run_epoch(self, epoch: int, counts) -> None:
        order = epoch_order(self.cfg.experiment.seed, epoch, len(self.dataset.shard_sizes))
        ranges: dict[int, list] = {}
        self.tracker.begin(epoch, self.now(), counts)
        if counts is not None:
            order, ranges = checkpoint.resume_plan(order, counts, self.tracker.offsets,
                                                   self.dataset.shard_sizes)
        self.epoch = epoch
        self.balancer.plan_epoch(epoch, order)
        self.epoch_busy = 0.0
        more = True
        while True:
            if more and not self.feed.queue:
                # hand out the next shard now, so that it is read while this one is consumed
                more = self._hand_out(epoch, ranges)
            batch = self.feed.take(self.cfg.balancing.batch)
            if batch is None:
                if more:
                    continue
                break
            self._train_step(batch)
            if self._between_steps():
                return
        if not self.tracker.complete:
            missing = self.tracker.total - self.tracker.distinct
            raise RuntimeError(f"epoch {epoch + 1}: the plan ran out with {missing} samples never handed out")
        self._end_epoch()

    def _hand_out(self, epoch: int, ranges: dict) -> bool:
        """Queue the balancer's next shard (or the ranges of it still to do); False at the end."""
        shard = self.balancer.next_shard(0)
        if shard is None:
            return False
        for lo, hi in ranges.pop(shard, [(0, self.dataset.shard_sizes[shard])]):
            self.feed.assign(epoch, shard, lo, hi)
        self.log.append("shards", t=self.now(), epoch=epoch, shard=shard, src=-1, dst=0,
                        event="assign")
        return True

    def _train_step(self, batch) -> None:
        loss, grad, compute_s = self.step(self.params, batch)
        b = batch.size
        if not (math.isfinite(loss) and bool(self.backend.xp.isfinite(grad).all())):
            # recomputing on the same parameters would give the same result: nothing to retry
            self.rejected += 1
            raise MpilbError(f"non-finite gradient for shard {batch.shard} [{batch.lo}, {batch.hi}) "
                             f"at update {self.version + 1}; {self.cfg.optim.divergence_hint()}")
        grad /= b
        clip_grad_norm(grad, self.cfg.optim.clip_norm, self.backend.xp)
        lr_scale = b / self.cfg.balancing.batch * self.schedule(self.version, self.now())
        self.optimizer.step(self.params, grad, lr_scale)
        self.version += 1
        self.tracker.record(batch.epoch, batch.shard, batch.lo, batch.hi)
        self.log.append("updates", t=self.now(), worker=0, version=self.version, staleness=0,
                        batch=b, loss=loss / b, lr_scale=lr_scale, epoch=batch.epoch,
                        shard=batch.shard, lo=batch.lo, hi=batch.hi)
        if self.session.eval_samples.add(b):   # --eval-every
            self._evaluate()
        self.window_samples += b
        self.window_compute += compute_s
        self.epoch_busy += compute_s

    def _between_steps(self) -> bool:
        """Timers between steps; True when training must stop now."""
        mono = time.monotonic()
        if signals.PREEMPTED.is_set():
            print(f"mpilb: {signals.stop_text()}: checkpointing and stopping", file=sys.stderr, flush=True)
            self._checkpoint()
            self.stop.reason = "preempted"
            return True
        if mono - self.last_report >= self.cfg.balancing.rebalance_interval:
            self._report_window()
        if mono - self.last_eval >= self.cfg.stopping.eval_interval:
            self._evaluate()
        out = self.cfg.output
        if out.checkpoint and mono - self.last_checkpoint >= out.checkpoint_interval:
            self._checkpoint()
        self.progress.update(self.epoch, self.tracker.distinct, self.version, self.accuracy)
        return self.stop.check(self.epoch, self.now(), self.evaluation) and self.stop.reason != "epochs"

    def _report_window(self) -> None:
        io_new = self.feed.io_s - self.io_reported
        self.io_reported = self.feed.io_s
        self.epoch_busy += io_new
        busy = self.window_compute + io_new
        if self.window_samples:
            self.balancer.observe(0, self.now(), self.window_samples, busy)
            self.log.append("workers", t=self.now(), worker=0, samples=self.window_samples,
                            compute_s=self.window_compute, io_s=io_new, batch=self.cfg.balancing.batch,
                            rate=self.window_samples / max(1e-9, busy),
                            predicted_rate=self.balancer.predicted_rate(0))
        self.window_samples, self.window_compute = 0, 0.0
        self.last_report = time.monotonic()

    def _end_epoch(self) -> None:
        self._report_window()
        stats = self.tracker.end(self.now())
        span = max(1e-9, stats.t_end - stats.t_start)
        self.log.append("epochs", epoch=stats.epoch, t_start=stats.t_start, t_end=stats.t_end,
                        samples=stats.samples, utilization=min(1.0, self.epoch_busy / span),
                        imbalance_s=0.0)
        self._evaluate()
        self.progress.epoch_done(stats.epoch, self.accuracy)
        self.stop.check(stats.epoch + 1, self.now(), self.evaluation)

    def _evaluate(self) -> None:
        self.session.evaluate(self.backend.to_host(self.params), self.now(), self.version,
                              self.epoch)
        self.last_eval = time.monotonic()

    def _checkpoint(self) -> None:
        self.last_checkpoint = time.monotonic()
        self.session.checkpoint(self.backend.to_host(self.params), self.version, self.epoch,
                                self.now())

    def _save_checkpoint(self) -> None:
        self.session.write_checkpoint(self.backend.to_host(self.params), self.version,
                                      self.epoch, self.now())

    def finish(self, status: str) -> dict:
        self.reader.close()
        train_s = self.train_s if self.train_s is not None else self.now()
        return self.session.finish(status, train_s=train_s,
                                   wall_s=self.now(), cpu_s=time.process_time() - self.cpu0,
                                   rejected=self.rejected)


def run_serial(trainer: SerialTrainer) -> int:
    """Train with one process. Returns the exit code."""
    status = "failed"
    try:
        try:
            status = trainer.run()
        finally:
            summary = trainer.finish(status)
    except LogWriteError as exc:
        trainer.reader.close()
        rescued = trainer.session.rescue_checkpoint(trainer._save_checkpoint)
        print(f"mpilb: error: {exc}; {rescued}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)   # HDF5 would try (and fail) to flush the log's objects again at exit
    print(format_final(summary), flush=True)
    print(files_line(trainer.cfg.output), flush=True)
    return 0
