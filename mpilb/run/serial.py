"""One-rank training, in process: the baseline and the debugging path.

Same model, optimizer, shards, batches, balancer plan, evaluation, checkpoints and run log as
a multi-rank job, without a server. The one "worker" is rank 0 itself.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Optional

from mpilb.runfiles import checkpoint
from mpilb.run import signals
from mpilb.backend import select_backend
from mpilb.core.balancer import build_balancer
from mpilb.errors import LogWriteError, MpilbError
from mpilb.core.batches import GradientStep, ShardFeed
from mpilb.core.inject import Injector, parse_injects
from mpilb.models import initial_params
from mpilb.run.progress import Progress, tapped
from mpilb.runfiles.summary import summarize_log
from mpilb.runfiles.runlog import RunLog
from mpilb.runfiles.best import BestCheckpoint
from mpilb.core.optimizers import clip_grad_norm
from mpilb.run.session import balancer_config, files_line, format_final
from mpilb.data.shards import ShardReader
from mpilb.core.schedules import build_schedule
from mpilb.runfiles.tensorboard import tap_for
from mpilb.run.training import PREEMPTED, EpochStats, EpochTracker, build_evaluator, build_stop_rule, config_model, config_optimizer, epoch_order


class SerialTrainer:
    """Train with one process; `run()` returns the final status."""

    def __init__(self, cfg, dataset, run_attrs: dict):
        self.cfg = cfg
        self.dataset = dataset
        self.backend = select_backend(cfg.device, 0)
        self.model = config_model(cfg, dataset)
        host_params = initial_params(self.model, cfg.seed, cfg.model)
        self.optimizer = config_optimizer(cfg, self.model.num_params, xp=self.backend.xp)
        self.balancer = build_balancer(cfg.balancer, [0], dataset.shard_sizes, balancer_config(cfg))
        self.tracker = EpochTracker(dataset.shard_sizes)
        self.resumed: Optional[checkpoint.Checkpoint] = None
        if cfg.resume:
            self.resumed = checkpoint.load(cfg.checkpoint, self.model, dataset, seed=cfg.seed,
                                           validation_fraction=cfg.validation_fraction)
            host_params = self.resumed.params
            self.optimizer.load_state_dict(self.resumed.optimizer)
            checkpoint.restore_balancer(self.balancer, self.resumed.balancer)
        self.params = self.backend.asarray(host_params)
        self.injector = Injector(parse_injects(cfg.inject, 1), 0, cfg.seed)
        inj = self.injector
        self.store = ShardReader(dataset, seed=cfg.seed,
                                 io_delay=lambda nbytes, s: inj.io_extra(time.monotonic(), nbytes, s),
                                 cache_mb=cfg.cache_mb)
        self.feed = ShardFeed(self.store, self.backend)
        self.step = GradientStep(self.model, self.backend, self.injector)
        self.evaluator = build_evaluator(self.model, dataset)
        self.stop = build_stop_rule(cfg)
        self.schedule = build_schedule(cfg, dataset.shard_sizes)
        self.evaluation = None
        self.best = BestCheckpoint(cfg) if cfg.save_best else None
        self.progress = Progress(enabled=cfg.progress, total_epochs=cfg.epochs,
                                 samples_per_epoch=self.tracker.total,
                                 interval=cfg.progress_interval, max_seconds=cfg.max_seconds,
                                 metric=self.model.metric)
        # the progress display and --tensorboard see every row of the run log
        self.log = tapped(RunLog(cfg.log, dict(run_attrs, metric=self.model.metric),
                                resume_at=self.resumed.train_s if self.resumed else None,
                                checkpoint=cfg.checkpoint,
                                completed=self.resumed.completed if self.resumed else None),
                         self.progress, tap_for(cfg))
        self.eval_version = -1
        self.version = self.resumed.version if self.resumed else 0
        self.epoch = self.resumed.epoch if self.resumed else 0
        self.accuracy: Optional[float] = None
        # accumulators for the workers/ log rows and the epoch's utilization
        self.rejected = 0
        self.window_samples = 0
        self.window_compute = 0.0
        self.io_reported = 0.0
        self.epoch_busy = 0.0

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
        for epoch in range(first, self.cfg.epochs):
            self._run_epoch(epoch, counts)
            counts = None
            if self.stop.reason:
                break
        self.train_s = self.now()
        self._report_window()
        if self.eval_version != self.version:   # every stop ends with the final metric
            self._evaluate()
        if PREEMPTED.is_set():
            return "preempted"
        self._checkpoint()
        return "finished"

    def _run_epoch(self, epoch: int, counts) -> None:
        order = epoch_order(self.cfg.seed, epoch, len(self.dataset.shard_sizes))
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
            batch = self.feed.take(self.cfg.batch)
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
                             f"at update {self.version + 1}; lower --lr?")
        grad /= b
        clip_grad_norm(grad, self.cfg.clip_norm, self.backend.xp)
        lr_scale = b / self.cfg.batch * self.schedule(self.version, self.now())
        self.optimizer.step(self.params, grad, lr_scale)
        self.version += 1
        self.tracker.record(batch.epoch, batch.shard, batch.lo, batch.hi)
        self.log.append("updates", t=self.now(), worker=0, version=self.version, staleness=0,
                        batch=b, loss=loss / b, lr_scale=lr_scale, epoch=batch.epoch,
                        shard=batch.shard, lo=batch.lo, hi=batch.hi)
        self.window_samples += b
        self.window_compute += compute_s
        self.epoch_busy += compute_s

    def _between_steps(self) -> bool:
        """Timers between steps; True when training must stop now."""
        mono = time.monotonic()
        if PREEMPTED.is_set():
            print(f"mpilb: {signals.stop_text()}: checkpointing and stopping", file=sys.stderr, flush=True)
            self._checkpoint()
            self.stop.reason = "preempted"
            return True
        if mono - self.last_report >= self.cfg.rebalance_interval:
            self._report_window()
        if mono - self.last_eval >= self.cfg.eval_interval:
            self._evaluate()
        if self.cfg.checkpoint and mono - self.last_checkpoint >= self.cfg.checkpoint_interval:
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
                            compute_s=self.window_compute, io_s=io_new, batch=self.cfg.batch,
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
        params = self.backend.to_host(self.params)
        ev = self.evaluator.evaluate(params)
        self.evaluation, self.accuracy = ev, ev.decides[1]
        self.log.append("eval", t=self.now(), version=self.version, epoch=self.epoch,
                        **ev.columns())
        if self.best is not None:
            self.best.offer(ev, params, self.epoch, self.version, self._save_best)
        self.last_eval = time.monotonic()
        self.eval_version = self.version

    def _checkpoint(self) -> None:
        self.last_checkpoint = time.monotonic()
        if not self.cfg.checkpoint:
            return
        self.log.flush()
        self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        checkpoint.save(self.cfg.checkpoint, cfg=self.cfg, model=self.model, dataset=self.dataset,
                        params=self.backend.to_host(self.params), optimizer=self.optimizer,
                        version=self.version, epoch=self.epoch, tracker=self.tracker,
                        balancer=self.balancer, train_s=self.now(), run_id=self.log.run_id)

    def _save_best(self, path: str, params, best: dict) -> None:
        checkpoint.save(path, cfg=self.cfg, model=self.model, dataset=self.dataset,
                        params=params, optimizer=self.optimizer, version=self.version,
                        epoch=self.epoch, tracker=self.tracker, balancer=self.balancer,
                        train_s=self.now(), run_id=self.log.run_id, best=best)

    def finish(self, status: str) -> dict:
        self.store.close()
        self.log.close(status, {"train_s": getattr(self, "train_s", self.now()),
                                "wall_s": self.now(),
                                "server_cpu_s": time.process_time() - self.cpu0,
                                "coverage": json.dumps(self.tracker.coverage()),
                                "lost_workers": "[]", "stop_reason": self.stop.reason,
                                "rejected_gradients": self.rejected,
                                "eval_s": self.evaluator.seconds})
        summary = summarize_log(self.cfg.log)
        self.log.write_summary(summary)
        self.progress.close(summary)
        return summary


def run_serial(trainer: SerialTrainer) -> int:
    """Train with one process. Returns the exit code."""
    status = "failed"
    try:
        try:
            status = trainer.run()
        finally:
            summary = trainer.finish(status)
    except LogWriteError as exc:
        trainer.store.close()
        rescued = checkpoint.rescue(trainer.cfg.checkpoint, trainer._save_checkpoint)
        print(f"mpilb: error: {exc}; {rescued}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)   # HDF5 would try (and fail) to flush the log's objects again at exit
    print(format_final(summary), flush=True)
    print(files_line(trainer.cfg), flush=True)
    return 0
