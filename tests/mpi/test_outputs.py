"""Where a run's figures go besides the report: CSV, pandas, TensorBoard; a final metric at
every stop. Logs are built with RunLog (units) or by short runs (one serial, one under mpiexec).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import mpirun
from mpilb.runfiles.runlog import RunLog, read, read_columns, write_csv
from mpilb.runfiles.tensorboard import TensorBoardTap

CONFIG = {"mode": "async", "balancer": "load", "batch_policy": "fixed", "store": "shared",
          "correction": "none", "batch": 32}


def small_log(path) -> str:
    log = RunLog(str(path), {"config": json.dumps(CONFIG), "world_size": 3, "mpi_library": "t",
                             "hostnames": "[]"}, flush_interval=60)
    for i in range(10):
        log.append("updates", t=0.1 * i, worker=1 + i % 2, version=i + 1, staleness=i % 3,
                   batch=32, loss=1.0 / (i + 1), lr_scale=1.0, epoch=0, shard=i % 4)
    log.append("shards", t=0.2, epoch=0, shard=1, src=2, dst=1, event="move", bytes=7)
    log.append("eval", t=1.0, version=10, epoch=0, test_loss=0.5, test_accuracy=0.75)
    log.close("finished", {"train_s": 1.0})
    return str(path)


# ----------------------------------------------------------------------- CSV and pandas


def test_csv_one_file_per_group_loads_with_pandas(tmp_path):
    pd = pytest.importorskip("pandas")
    path = small_log(tmp_path / "run.h5")
    res = mpirun.run(0, "report", path, "--csv", tmp_path / "csv", timeout=60)
    assert res.returncode == 0, res.stderr
    _, cols = read_columns(path)
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == sorted(f"{g}.csv" for g in cols)
    updates = pd.read_csv(tmp_path / "csv" / "updates.csv")
    assert list(updates.columns) == list(cols["updates"])
    np.testing.assert_array_equal(updates["loss"].to_numpy(), cols["updates"]["loss"])
    np.testing.assert_array_equal(updates["t"].to_numpy(), cols["updates"]["t"])
    shards = pd.read_csv(tmp_path / "csv" / "shards.csv")
    assert shards["event"].tolist() == ["move"] and shards["bytes"].tolist() == [7]
    assert len(pd.read_csv(tmp_path / "csv" / "epochs.csv")) == 0


def test_read_gives_dataframes_with_the_run_attributes(tmp_path):
    pytest.importorskip("pandas")
    frames = read(small_log(tmp_path / "run.h5"))
    assert set(frames) >= {"updates", "workers", "eval", "shards", "epochs"}
    up = frames["updates"]
    assert len(up) == 10 and up.groupby("worker")["batch"].sum().to_dict() == {1: 160, 2: 160}
    assert frames["eval"]["test_accuracy"].tolist() == [0.75]
    assert up.attrs["status"] == "finished" and up.attrs["config"]["balancer"] == "load"


def test_write_csv_into_a_file_is_a_usage_error(tmp_path):
    from mpilb.errors import UsageError

    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="--csv"):
        write_csv({"updates": {"t": np.zeros(1)}}, tmp_path / "f")


# ----------------------------------------------------------------------- TensorBoard


class FakeWriter:
    def __init__(self):
        self.scalars: dict[str, list] = {}

    def add_scalar(self, tag, value, step, walltime=None):
        self.scalars.setdefault(tag, []).append((step, value))

    def flush(self):
        pass

    def close(self):
        pass


def test_tap_writes_windowed_loss_and_row_scalars():
    w = FakeWriter()
    tap = TensorBoardTap("unused", writer=w, interval=1.0)
    for i in range(20):     # 2 s of updates, two workers
        tap.row("updates", {"t": 0.1 * (i + 1), "worker": 1 + i % 2, "batch": 10,
                            "loss": 1.0 if i % 2 else 3.0, "staleness": i % 4})
    tap.row("eval", {"t": 2.0, "test_loss": 0.4, "test_accuracy": 0.8})
    tap.row("workers", {"t": 2.0, "worker": 2, "rate": 500.0, "predicted_rate": 450.0, "batch": 10})
    tap.row("epochs", {"epoch": 0, "t_start": 0.0, "t_end": 2.0, "utilization": 0.9, "imbalance_s": 0.1})
    tap.close_log()
    s = w.scalars
    assert s["train/loss"][0] == (100, pytest.approx(2.0))       # first 1 s: 10 updates
    assert s["train/loss/rank_1"][0][1] == pytest.approx(3.0)
    assert s["train/loss/rank_2"][0][1] == pytest.approx(1.0)
    assert s["test/accuracy"] == [(200, 0.8)] and s["test/loss"] == [(200, 0.4)]
    assert s["workers/rate/rank_2"] == [(200, 500.0)]
    assert s["epochs/utilization"] == [(200, 0.9)] and s["epochs/seconds"] == [(200, 2.0)]
    assert s["staleness/max"][0][1] == 3
    assert s["train/samples_per_s"][0][1] == pytest.approx(100.0)


# ----------------------------------------------------------------------- short runs


def _eval_at_stop(log, expect_status="finished"):
    attrs, cols = read_columns(str(log))
    s = attrs["summary"]
    assert s["status"] == expect_status
    assert s["final_test_metric"] is not None and s["final_train_loss"] is not None
    # the last evaluation is of the final parameters (at the stop, unless an evaluation of
    # the same version, e.g. at an epoch's end, came just before it)
    assert cols["eval"]["version"][-1] == cols["updates"]["version"].max()
    return s, cols


def test_serial_max_seconds_run_has_final_metric_and_tensorboard(small_dataset, tmp_path):
    log, tb = tmp_path / "run.h5", tmp_path / "tb"
    res = mpirun.run(0, "train", "--data", small_dataset.root, "--model", "softmax", "--epochs", 100000,
                     "--max-seconds", 1.5, "--eval-interval", 100, "--log", log, "--tensorboard", tb,
                     "--progress-interval", 0.5, timeout=120)
    assert res.returncode == 0, res.stderr
    s, cols = _eval_at_stop(log)
    assert "mpilb [" in res.stderr and "loss" in res.stderr      # progress lines (stderr is a pipe)
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    ea = event_accumulator.EventAccumulator(str(tb))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"train/loss", "test/accuracy", "test/loss", "workers/rate/rank_0", "staleness/mean"} <= tags
    acc = ea.Scalars("test/accuracy")
    assert [e.value for e in acc] == pytest.approx(cols["eval"]["test_accuracy"].tolist())
    assert acc[-1].step == s["samples"]


@pytest.mark.mpi
def test_server_max_seconds_run_has_final_metric(small_dataset, tmp_path):
    log = tmp_path / "run.h5"
    res = mpirun.run(3, "train", "--data", small_dataset.root, "--model", "softmax", "--epochs", 100000,
                     "--max-seconds", 2, "--eval-interval", 100, "--log", log, "--no-progress", timeout=120)
    assert res.returncode == 0, res.stderr
    _eval_at_stop(log)
