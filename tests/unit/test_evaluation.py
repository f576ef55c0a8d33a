"""Evaluation (mpilb.run.evaluation), stop rules (mpilb.core.stop) and validation hold-out (mpilb.run.components): pure, no MPI."""

import math
from collections import deque

import os
import sys

import numpy as np
import pytest

from mpilb.config.build import build_config
from mpilb.errors import UsageError
from mpilb.models import build_model
from mpilb.run.evalproc import NICE
from mpilb.run.evaluation import Evaluation, build_evaluator
from mpilb.core.stop import StopRule, build_stop_rule
from mpilb.run.components import hold_out_validation


def test_stop_rule_target_metric_uses_validation_when_held_out():
    rule = build_stop_rule(build_config({}, {"target_metric": 0.5, "epochs": 9}).stopping)
    test_only = Evaluation(loss=1.0, accuracy=math.nan, metric=0.6, metric_name="r2")
    assert rule.check(1, 1.0, test_only) and rule.reason == "target_metric"
    rule = build_stop_rule(build_config({}, {"target_metric": 0.5, "epochs": 9}).stopping)
    held_out = Evaluation(1.0, math.nan, 0.6, "r2", val_metric=0.4, val_accuracy=math.nan)
    assert not rule.check(1, 1.0, held_out)          # the test set does not decide
    assert StopRule(9, None, 0.9).check(1, 1.0, 0.95)  # a plain accuracy still works
    assert held_out.columns() == {"test_loss": 1.0, "test_accuracy": held_out.accuracy,
                                  "test_metric": 0.6, "val_metric": 0.4}


def test_validation_holds_out_whole_shards_and_the_evaluator_reads_them(small_dataset):
    cfg = build_config({}, {"validation_fraction": 0.3})
    ds = hold_out_validation(cfg.inputs, small_dataset)
    assert len(ds.shards) == 3 and [s.file for s in ds.validation] == ["shard-00003.h5"]
    assert ds.total_samples == 1200 and small_dataset.total_samples == 1600
    model = build_model("softmax", ds.sample_shape, ds.num_classes)
    ev = build_evaluator(model, ds).evaluate(model.init_params(0))
    assert ev.metric_name == "accuracy" and 0 <= ev.val_metric <= 1 and ev.val_metric == ev.val_accuracy
    with pytest.raises(UsageError, match="leaves no shard to train on"):
        hold_out_validation(build_config({}, {"validation_fraction": 0.9}).inputs, small_dataset)
    assert hold_out_validation(build_config({}, {}).inputs, small_dataset) is small_dataset


def test_evaluator_requires_the_models_metric(small_dataset):
    class Broken:
        metric = "r2"

        def evaluate(self, params, x, y):
            return {"loss": 1.0}

    from mpilb.errors import MpilbError
    from mpilb.run.evaluation import Evaluator

    with pytest.raises(MpilbError, match="must return 'loss' and its metric 'r2'"):
        Evaluator(Broken(), np.zeros((2, 3)), np.zeros(2)).evaluate(np.zeros(3))


def test_an_evaluation_in_the_background_is_logged_in_order_by_collect(monkeypatch):
    monkeypatch.delenv("MPILB_EVAL_NICE", raising=False)
    """Rank 0 evaluates an epoch's end on a thread while it serves pushes (session.py)."""
    import threading

    from mpilb.run.session import Session

    release = threading.Event()
    seen, nice = [], []

    class SlowEvaluator:
        seconds = 0.0

        def evaluate(self, params):
            release.wait(10.0)
            seen.append(params.copy())
            nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return Evaluation(loss=1.0, accuracy=float(params[0]), metric=float(params[0]),
                              metric_name="accuracy")

    class Log:
        rows = []

        def append(self, group, **row):
            self.rows.append((group, row))

    s = Session.__new__(Session)
    s.evaluator, s.log, s._eval_pool, s._pending, s._queued = SlowEvaluator(), Log(), None, None, deque()
    s._eval_proc = None   # (the thread: where the evaluation process could not start)
    s.accuracy, s.evaluation, s.eval_version, s.best = None, None, -1, None
    params = np.array([0.5, 0.0], dtype=np.float32)
    done = []
    s.evaluate_later(params, t=1.0, version=7, epoch=0, then=lambda: done.append(s.accuracy))
    params[0] = 0.9                       # the server steps on: the evaluation has its copy
    assert not s.collect() and s.eval_version == -1 and not Log.rows
    release.set()
    assert s.collect(wait=True)
    assert seen[0][0] == np.float32(0.5) and s.accuracy == 0.5 and s.eval_version == 7
    if sys.platform.startswith("linux"):   # its thread runs at the evaluations' lower priority
        main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert nice == [min(19, main + NICE)] and os.getpriority(os.PRIO_PROCESS, 0) == main
    assert done == [0.5]
    s.evaluate(params, t=2.0, version=8, epoch=1)   # a synchronous one after it
    assert [(g, r["epoch"], r["version"]) for g, r in Log.rows] == [("eval", 0, 7), ("eval", 1, 8)]
    assert not s.collect()


def test_the_evaluation_process_matches_rank_0_and_reports_its_errors(digits_dir):
    """Evaluations beside the pushes run in a process of their own (evalproc.py): the same
    figures as on rank 0, the launcher's variables kept from it, errors raised here."""
    from mpilb.config.build import build_config
    from mpilb.data.dataset import open_dataset
    from mpilb.errors import MpilbError
    from mpilb.run.evalproc import EvalProcess, child_env
    from mpilb.run.evaluation import build_evaluator
    from mpilb.run.components import config_model

    cfg = build_config(cli_values={"data": digits_dir, "model": "mlp", "hidden": "16"})
    ds = open_dataset(digits_dir)
    model = config_model(cfg, ds)
    params = model.init_params(cfg.experiment.seed)
    here = build_evaluator(model, ds).evaluate(params)
    env = child_env({"PMI_RANK": "0", "PMI_FD": "7", "OMPI_COMM_WORLD_RANK": "0",
                     "SLURM_PROCID": "0", "OMP_NUM_THREADS": "1", "PATH": "/bin"})
    assert env == {"OMP_NUM_THREADS": "1", "PATH": "/bin"}   # nothing by which it joins the job
    for size in (model.num_params, 0):   # through shared memory (Linux), through the pipe
        proc = EvalProcess(cfg, ds, size)
        assert (proc.shared is not None) == (size > 0 and hasattr(os, "memfd_create"))
        try:
            proc.submit(params)
            ev, seconds = proc.result()
            assert (ev.loss, ev.accuracy) == pytest.approx((here.loss, here.accuracy), rel=1e-6)
            assert seconds > 0 and not proc.busy
            np.testing.assert_array_equal(proc.submitted(), params)
            proc.submit(params[:-1])   # a vector of the wrong length: its error comes back
            with pytest.raises(MpilbError, match="evaluation failed in its process"):
                proc.result()
            proc.submit(params * 0)    # and the process serves on
            assert proc.result()[0].loss == pytest.approx(np.log(10), rel=1e-3)
            # it yields the cores to the ranks (their training first) where they contend
            assert os.getpriority(os.PRIO_PROCESS, proc.proc.pid) == min(19, os.nice(0) + 10)
        finally:
            proc.close()
        assert proc.proc.returncode == 0


@pytest.mark.parametrize("cpus, ranks_here, setting, expect", [
    (16, 4, None, "process"),   # a core to spare on rank 0's node
    (2, 4, None, "thread"),     # ranks already share the cores: no extra process
    (2, 4, "1", "process"),
    (16, 4, "0", "thread"),
])
def test_evaluations_get_a_process_where_rank_0_has_a_core_to_spare(
        monkeypatch, cpus, ranks_here, setting, expect):
    from mpilb.run import session as S

    started = []
    monkeypatch.setattr(S, "EvalProcess", lambda cfg, ds, n: started.append(cfg) or "proc")
    monkeypatch.setattr(S.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    if setting is None:
        monkeypatch.delenv("MPILB_EVAL_PROCESS", raising=False)
    else:
        monkeypatch.setenv("MPILB_EVAL_PROCESS", setting)
    s = S.Session.__new__(S.Session)
    s.cfg, s.dataset, s._eval_proc = "cfg", "ds", None
    s.model = type("M", (), {"num_state": 0, "num_params": 10})()
    s.start_background_evaluation(ranks_here)
    assert ("process" if s._eval_proc == "proc" else "thread") == expect
    s.model.num_state = 3           # BatchNorm statistics: evaluated where they are, always
    s._eval_proc = None
    monkeypatch.setenv("MPILB_EVAL_PROCESS", "1")
    s.start_background_evaluation(ranks_here)
    assert s._eval_proc is None


def test_an_evaluation_asked_for_while_one_runs_waits_its_turn_without_holding_rank_0(monkeypatch):
    """The next epochs' evaluations, asked for while the last still runs (the evaluation
    process still starting, or a slow test set), are kept as copies and started in turn as
    each is logged: rank 0 goes on serving. Only when the queue is full does it wait."""
    import threading
    import time

    from mpilb.run import session as S
    from mpilb.run.session import Session

    gates = {v: threading.Event() for v in (1, 2, 3, 4, 5)}
    started = []

    class GatedEvaluator:
        seconds = 0.0

        def evaluate(self, params):
            v = int(params[0])
            started.append(v)
            assert gates[v].wait(10.0)
            return Evaluation(loss=1.0, accuracy=v / 10, metric=v / 10, metric_name="accuracy")

    class Log:
        rows = []

        def append(self, group, **row):
            self.rows.append(row["version"])

    s = Session.__new__(Session)
    s.evaluator, s.log, s._eval_pool, s._pending, s._queued = GatedEvaluator(), Log(), None, None, deque()
    s._eval_proc = None
    s.accuracy, s.evaluation, s.eval_version, s.best = None, None, -1, None
    params = np.array([1.0], dtype=np.float32)
    done = []
    s.evaluate_later(params, t=1.0, version=1, epoch=0, then=lambda: done.append(1))
    params[0] = 2.0
    t0 = time.monotonic()
    s.evaluate_later(params, t=2.0, version=2, epoch=1, then=lambda: done.append(2))
    assert time.monotonic() - t0 < 1.0 and s.evaluating   # no wait for the first
    params[0] = 9.0                          # the server steps on: the second has its copy
    gates[1].set()
    deadline = time.monotonic() + 10.0
    while not s.collect() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert Log.rows == [1] and done == [1] and s.evaluating   # the second started
    gates[2].set()
    assert s.collect(wait=True) and Log.rows == [1, 2] and done == [1, 2]
    assert started == [1, 2] and not s.evaluating and not s.collect()
    # a full queue (here 1 waiting): the next waits for the running one and the queue
    monkeypatch.setattr(S, "QUEUED_MAX", 1)
    params[0] = 3.0
    s.evaluate_later(params, t=3.0, version=3, epoch=2)
    params[0] = 4.0
    s.evaluate_later(params, t=4.0, version=4, epoch=3)
    threading.Timer(0.2, lambda: (gates[3].set(), gates[4].set())).start()
    params[0] = 5.0
    s.evaluate_later(params, t=5.0, version=5, epoch=4)
    assert Log.rows == [1, 2, 3, 4] and s.evaluating
    gates[5].set()
    assert s.collect(wait=True) and Log.rows == [1, 2, 3, 4, 5] and started == [1, 2, 3, 4, 5]
    # and by bytes: a copy that would pass QUEUED_BYTES waits too, unless it is the only one
    monkeypatch.setattr(S, "QUEUED_MAX", 8)
    monkeypatch.setattr(S, "QUEUED_BYTES", 4)   # one float32
    for v in (6, 7, 8):
        gates[v] = threading.Event()
    params[0] = 6.0
    s.evaluate_later(params, t=6.0, version=6, epoch=5)
    params[0] = 7.0
    s.evaluate_later(params, t=7.0, version=7, epoch=6)   # the only one waiting: kept
    assert len(s._queued) == 1
    threading.Timer(0.2, lambda: (gates[6].set(), gates[7].set())).start()
    params[0] = 8.0
    s.evaluate_later(params, t=8.0, version=8, epoch=7)   # 8 bytes waiting: waits
    assert Log.rows[-2:] == [6, 7] and not s._queued
    gates[8].set()
    assert s.collect(wait=True) and Log.rows == [1, 2, 3, 4, 5, 6, 7, 8]
    s._eval_pool.shutdown()


def test_an_evaluation_process_that_dies_leaves_rank_0_evaluating(digits_dir, capsys):
    """Killed (out of memory, a stray signal): the evaluation it had is done on rank 0, with
    a warning, and so are the ones after it."""
    import signal

    from mpilb.config.build import build_config
    from mpilb.data.dataset import open_dataset
    from mpilb.run.evalproc import EvalProcess
    from mpilb.run.session import Session
    from mpilb.run.evaluation import build_evaluator
    from mpilb.run.components import config_model

    cfg = build_config(cli_values={"data": digits_dir, "model": "mlp", "hidden": "16"})
    ds = open_dataset(digits_dir)
    model = config_model(cfg, ds)

    class Log:
        rows = []

        def append(self, group, **row):
            self.rows.append(row)

    s = Session.__new__(Session)
    s.evaluator, s.log, s._eval_pool, s._pending, s._queued = build_evaluator(model, ds), Log(), None, None, deque()
    s.accuracy, s.evaluation, s.eval_version, s.best = None, None, -1, None
    s._eval_proc = EvalProcess(cfg, ds, model.num_params)
    proc = s._eval_proc.proc
    params = model.init_params(0)
    s.evaluate_later(params, t=1.0, version=1, epoch=0)
    assert s.collect(wait=True)
    proc.send_signal(signal.SIGTERM)          # the job's signals are not the child's...
    s.evaluate_later(params, t=2.0, version=2, epoch=1)
    assert s.collect(wait=True) and s._eval_proc is not None   # ...it ignored that one
    proc.send_signal(signal.SIGSTOP)          # (so that it cannot answer first)
    s.evaluate_later(params, t=3.0, version=3, epoch=2)
    proc.kill()                               # killed while evaluating
    assert s.collect(wait=True) and s._eval_proc is None
    s._eval_proc = EvalProcess(cfg, ds, 0)                    # (through the pipe)
    s._eval_proc.proc.kill()
    s._eval_proc.proc.wait()
    s.evaluate_later(params, t=4.0, version=4, epoch=3)        # dead while idle
    assert s._eval_proc is None and s.collect(wait=True)
    s.evaluate_later(params, t=5.0, version=5, epoch=4)        # on a thread from now on
    assert s.collect(wait=True)
    assert [r["version"] for r in Log.rows] == [1, 2, 3, 4, 5]
    assert len({round(r["test_loss"], 6) for r in Log.rows}) == 1
    assert "the evaluation process ended" in capsys.readouterr().err
    s._eval_pool.shutdown()


def test_the_evaluation_process_imports_user_models_from_rank_0s_path(digits_dir, monkeypatch):
    """A model from a directory the user's script put on sys.path (mpilb.train from a
    script) is importable in the evaluation process too."""
    from pathlib import Path

    from mpilb.config.build import build_config
    from mpilb.data.dataset import open_dataset
    from mpilb.run.components import config_model

    examples = str(Path(__file__).resolve().parents[2] / "examples")
    monkeypatch.syspath_prepend(examples)            # not on PYTHONPATH: only in this process
    monkeypatch.delenv("PYTHONPATH", raising=False)
    cfg = build_config(cli_values={"data": digits_dir, "model": "mymodels:Linear"})
    ds = open_dataset(digits_dir)
    model = config_model(cfg, ds)
    params = model.init_params(cfg.experiment.seed)
    assert_child_evaluates_as_rank_0(cfg, ds, model, params)


def test_the_evaluation_process_loads_a_file_model_that_imports_its_neighbour(digits_dir, tmp_path,
                                                                             monkeypatch):
    """`--model DIR/net.py:Net` with `from mymodels import Linear` in it and mymodels.py in
    DIR (not on PYTHONPATH, not on rank 0's path when the child starts): the evaluation
    process builds the model itself and gets rank 0's figures."""
    import sys
    from pathlib import Path

    from mpilb.config.build import build_config
    from mpilb.data.dataset import open_dataset
    from mpilb.run.components import config_model

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    examples = Path(__file__).resolve().parents[2] / "examples"
    (tmp_path / "mymodels.py").write_text((examples / "mymodels.py").read_text())
    (tmp_path / "net.py").write_text("from mymodels import Linear\n\nclass Net(Linear):\n    pass\n")
    cfg = build_config(cli_values={"data": digits_dir, "model": f"{tmp_path / 'net.py'}:Net"})
    ds = open_dataset(digits_dir)
    model = config_model(cfg, ds)
    params = model.init_params(cfg.experiment.seed) + 0.01
    sys.path[:] = [p for p in sys.path if p != str(tmp_path.resolve())]   # the child's own doing
    assert_child_evaluates_as_rank_0(cfg, ds, model, params)


def assert_child_evaluates_as_rank_0(cfg, ds, model, params):
    """The evaluation process, building the model from `cfg` itself, gets rank 0's loss."""
    from mpilb.run.evalproc import EvalProcess
    from mpilb.run.evaluation import build_evaluator

    proc = EvalProcess(cfg, ds, model.num_params)
    try:
        proc.submit(params)
        ev, _ = proc.result()
    finally:
        proc.close()
    assert ev.loss == pytest.approx(build_evaluator(model, ds).evaluate(params).loss, rel=1e-6)
