"""What a training run holds whoever drives it: the serial trainer and the parameter server.

The model, its optimizer, the balancer, the epoch tracker, the evaluator, the stop rule, the
checkpoint it resumes from, the run log and the progress line are set up the same way on one
rank or on rank 0 of many; this module does it once, so neither driver imports the other.
"""

from __future__ import annotations

import json
import os
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np

from mpilb.runfiles import checkpoint
from mpilb.config.sections import Config, OutputConfig
from mpilb.runfiles.best import BestCheckpoint, best_line
from mpilb.core.balancer import BalancerConfig, build_balancer
from mpilb.core.decisions import SampleInterval
from mpilb.run.evalproc import NICE, EvalProcess, EvalProcessGone, lower_priority
from mpilb.models import initial_params
from mpilb.run.progress import Progress, tapped
from mpilb.runfiles.summary import summarize_log
from mpilb.runfiles.runlog import RunLog
from mpilb.core.schedules import build_schedule
from mpilb.runfiles.tensorboard import tap_for
from mpilb.core.epochs import EpochTracker
from mpilb.core.stop import build_stop_rule
from mpilb.run.evaluation import Evaluation, build_evaluator
from mpilb.run.components import config_model, config_optimizer

# background evaluations waiting their turn behind the one running (Session.evaluate_later):
# at most this many, and this many bytes of parameter copies unless there is just one
QUEUED_MAX = 8
QUEUED_BYTES = 512 * 2**20


def balancer_config(cfg: Config) -> BalancerConfig:
    """The balancer's settings: ``cfg.balancing``, with sit-outs only for sync rounds."""
    return BalancerConfig.of_run(cfg.balancing, cfg.updates.mode)


def format_final(summary: dict) -> str:
    """The last line of a run."""
    acc = summary.get("final_test_accuracy")
    metric, value = summary.get("metric", "accuracy"), summary.get("final_test_metric")
    if acc is None and value is not None:
        acc_txt = f"n/a, test {metric} {value:.4f}"
    else:
        acc_txt = "n/a" if acc is None else f"{acc:.4f}"
    cov = summary["coverage"]
    return (f"mpilb: {summary['status']}: {summary['epochs_completed']} epoch(s), "
            f"{summary['samples']} samples in {summary['train_s']:.1f} s "
            f"({summary['samples_per_s']:.0f} samples/s), test accuracy {acc_txt}, "
            f"coverage {cov['applied']}/{cov['expected']} "
            f"(duplicates {cov['duplicates']}, missing {cov['missing']})")


def files_line(output: OutputConfig) -> str:
    """The very last line(s) of a run: where its log and its final parameters are (and,
    with --save-best, the best evaluation's)."""
    best = best_line(output)
    return f"mpilb: log {output.log}, checkpoint {output.checkpoint}" + (f"\n{best}" if best else "")


class Session:
    """The shared state of one run, built from its config.

    Args:
        cfg: the run's Config (each part is handed its section).
        dataset: the opened dataset.
        run_attrs: root attributes of the run log.
        ranks: the workers the balancer plans for.
        holders: shard -> ranks holding a copy (--store local), or None.
        xp: array module of the optimizer state (numpy, or cupy for a serial GPU run).
    """

    def __init__(self, cfg: Config, dataset, run_attrs: dict, ranks: list[int],
                 holders: Optional[dict] = None, xp=np):
        self.cfg = cfg
        self.dataset = dataset
        out, seed = cfg.output, cfg.experiment.seed
        self.model = config_model(cfg, dataset)
        self.params = initial_params(self.model, seed, cfg.network.model)
        self.optimizer = config_optimizer(cfg.optim, self.model.num_params, xp=xp)
        self.balancer = build_balancer(cfg.balancing.balancer, ranks, dataset.shard_sizes,
                                       balancer_config(cfg), holders)
        self.tracker = EpochTracker(dataset.shard_sizes)
        self.evaluator = build_evaluator(self.model, dataset)
        self.stop = build_stop_rule(cfg.stopping)
        # the factor on --lr at each update (--lr-schedule, --warmup): schedules.py
        self.schedule = build_schedule(cfg, dataset.shard_sizes, len(ranks))
        self.resumed: Optional[checkpoint.Checkpoint] = None
        self.correction = None   # rank 0's staleness correction, checkpointed (keep_correction)
        if out.resume:
            self.resumed = checkpoint.load(out.checkpoint, self.model, dataset, seed=seed,
                                           validation_fraction=cfg.inputs.validation_fraction)
            self.params[:] = self.resumed.params
            self.optimizer.load_state_dict(self.resumed.optimizer)
            checkpoint.restore_balancer(self.balancer, self.resumed.balancer)
        self.progress = Progress(enabled=out.progress, total_epochs=cfg.stopping.epochs,
                                 samples_per_epoch=self.tracker.total,
                                 interval=out.progress_interval,
                                 max_seconds=cfg.stopping.max_seconds, metric=self.model.metric)
        # the progress display and --tensorboard see every row of the run log
        self.log = tapped(RunLog(out.log, dict(run_attrs, metric=self.model.metric),
                                resume_at=self.resumed.train_s if self.resumed else None,
                                checkpoint=out.checkpoint,
                                completed=self.resumed.completed if self.resumed else None),
                         self.progress, tap_for(out))
        self.accuracy: Optional[float] = None   # the headline metric, for the progress line
        self.evaluation: Optional[Evaluation] = None   # what --target-* decide on
        self.eval_version = -1   # parameter version of the last evaluation
        # --eval-every: counted over the run (a resumed one's from its log)
        self.eval_samples = SampleInterval(cfg.stopping.eval_every, self.log.carried_samples)
        self._eval_pool: Optional[ThreadPoolExecutor] = None
        self._eval_proc: Optional[EvalProcess] = None
        self._pending = None     # an evaluation running in the background (evaluate_later)
        # the next ones, waiting their turn: (a copy of the parameters, t, version, epoch, then)
        self._queued: deque = deque()
        self.best = BestCheckpoint(out) if out.save_best else None

    def start_background_evaluation(self, ranks_here: int) -> None:
        """Start the process that :meth:`evaluate_later` hands its evaluations to (rank 0
        of a job; see evalproc.py) when this node has a core to spare for it: more CPUs
        for this rank than the job has ranks here (``MPILB_EVAL_PROCESS=1`` or ``0``: always,
        never). Otherwise they run on a thread, which costs no process start-up (~1 s of
        CPU) on a node whose cores the ranks already share."""
        if self.model.num_state:
            return   # (statistics the pushes update are evaluated where they are)
        choice = os.environ.get("MPILB_EVAL_PROCESS", "auto")
        cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                else os.cpu_count() or 1)
        if choice == "0" or (choice != "1" and cpus <= ranks_here):
            return
        try:
            self._eval_proc = EvalProcess(self.cfg, self.dataset, self.model.num_params)
        except OSError as exc:
            print(f"mpilb: warning: no evaluation process ({exc}); evaluating on a thread",
                  file=sys.stderr, flush=True)

    def evaluate(self, params: np.ndarray, t: float, version: int, epoch: int) -> None:
        """Evaluate host parameters on the test (and validation) set and log the row."""
        self.collect(wait=True)   # rows in order
        self._record(self.evaluator.evaluate(params), t, version, epoch, params)

    def evaluate_later(self, params: np.ndarray, t: float, version: int, epoch: int,
                       then: Optional[Callable[[], None]] = None) -> None:
        """Evaluate `params` in the background while rank 0 goes on serving pushes: in the
        evaluation process (:meth:`start_background_evaluation`), else a copy on a thread;
        :meth:`collect` logs the row and calls `then`. Only for models without state the
        server updates (BatchNorm statistics).

        One evaluation runs at a time. While one runs, the next ones wait their turn as
        copies (at most QUEUED_MAX of them, and QUEUED_BYTES of copies unless there is just
        one), each started when :meth:`collect` logs the one before (rows stay in order);
        only when the queue is full does rank 0 wait here, until it is empty. Rank 0 used
        to wait here for the one running: a run's first evaluations also wait for the
        evaluation process to start (its imports, the model and the test set; with torch,
        1-2 s on the 2-core VM with the ranks running), and the epochs' ends held every
        worker's reply that long (685 ms once in a 4-second run)."""
        self.collect()
        if self._pending is not None:
            waiting = sum(q[0].nbytes for q in self._queued)
            fits = not self._queued or waiting + params.nbytes <= QUEUED_BYTES
            if len(self._queued) < QUEUED_MAX and fits:
                self._queued.append((np.array(params, copy=True), t, version, epoch, then))
                return
            self.collect(wait=True)
        self._submit(params, t, version, epoch, then)

    def _submit(self, params: np.ndarray, t: float, version: int, epoch: int,
                then: Optional[Callable[[], None]], own: bool = False) -> None:
        """Start the evaluation of `params` (`own`: a copy of this session's, nobody else
        writes it)."""
        kept = None if self.best is None else (params if own else np.array(params, copy=True))
        job = None
        if self._eval_proc is not None:
            try:
                self._eval_proc.submit(params)
                job = self._eval_proc
            except OSError as exc:   # it died while idle: its pipe is closed
                print(f"mpilb: warning: the evaluation process ended ({exc}); rank 0 "
                      f"evaluates from now on", file=sys.stderr, flush=True)
                self._eval_proc.close()
                self._eval_proc = None
        if job is None:
            if self._eval_pool is None:
                # at the evaluation process's lower priority: on a node whose cores the
                # ranks share, the workers' steps come first (docs/architecture.md)
                self._eval_pool = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="mpilb-eval", initializer=lower_priority,
                    initargs=(os.environ.get("MPILB_EVAL_NICE", str(NICE)), True))
            job = self._eval_pool.submit(self._timed, params if own else np.array(params, copy=True))
        self._pending = (job, t, version, epoch, then, kept)

    @property
    def evaluating(self) -> bool:
        """Whether a background evaluation (:meth:`evaluate_later`) is not logged yet."""
        return self._pending is not None

    def _timed(self, params: np.ndarray):
        before = self.evaluator.seconds
        ev = self.evaluator.evaluate(params)
        return ev, self.evaluator.seconds - before

    def collect(self, wait: bool = False) -> bool:
        """Log the background evaluations that have finished, starting each one waiting
        its turn (`wait`: wait for all of them); an evaluation's error is raised here."""
        logged = False
        while self._pending is not None and (wait or self._pending[0].done()):
            self._collect_one()
            logged = True
            if self._queued:
                self._submit(*self._queued.popleft(), own=True)
        return logged

    def _collect_one(self) -> None:
        job, t, version, epoch, then, kept = self._pending
        self._pending = None
        try:
            ev, seconds = job.result()
        except EvalProcessGone as exc:
            print(f"mpilb: warning: {exc}; rank 0 evaluates from now on", file=sys.stderr,
                  flush=True)
            self._eval_proc = None
            ev, seconds = self._timed(job.submitted())
        else:
            if job is self._eval_proc:
                self.evaluator.seconds += seconds   # (a thread counted its own)
        self._record(ev, t, version, epoch, kept)
        if then is not None:
            then()

    def _record(self, ev: Evaluation, t: float, version: int, epoch: int, params=None) -> None:
        self.evaluation, self.accuracy = ev, ev.decides[1]
        self.eval_version = version
        self.log.append("eval", t=t, version=version, epoch=epoch, **ev.columns())
        if self.best is not None and params is not None:
            def save(path, evaluated, best):
                self.write_checkpoint(evaluated, version, epoch, t, path=path, best=best)

            self.best.offer(ev, params, epoch, version, save)

    # ----------------------------------------------------------------- checkpoints
    def keep_correction(self, correction) -> None:
        """Rank 0's staleness correction: its checkpoints keep what it measured, and a
        resume goes on from what the checkpoint's measured."""
        self.correction = correction
        checkpoint.restore_correction(correction, self.resumed)

    def write_checkpoint(self, params: np.ndarray, version: int, epoch: int, train_s: float,
                         path: Optional[str] = None, best: Optional[dict] = None) -> None:
        """The one checkpoint writer of a run (serial or rank 0): `params` (host memory) at
        `version` with this run's optimizer, epoch counts and balancer, into `path`
        (default --checkpoint); `best`: the evaluation a --save-best checkpoint holds."""
        checkpoint.save(path or self.cfg.output.checkpoint, cfg=self.cfg, model=self.model,
                        dataset=self.dataset, params=params, optimizer=self.optimizer,
                        version=version, epoch=epoch, tracker=self.tracker,
                        balancer=self.balancer, train_s=train_s, run_id=self.log.run_id,
                        best=best, correction=self.correction)

    def checkpoint(self, params: np.ndarray, version: int, epoch: int, train_s: float) -> None:
        """The run's checkpoint (nothing with --checkpoint off), the run log flushed first:
        the log holds everything up to the checkpoint, so a resume continues it."""
        if not self.cfg.output.checkpoint:
            return
        self.log.flush()
        self.write_checkpoint(params, version, epoch, train_s)

    def rescue_checkpoint(self, save: Callable[[], None]) -> str:
        """The run log cannot be written: the weights go into the checkpoint all the same
        (its disk may have room). Returns what the run's last line says of it."""
        return checkpoint.rescue(self.cfg.output.checkpoint, save)

    # ----------------------------------------------------------------- end
    def finish(self, status: str, *, train_s: float, wall_s: float, cpu_s: float,
               lost: tuple = (), rejected: int = 0, **extra) -> dict:
        """End the run: the summary attributes every driver writes (docs/logs.md), plus the
        driver's own `extra` ones, then :meth:`close`. Returns the summary."""
        attrs = {"train_s": train_s, "wall_s": wall_s, "server_cpu_s": cpu_s,
                 "coverage": json.dumps(self.tracker.coverage()),
                 "lost_workers": json.dumps(list(lost)), "stop_reason": self.stop.reason,
                 "rejected_gradients": rejected, "eval_s": self.evaluator.seconds, **extra}
        return self.close(status, attrs)

    def close(self, status: str, attrs: dict) -> dict:
        """Close the run log, write the summary, end the progress display on its figures."""
        if self._pending is not None:
            if self._pending[0] is not self._eval_proc:
                self._pending[0].cancel()   # (a run that failed meanwhile: not waited for)
            self._pending = None
        if self._eval_pool is not None:
            self._eval_pool.shutdown(wait=False)
        if self._eval_proc is not None:
            self._eval_proc.close()
            self._eval_proc = None
        self.log.close(status, attrs)
        summary = summarize_log(self.cfg.output.log)
        self.log.write_summary(summary)
        self.progress.close(summary)
        return summary
