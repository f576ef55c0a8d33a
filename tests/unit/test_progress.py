"""Progress display on rank 0: lines with a fake clock, rates after a resume, the bar's end."""

from __future__ import annotations

import io
import re

import pytest

from mpilb.run.progress import FIRST_LINE_S, LogTap, Progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def lines(stream: io.StringIO) -> list[str]:
    return [ln for ln in stream.getvalue().splitlines() if ln]


def make(interval=5.0, epochs=4, per_epoch=1000, **kw):
    out, clock = io.StringIO(), Clock()
    p = Progress(True, epochs, per_epoch, interval=interval, stream=out, bar=False, clock=clock, **kw)
    return p, out, clock


def test_first_line_within_a_second_then_one_per_interval():
    p, out, clock = make(interval=5.0)
    p.begin(0, 0)
    for step in range(1, 121):            # 12 s of updates every 0.1 s, 10 samples each
        clock.t += 0.1
        p.update(0, min(1000, 10 * step))
    got = lines(out)
    assert got.pop(0) == "mpilb [    0.0 s] epoch 1/4, 0/4000 samples, training started"
    stamps = [float(re.match(r"mpilb \[\s*([\d.]+) s\]", ln).group(1)) for ln in got]
    assert stamps[0] == pytest.approx(FIRST_LINE_S, abs=0.11)
    assert [round(b - a) for a, b in zip(stamps, stamps[1:])] == [5, 5]
    assert "epoch 1/4" in got[0] and "samples/s" in got[0] and "ETA" in got[0]


def test_rate_counts_only_this_process_after_a_resume():
    # resumed at epoch 2 with 500 samples of it done: 2500 samples were applied before
    p, out, clock = make(interval=1.0)
    p.begin(2, 500, train_s=30.0)
    clock.t += 2.0
    p.update(2, 900)                      # 400 samples in 2 s here
    assert p.rate() == pytest.approx(200.0)
    start, line = lines(out)
    assert start.endswith("epoch 3/4, 2500/4000 samples, training resumed")
    assert "200 samples/s" in line and "2900/4000 samples" in line
    assert "ETA 6 s" in line      # from this process's rate: 1100 samples left at 200/s


def test_loss_metric_and_lost_workers_come_from_log_rows():
    p, out, clock = make(interval=1.0, metric="accuracy")
    p.begin(0, 0)
    p.row("updates", {"worker": 2, "batch": 150, "loss": 2.0})
    p.row("updates", {"worker": 1, "batch": 450, "loss": 1.0})
    p.row("eval", {"test_loss": 0.9, "test_accuracy": 0.625})
    p.row("workers", {"worker": 1, "rate": 4000.0})   # per busy second: not what is shown
    p.row("workers", {"worker": 2, "rate": 1000.0})
    clock.t += 1.5
    p.update(0, 600, lost=[3])
    line = lines(out)[1]
    assert "loss 1.2500" in line                  # (150*2 + 450*1) / 600
    assert "accuracy 0.6250" in line
    assert "slowest rank 2 (100/s), fastest rank 1 (300/s)" in line   # applied per second
    assert "lost workers [3]" in line


def test_lines_end_without_a_finished_line_of_their_own():
    # the run's status line is the driver's, on stdout: two `finished` lines collide in 2>&1
    p, out, clock = make(interval=10.0)
    p.begin(0, 0)
    p.row("eval", {"test_accuracy": 0.5})
    clock.t += 3
    p.update(1, 200)
    before = lines(out)
    p.close({"status": "finished", "epochs_completed": 1, "samples": 1200, "train_s": 3.0,
             "samples_per_s": 400.0, "final_test_metric": 0.9471, "final_train_loss": 0.25,
             "lost_workers": []})
    assert lines(out) == before and not any("finished" in ln for ln in before)


def test_worker_rates_are_per_wall_second_and_add_up_to_the_jobs():
    p, out, clock = make(interval=2.0, epochs=1, per_epoch=100000)
    p.begin(0, 0)
    p.update(0, 0, workers=[1, 2, 3, 4])
    applied = {1: 3000, 2: 1000, 3: 500}       # rank 4 applied nothing in this window
    for w, n in applied.items():
        for _ in range(n // 50):
            p.row("updates", {"worker": w, "batch": 50, "loss": 1.0})
    clock.t += 2.0
    p.update(0, sum(applied.values()), workers=[1, 2, 3, 4])
    line = lines(out)[-1]
    assert "2,250 samples/s" in line               # 4500 samples in 2 s
    assert "slowest rank 4 (0/s), fastest rank 1 (1,500/s)" in line
    # the next window starts afresh
    for _ in range(20):
        p.row("updates", {"worker": 2, "batch": 50, "loss": 1.0})
    clock.t += 2.0
    p.update(0, 5500, workers=[1, 2, 3, 4])
    assert "fastest rank 2 (500/s)" in lines(out)[-1]
    rates = p.worker_rates(clock.t + 1.0)
    assert rates == {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}


def _fake_proc(root, chain):
    """A /proc with this process's stderr and its ancestors' as `chain` gives them:
    [(pid, parent, stderr target)], this process first."""
    import os

    self_pid = os.getpid()
    (root / "self" / "fd").mkdir(parents=True)
    for i, (pid, parent, target) in enumerate(chain):
        pid = self_pid if i == 0 else pid
        (root / str(pid) / "fd").mkdir(parents=True)
        (root / str(pid) / "stat").write_text(f"{pid} (x y) S {parent} 0 0\n")
        (root / str(pid) / "fd" / "2").symlink_to(target)
        if i == 0:
            (root / "self" / "fd" / "2").symlink_to(target)


class _Stderr:
    def isatty(self):
        return False

    def fileno(self):
        return 2


@pytest.mark.parametrize("chain, watched", [
    # an interactive mpiexec: rank -> proxy -> mpiexec, whose stderr is the terminal
    ([(0, 901, "pipe:[11]"), (901, 900, "pipe:[12]"), (900, 800, "/dev/pts/3")], True),
    # a batch job: mpiexec writes into the job's output file
    ([(0, 901, "pipe:[11]"), (901, 900, "pipe:[12]"), (900, 800, "/scratch/slurm-7.out")], False),
    # srun's tasks: the parent (slurmstepd, root's) cannot be read
    ([(0, 77, "pipe:[11]")], False),
    ([(0, 901, "/home/u/run.err")], False),
])
def test_default_interval_is_5_s_with_a_terminal_upstream_and_60_s_in_a_batch_job(
        tmp_path, chain, watched):
    from mpilb.run.progress import BATCH_INTERVAL_S, WATCHED_INTERVAL_S, default_interval, terminal_upstream

    _fake_proc(tmp_path, chain)
    assert terminal_upstream(_Stderr(), proc=str(tmp_path)) is watched
    assert default_interval(io.StringIO()) == BATCH_INTERVAL_S   # no file behind it
    assert (WATCHED_INTERVAL_S, BATCH_INTERVAL_S) == (5.0, 60.0)
    p = Progress(True, 1, 10, stream=io.StringIO(), bar=False)
    assert p.interval == BATCH_INTERVAL_S


def test_bar_ends_on_the_summary_metric():
    out = io.StringIO()
    p = Progress(True, 2, 100, stream=out, bar=True)
    p.begin(0, 0)
    p.row("eval", {"test_accuracy": 0.955})
    p.update(1, 50)
    p.update(2, 0)
    p.close({"status": "finished", "epochs_completed": 2, "samples": 200, "train_s": 1.0,
             "samples_per_s": 200.0, "final_test_metric": 0.9471, "final_train_loss": 0.3,
             "lost_workers": []})
    text = out.getvalue()
    final = text.rsplit("\r", 1)[-1]
    assert "0.9471" in final and "0.955" not in final


def test_disabled_prints_nothing():
    out = io.StringIO()
    p = Progress(False, 2, 100, stream=out, bar=False)
    p.begin(0, 0)
    p.update(1, 50)
    p.close({"status": "finished"})
    assert out.getvalue() == ""


def test_log_tap_passes_rows_and_attributes():
    class Log:
        path = "run.h5"

        def __init__(self):
            self.rows = []
            self.closed = None

        def append(self, group, **row):
            self.rows.append((group, row))

        def flush(self):
            pass

        def close(self, status, attrs=None):
            self.closed = status

    class Seen:
        def __init__(self):
            self.rows, self.closed = [], False

        def row(self, group, row):
            self.rows.append(group)

        def close_log(self):
            self.closed = True

    log, seen = Log(), Seen()
    tap = LogTap(log, seen, None)
    tap.append("updates", t=0.1, batch=3)
    tap.close("finished")
    assert log.rows == [("updates", {"t": 0.1, "batch": 3})] and seen.rows == ["updates"]
    assert seen.closed and log.closed == "finished" and tap.path == "run.h5"


def test_unobserved_log_is_not_wrapped():
    from mpilb.run.progress import tapped

    log = object()
    assert tapped(log, None, Progress(False, 1, 1, bar=False)) is log
    shown = Progress(True, 1, 1, stream=io.StringIO(), bar=False)
    assert isinstance(tapped(log, shown), LogTap)
