"""Tests for `mpilb report`: summary keys, text/JSON/compare output, plots, killed runs.

Most logs are built directly with mpilb.runfiles.runlog.RunLog, so the expected figures follow from
the rows written; one test trains serially in a subprocess and one kills a run under
mpiexec with SIGKILL and reads what it left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import mpirun
from mpilb.runfiles.plots import shard_spans, throughput, timeline_segments, write_plots
from mpilb.runfiles.summary import SUMMARY_KEYS, summarize_log
from mpilb.runfiles.runlog import RunLog, read_columns

# docs/logs.md, "Summary keys", spelled out here so that a change on either side shows.
DOCUMENTED_SUMMARY_KEYS = {
    "status", "mode", "balancer", "batch_policy", "store", "correction", "workers", "wall_s",
    "train_s", "samples", "samples_per_s", "updates", "epochs_completed", "epoch_s",
    "utilization", "final_test_accuracy", "best_test_accuracy", "metric", "final_test_metric",
    "best_test_metric", "final_train_loss", "time_to_target_s", "staleness", "shard_moves",
    "bytes_moved", "lost_workers", "coverage", "server_cpu_s", "per_worker", "servers",
    "efficiency",
}
PER_WORKER_KEYS = {"rank", "samples", "compute_s", "io_s", "comm_s", "idle_s", "mean_batch", "train_loss"}
RUN_PLOTS = ("timeline.png", "rates.png", "batch.png", "staleness.png", "shards.png", "loss.png",
             "eval.png")
COMPARE_PLOTS = ("compare_accuracy.png", "compare_loss.png", "compare_rates.png",
                 "compare_epoch_time.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONFIG = {"mode": "async", "balancer": "load", "batch_policy": "fixed", "store": "shared",
          "correction": "none", "batch": 32, "target_accuracy": 0.5}


def start_log(path, world_size: int = 4, config: dict = CONFIG, flush_interval: float = 60.0) -> RunLog:
    return RunLog(str(path), {"config": json.dumps(config), "world_size": world_size,
                              "mpi_library": "test", "hostnames": json.dumps(["h"] * world_size)},
                  flush_interval=flush_interval)


def fill(log: RunLog, workers=(1, 2, 3), epochs: int = 2, slow: int = 3) -> dict:
    """Rows of a small run in which rank `slow` is four times slower; returns expected totals."""
    t, version, samples = 0.0, 0, {w: 0 for w in workers}
    batches = {w: 0 for w in workers}
    for epoch in range(epochs):
        t_start = t
        for shard, w in enumerate(workers):
            log.append("shards", t=t, epoch=epoch, shard=shard, src=-1, dst=w, event="assign")
            log.append("shards", t=t + 0.01, epoch=epoch, shard=shard, src=-1, dst=w, event="start")
        for step in range(8):
            for w in workers:
                if w == slow and step % 4:
                    continue
                t += 0.01
                version += 1
                log.append("updates", t=t, worker=w, version=version, staleness=step % 3 + (w == slow),
                           batch=32, loss=1.0 / version, lr_scale=1.0, epoch=epoch, shard=workers.index(w))
                samples[w] += 32
                batches[w] += 1
        if epoch == 0:
            log.append("shards", t=t, epoch=epoch, shard=0, src=workers[0], dst=workers[-1], event="move",
                       bytes=1000)
        for shard, w in enumerate(workers):
            log.append("shards", t=t, epoch=epoch, shard=shard, src=-1, dst=w, event="done")
        for w in workers:
            log.append("workers", t=t, worker=w, samples=32, compute_s=0.05 * (4 if w == slow else 1),
                       io_s=0.01, comm_s=0.02, idle_s=0.03 if w != slow else 0.0, batch=32,
                       rate=1000.0 / (4 if w == slow else 1), predicted_rate=900.0)
        log.append("epochs", epoch=epoch, t_start=t_start, t_end=t, samples=96, utilization=0.8,
                   imbalance_s=0.05)
        log.append("eval", t=t, version=version, epoch=epoch, test_loss=1.0 / (epoch + 1),
                   test_accuracy=0.4 + 0.2 * epoch)
    return {"samples": samples, "batches": batches, "updates": version, "t": t}


def finished_log(path, **kw) -> tuple[str, dict]:
    log = start_log(path, world_size=len(kw.get("workers", (1, 2, 3))) + 1)
    expected = fill(log, **kw)
    log.close("finished", {"train_s": expected["t"], "wall_s": expected["t"] + 0.5,
                           "coverage": json.dumps({"expected": 192, "applied": 192, "duplicates": 0,
                                                   "missing": 0})})
    return str(path), expected


def report(*args, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpilb", "report", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=mpirun.env())


# ----------------------------------------------------------------------- summary


def test_summary_keys_match_design(tmp_path):
    path, expected = finished_log(tmp_path / "run.h5")
    s = summarize_log(path)
    assert set(SUMMARY_KEYS) == DOCUMENTED_SUMMARY_KEYS
    assert set(s) == DOCUMENTED_SUMMARY_KEYS
    assert s["status"] == "finished" and s["workers"] == 3
    assert s["updates"] == expected["updates"]
    assert s["samples"] == sum(expected["samples"].values())
    assert s["epochs_completed"] == 2 and len(s["epoch_s"]) == 2
    assert s["best_test_accuracy"] == pytest.approx(0.6)
    assert s["time_to_target_s"] is not None        # target 0.5 reached at the second eval
    assert s["shard_moves"] == 1 and s["bytes_moved"] == 1000
    assert set(s["staleness"]) == {"mean", "p50", "p99", "max"}


def test_training_loss_is_the_mean_of_the_last_updates(tmp_path):
    from mpilb.runfiles.summary import loss_window, smoothed_loss

    path, expected = finished_log(tmp_path / "run.h5")
    s = summarize_log(path)
    n = expected["updates"]
    k = loss_window(n)
    # every batch is 32 samples: the plain mean of the last k per-sample losses (1/version)
    assert s["final_train_loss"] == pytest.approx(np.mean(1.0 / np.arange(n - k + 1, n + 1)))
    _, cols = read_columns(path)
    up = cols["updates"]
    for w in s["per_worker"]:
        m = up["worker"] == w["rank"]
        mine = up["loss"][m].astype(np.float64)
        assert w["train_loss"] == pytest.approx(mine[-loss_window(mine.size):].mean(), rel=1e-6)
    assert s["metric"] == "accuracy" and s["final_test_metric"] == s["final_test_accuracy"]
    # weights: a batch of 3 samples counts three times one of 1; NaN losses are skipped
    got = smoothed_loss(np.array([1.0, 2.0, np.nan, 5.0]), np.array([1, 3, 2, 1]), window=3)
    assert got.tolist() == pytest.approx([1.0, 7 / 4, 7 / 4, 11 / 4])


def test_text_report_shows_loss_and_metric(tmp_path):
    path, _ = finished_log(tmp_path / "run.h5")
    res = report(path)
    assert res.returncode == 0, res.stderr
    assert "train loss 0.0" in res.stdout and "test accuracy: final 0.6000" in res.stdout
    lines = res.stdout.splitlines()
    # the per-worker table (header and three workers), then the job's layout
    assert "train_loss" in lines[-7] and lines[-4].startswith("     3 ")
    assert lines[-3:] == ["  layout: 4 rank(s) on 1 node(s); parameter store(s) on rank(s) 0",
                          "    node 0 (h): rank(s) 0 store, 1, 2, 3",
                          "    store 0 <-> workers: shared memory 1-3; network none"]


def test_per_worker_entries(tmp_path):
    path, expected = finished_log(tmp_path / "run.h5")
    per = summarize_log(path)["per_worker"]
    assert [w["rank"] for w in per] == [1, 2, 3]
    for w in per:
        assert set(w) == PER_WORKER_KEYS
        assert w["samples"] == expected["samples"][w["rank"]]
        assert w["mean_batch"] == 32.0
    slow = per[2]
    assert slow["compute_s"] == pytest.approx(2 * 0.2) and per[0]["compute_s"] == pytest.approx(2 * 0.05)


# ----------------------------------------------------------------------- command line


def test_cli_json_parses(tmp_path):
    path, _ = finished_log(tmp_path / "run.h5")
    res = report(path, "--json")
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    assert set(s) == DOCUMENTED_SUMMARY_KEYS and len(s["per_worker"]) == 3


def test_cli_plots_written(tmp_path):
    path, _ = finished_log(tmp_path / "run.h5")
    out = tmp_path / "plots"
    res = report(path, "--plots", out)
    assert res.returncode == 0, res.stderr
    for name in RUN_PLOTS:
        png = out / name
        assert png.stat().st_size > 5000, name
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert f"wrote {png}" in res.stdout
    # with --json as well, stdout stays one JSON document
    res = report(path, "--json", "--plots", tmp_path / "again")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["status"] == "finished"
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == sorted(RUN_PLOTS)


def test_cli_compare_table_and_overlays(tmp_path):
    a, _ = finished_log(tmp_path / "a.h5")
    b, _ = finished_log(tmp_path / "b.h5", workers=(1, 2), slow=2, epochs=3)
    res = report("--compare", a, b, "--plots", tmp_path / "cmp")
    assert res.returncode == 0, res.stderr
    header = next(line for line in res.stdout.splitlines() if "a.h5" in line)
    assert "b.h5" in header
    workers_row = next(line for line in res.stdout.splitlines() if line.startswith("workers"))
    assert workers_row.split()[1:] == ["3", "2"]
    assert "final train loss" in res.stdout
    lines = res.stdout.splitlines()
    start = lines.index("settings that differ:") + 1
    end = next(i for i, ln in enumerate(lines) if ln.startswith("samples to each accuracy"))
    assert [ln.split() for ln in lines[start:end]] == [["workers", "3", "2"]]
    # samples to the reference's accuracies (the first run: neither is sync), a's own x1
    levels = lines[end + 1:end + 6]
    assert levels and all(len(ln.split()) >= 3 for ln in levels)
    # each count with the evaluation before it; a note where that spacing is coarse
    rows = [r for s in json.loads(report("--compare", a, b, "--json").stdout).values()
            for r in s["efficiency"]["against_reference"]]
    spans = [(at - after) / at for r in rows for at, after in
             ((r["samples"], r["samples_after"]), (r["reference_samples"], r["reference_samples_after"]))
             if at and after is not None]
    assert spans and all(0 < v <= 1 for v in spans)
    assert (max(spans) > 0.1) == any(ln.startswith("note: a count is known") and "--eval-every" in ln
                                     for ln in lines)
    for name in COMPARE_PLOTS:
        assert (tmp_path / "cmp" / name).stat().st_size > 5000, name


def test_missing_log_is_usage_error(tmp_path):
    res = report(tmp_path / "nope.h5")
    assert res.returncode == 2
    assert "nope.h5" in res.stderr and "Traceback" not in res.stderr


# ----------------------------------------------------------------------- unfinished runs


def test_running_log_reports_incomplete(tmp_path):
    path = tmp_path / "live.h5"
    log = start_log(path)
    try:
        expected = fill(log, epochs=1)
        log.flush()
        attrs, _ = read_columns(str(path))
        assert attrs["status"] == "running"
        s = summarize_log(str(path))
        assert s["status"] == "running"
        assert s["updates"] == expected["updates"] and s["epochs_completed"] == 1
        res = report(path)
        assert res.returncode == 0, res.stderr
        assert "INCOMPLETE" in res.stdout and "running" in res.stdout
        written = write_plots([str(path)], str(tmp_path / "plots"))
        assert [os.path.basename(p) for p in written] == list(RUN_PLOTS)
    finally:
        log.close("failed")


def test_unflushed_rows_are_not_in_a_live_log(tmp_path):
    path = tmp_path / "live.h5"
    log = start_log(path)
    try:
        log.append("updates", t=0.1, worker=1, version=1, batch=32)
        log.flush()
        log.append("updates", t=0.2, worker=1, version=2, batch=32)   # buffered, not flushed
        _, cols = read_columns(str(path))
        assert cols["updates"]["t"].tolist() == [pytest.approx(0.1)]
    finally:
        log.close("failed")


def test_empty_groups_still_plot(tmp_path):
    """A run killed before any row, and a serial run (worker rank 0 only)."""
    empty = tmp_path / "empty.h5"
    log = start_log(empty)
    log.flush()
    written = write_plots([str(empty)], str(tmp_path / "empty_plots"))
    log.close("failed")
    assert [os.path.basename(p) for p in written] == list(RUN_PLOTS)
    assert all(os.path.getsize(p) > 2000 for p in written)
    assert summarize_log(str(empty))["per_worker"] == [
        {"rank": r, "samples": 0, "compute_s": 0.0, "io_s": 0.0, "comm_s": 0.0, "idle_s": 0.0,
         "mean_batch": 0.0, "train_loss": None} for r in (1, 2, 3)]

    serial = tmp_path / "serial.h5"
    log = start_log(serial, world_size=1)
    fill(log, workers=(0,), slow=-1)
    log.close("finished")
    written = write_plots([str(serial)], str(tmp_path / "serial_plots"))
    assert len(written) == len(RUN_PLOTS)
    assert [w["rank"] for w in summarize_log(str(serial))["per_worker"]] == [0]

    written = write_plots([str(empty), str(serial)], str(tmp_path / "cmp"))
    assert [os.path.basename(p) for p in written] == list(COMPARE_PLOTS)


def test_serial_train_then_report(small_dataset, tmp_path):
    log = tmp_path / "serial.h5"
    res = subprocess.run(mpirun.mpilb_cmd(0, "train", "--data", small_dataset.root, "--model", "softmax",
                                          "--epochs", 2, "--log", log, "--no-progress"),
                         capture_output=True, text=True, timeout=120, env=mpirun.env())
    assert res.returncode == 0, res.stderr
    res = report(log, "--json", "--plots", tmp_path / "plots")
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    assert s["status"] == "finished" and s["epochs_completed"] == 2
    assert s["samples"] == 2 * 1600
    assert [w["rank"] for w in s["per_worker"]] == [0]
    assert all((tmp_path / "plots" / n).stat().st_size > 5000 for n in RUN_PLOTS)


def test_one_finished_line_and_epochs_numbered_alike(small_dataset, tmp_path):
    """Progress lines, the run's status line and the report as a user sees them together
    (`2>&1`): one `finished`, epochs counted from 1 in the progress and the report alike,
    while the log keeps the index from 0."""
    log = tmp_path / "seen.h5"
    res = subprocess.run(mpirun.mpilb_cmd(0, "train", "--data", small_dataset.root, "--model",
                                          "softmax", "--epochs", 2, "--log", log,
                                          "--progress-interval", "0.01"),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=120, env=mpirun.env())
    assert res.returncode == 0, res.stdout
    lines = res.stdout.splitlines()
    assert [ln for ln in lines if re.search(r"\bfinished\b", ln)] == [
        next(ln for ln in lines if ln.startswith("mpilb: finished: 2 epoch(s)"))]
    shown = {int(n) for n in re.findall(r"epoch (\d+)/2", res.stdout)}
    assert 1 in shown and shown <= {1, 2}
    assert read_columns(str(log))[1]["epochs"]["epoch"].tolist() == [0, 1]
    text = report(log).stdout.splitlines()
    head = text.index("  epoch   seconds  utilization")
    assert [int(row.split()[0]) for row in text[head + 1:head + 3]] == [1, 2]


# ----------------------------------------------------------------------- figure helpers


def test_timeline_segments_fill_each_interval():
    t = np.array([1.0, 2.0, 3.0])
    parts = {"compute": np.array([0.5, 2.0, 0.0]), "idle": np.array([0.25, 2.0, 0.0])}
    segs = timeline_segments(t, parts)
    # interval 1: 0.75 s reported of 1 s, the rest untimed, in order
    assert segs[:3] == [("compute", 0.0, 0.5), ("idle", 0.5, 0.25), ("untimed", 0.75, 0.25)]
    # interval 2: 4 s reported in 1 s: scaled to fit, proportions kept
    assert [s[0] for s in segs[3:5]] == ["compute", "idle"]
    assert segs[3][2] == pytest.approx(0.5) and segs[4][1] + segs[4][2] == pytest.approx(2.0)
    # interval 3: nothing reported
    assert segs[5] == ("untimed", 2.0, 1.0)
    total = sum(w for _, _, w in segs)
    assert total == pytest.approx(3.0)


def test_shard_spans_pair_start_and_done():
    sh = {"t": np.array([0.0, 0.1, 0.2, 0.3, 0.4]), "epoch": np.array([0, 0, 0, 1, 0]),
          "shard": np.array([5, 5, 6, 5, 5]), "dst": np.array([2, 2, 3, 2, 2]),
          "event": np.array(["assign", "start", "start", "done", "done"])}
    # (1, 5) "done" has no start in epoch 1; shard 6 never finished (killed run)
    assert shard_spans(sh) == [(0.1, 0.4, 5, 2)]


def test_throughput_bins_sum_to_samples():
    t = np.linspace(0.01, 2.0, 200)
    centres, rates = throughput(t, np.full(200, 10))
    widths = 2.0 / centres.size
    assert (rates * widths).sum() == pytest.approx(2000)
    assert throughput(np.zeros(0), np.zeros(0))[0].size == 0


# ----------------------------------------------------------------------- killed under mpiexec


@pytest.mark.mpi
def test_sigkilled_run_reads_as_incomplete(small_dataset, tmp_path):
    log = tmp_path / "killed.h5"
    cmd = mpirun.mpilb_cmd(3, "train", "--data", small_dataset.root, "--model", "softmax",
                           "--epochs", 100000, "--max-seconds", 60, "--log", log, "--no-progress")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env=mpirun.env())
    try:
        deadline = time.monotonic() + 60
        while not log.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert log.exists(), f"no run log (rc {proc.poll()})"
        time.sleep(3.0)   # ~3 s of training: the log flushes every 2 s
        assert proc.poll() is None, "the run ended before it could be killed"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    attrs, cols = read_columns(str(log))
    assert attrs["status"] == "running"
    assert cols["updates"]["t"].size > 0 and cols["epochs"]["epoch"].size > 0
    res = report(log)
    assert res.returncode == 0, res.stderr
    assert "INCOMPLETE" in res.stdout and "status running" in res.stdout
    res = report(log, "--json")
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    assert s["status"] == "running" and s["updates"] == cols["updates"]["t"].size


def test_eval_figure_without_evaluations_shows_training_loss(tmp_path):
    from mpilb.runfiles.plots._common import _load
    from mpilb.runfiles.plots.learning import eval_figure, loss_figure

    path = tmp_path / "noeval.h5"
    log = start_log(path)
    for i in range(50):
        log.append("updates", t=0.01 * i, worker=1 + i % 3, version=i + 1, batch=32, loss=2.0 / (i + 1))
    log.close("finished")
    run = _load(str(path))
    fig = eval_figure(run)
    metric_t, metric_s, loss_t, loss_s = fig.axes
    assert loss_t.lines and loss_s.lines              # the training loss, against time and samples
    assert max(loss_s.lines[-1].get_xdata()) == 50 * 32
    assert not metric_t.lines and "no evaluation" in metric_t.texts[0].get_text()
    # loss.png: one line per worker plus the overall one, in both panels
    assert [len(ax.lines) for ax in loss_figure(run).axes] == [4, 4]


def test_compare_legends_name_the_settings_that_differ(tmp_path):
    from mpilb.runfiles.plots import _load
    from mpilb.runfiles.plots.compare import compare_figures

    a = start_log(tmp_path / "a.h5", config=dict(CONFIG, epochs=5, hidden="64"))
    fill(a)
    a.close("finished")
    b = start_log(tmp_path / "b.h5", config=dict(CONFIG, epochs=5, hidden="128"))
    fill(b)
    b.close("finished")
    figs = dict(compare_figures([_load(str(tmp_path / "a.h5")), _load(str(tmp_path / "b.h5"))]))
    legend = [t.get_text() for t in figs["compare_loss.png"].axes[0].get_legend().get_texts()]
    assert legend == ["a.h5 (hidden=64)", "b.h5 (hidden=128)"]
