"""One-rank training, in process: the baseline and the debugging path.

Same model, optimizer, shards, batches, balancer plan, evaluation and run log as a
multi-rank job, without a server. The one "worker" is rank 0 itself.
"""

from __future__ import annotations

import json
import time

import numpy as np

from .backend import select_backend
from .balancer import BalancerConfig, build_balancer
from .batches import GradientStep, ShardFeed
from .inject import Injector, parse_injects
from .progress import Progress
from .report import summarize_log
from .runlog import RunLog
from .shards import ShardStore
from .training import (EpochTracker, Evaluator, StopRule, config_model, config_optimizer,
                       epoch_order)


def balancer_config(cfg) -> BalancerConfig:
    return BalancerConfig(batch=cfg.batch, batch_policy=cfg.batch_policy,
                          min_batch=cfg.min_batch, max_batch=cfg.max_batch,
                          rebalance_interval=cfg.rebalance_interval)


def train_serial(cfg, dataset, run_attrs: dict) -> int:
    """Train with one process. Returns the exit code."""
    backend = select_backend(cfg.device, 0)
    xp = backend.xp
    model = config_model(cfg, dataset)
    host_params = model.init_params(cfg.seed)
    params = backend.asarray(host_params)
    optimizer = config_optimizer(cfg, model.num_params, xp=xp)
    rules = parse_injects(cfg.inject, 1)
    injector = Injector(rules, 0, cfg.seed)
    store = ShardStore(dataset, seed=cfg.seed,
                       io_delay=lambda nbytes, s: injector.io_extra(time.monotonic(), nbytes, s))
    feed = ShardFeed(store, backend)
    step = GradientStep(model, backend, injector)
    balancer = build_balancer(cfg.balancer, [0], dataset.shard_sizes, balancer_config(cfg))
    tracker = EpochTracker(dataset.shard_sizes)
    test_x, test_y = dataset.load_test()
    evaluator = Evaluator(model, test_x, test_y)
    stop = StopRule(cfg.epochs, cfg.max_seconds, cfg.target_accuracy)
    log = RunLog(cfg.log, run_attrs)
    progress = Progress(enabled=cfg.progress, total_epochs=cfg.epochs,
                        samples_per_epoch=tracker.total)
    status = "failed"
    t0 = time.monotonic()
    cpu0 = time.process_time()
    injector.start(t0)
    version = 0
    accuracy = None
    last_eval = t0
    last_report = t0
    samples_window = 0
    compute_acc = 0.0
    busy_epoch = 0.0
    io_reported = 0.0
    try:
        for epoch in range(cfg.epochs):
            now = time.monotonic()
            tracker.begin(epoch, now - t0)
            balancer.plan_epoch(epoch, epoch_order(cfg.seed, epoch, len(dataset.shard_sizes)))
            while True:
                shard = balancer.next_shard(0)
                if shard is None:
                    break
                feed.assign(epoch, shard)
                log.append("shards", t=time.monotonic() - t0, epoch=epoch, shard=shard, src=-1,
                           dst=0, event="assign")
                while True:
                    batch = feed.take(cfg.batch)
                    if batch is None:
                        break
                    loss, grad, compute_s = step(params, batch)
                    b = batch.size
                    grad /= b
                    optimizer.step(params, grad, lr_scale=b / cfg.batch)
                    version += 1
                    tracker.record(batch.epoch, batch.shard, batch.lo, batch.hi)
                    now = time.monotonic()
                    log.append("updates", t=now - t0, worker=0, version=version, staleness=0,
                               batch=b, loss=loss / b, lr_scale=b / cfg.batch, epoch=epoch,
                               shard=batch.shard)
                    samples_window += b
                    compute_acc += compute_s
                    busy_epoch += compute_s
                    if now - last_report >= cfg.rebalance_interval:
                        io_new = feed.io_s - io_reported
                        io_reported = feed.io_s
                        busy_epoch += io_new
                        rate = samples_window / max(1e-9, compute_acc + io_new)
                        balancer.observe(0, now - t0, samples_window, compute_acc + io_new)
                        log.append("workers", t=now - t0, worker=0, samples=samples_window,
                                   compute_s=compute_acc, io_s=io_new, batch=cfg.batch,
                                   rate=rate, predicted_rate=balancer.predicted_rate(0))
                        samples_window, compute_acc, last_report = 0, 0.0, now
                    if now - last_eval >= cfg.eval_interval:
                        accuracy = _evaluate(log, evaluator, backend, params, version, epoch, now - t0)
                        last_eval = time.monotonic()
                        if stop.check(epoch, now - t0, accuracy):
                            break
                    if cfg.max_seconds is not None and now - t0 >= cfg.max_seconds:
                        stop.check(epoch, now - t0, accuracy)
                        break
                    progress.update(epoch, tracker.distinct, version, accuracy)
                if stop.reason:
                    break
            if stop.reason:
                break
            now = time.monotonic()
            io_new = feed.io_s - io_reported
            busy_epoch += io_new
            io_reported = feed.io_s
            stats = tracker.end(now - t0)
            span = max(1e-9, stats.t_end - stats.t_start)
            log.append("epochs", epoch=epoch, t_start=stats.t_start, t_end=stats.t_end,
                       samples=stats.samples, utilization=min(1.0, busy_epoch / span),
                       imbalance_s=0.0)
            busy_epoch = 0.0
            accuracy = _evaluate(log, evaluator, backend, params, version, epoch, now - t0)
            last_eval = time.monotonic()
            progress.epoch_done(epoch, accuracy)
            if stop.check(epoch + 1, now - t0, accuracy):
                break
        if samples_window:
            now = time.monotonic()
            log.append("workers", t=now - t0, worker=0, samples=samples_window,
                       compute_s=compute_acc, io_s=feed.io_s - io_reported, batch=cfg.batch,
                       rate=samples_window / max(1e-9, compute_acc),
                       predicted_rate=balancer.predicted_rate(0))
        status = "finished"
    finally:
        progress.close()
        store.close()
        wall = time.monotonic() - t0
        log.close(status, {"train_s": wall, "wall_s": wall,
                           "server_cpu_s": time.process_time() - cpu0,
                           "coverage": json.dumps(tracker.coverage()), "lost_workers": "[]",
                           "stop_reason": stop.reason})
        summary = summarize_log(cfg.log)
        log.write_summary(summary)
    print(format_final(summary), flush=True)
    return 0


def _evaluate(log, evaluator, backend, params, version, epoch, t):
    host = backend.to_host(params)
    loss, acc = evaluator(host)
    log.append("eval", t=t, version=version, epoch=epoch, test_loss=loss, test_accuracy=acc)
    return acc


def format_final(summary: dict) -> str:
    acc = summary.get("final_test_accuracy")
    acc_txt = "n/a" if acc is None else f"{acc:.4f}"
    cov = summary["coverage"]
    return (f"mpilb: {summary['status']}: {summary['epochs_completed']} epoch(s), "
            f"{summary['samples']} samples in {summary['train_s']:.1f} s "
            f"({summary['samples_per_s']:.0f} samples/s), test accuracy {acc_txt}, "
            f"coverage {cov['applied']}/{cov['expected']} "
            f"(duplicates {cov['duplicates']}, missing {cov['missing']})")
