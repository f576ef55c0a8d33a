"""Membership over time in `mpilb report`: the count of workers in its text, members.png
in --plots (issue 29), from small run logs written with the run log's writer."""

from __future__ import annotations

import json

import pytest

from mpilb.runfiles.plots import counts_text, member_spans, worker_counts, write_plots
from mpilb.runfiles.report import run_report
from mpilb.runfiles.runlog import RunLog, read_columns

CONFIG = {"mode": "async", "balancer": "load", "batch_policy": "fixed", "store": "shared",
          "correction": "none", "batch": 32}


def small_run(path, members=(), world: int = 3, end: float = 8.0, resumed_at=None) -> str:
    """A finished run of `world` ranks (rank 0 the store) whose workers push every 0.5 s
    while in the run; `members`: (t, worker, node, event) rows; `resumed_at`: the root
    attribute of a resumed run's log."""
    attrs = {"config": json.dumps(CONFIG), "world_size": world, "hostnames": json.dumps(["h"] * world)}
    if resumed_at is not None:
        attrs["resumed_at"] = json.dumps(resumed_at)
    log = RunLog(str(path), attrs, flush_interval=60.0)
    inside = {w: (0.0, end) for w in range(1, world)}
    for t, w, node, event in members:
        if event in ("join", "respawn"):
            inside[w] = (t, end)
        else:
            inside[w] = (inside[w][0], t)
        log.append("members", t=t, worker=w, node=node, event=event)
    version = 0
    for step in range(1, int(end / 0.5) + 1):
        t = step * 0.5
        for w, (a, b) in sorted(inside.items()):
            if a < t <= b:
                version += 1
                log.append("updates", t=t, worker=w, version=version, staleness=0, batch=32,
                           loss=1.0, lr_scale=1.0, epoch=0, shard=0)
                log.append("workers", t=t, worker=w, samples=32, compute_s=0.3, io_s=0.0,
                           comm_s=0.1, idle_s=0.0, batch=32, rate=100.0, predicted_rate=100.0)
    log.append("epochs", epoch=0, t_start=0.0, t_end=end, samples=32 * version,
               utilization=0.9, imbalance_s=0.0)
    log.close("finished", {"train_s": end, "wall_s": end + 0.5})
    return str(path)


def counts(path):
    return worker_counts(*read_columns(path))


def test_joins_count_from_their_time(tmp_path):
    path = small_run(tmp_path / "join.h5", [(3.1, 3, 0, "join"), (3.1, 4, -1, "join")])
    assert counts(path) == [(0.0, 2), (pytest.approx(3.1), 4)]
    assert counts_text(counts(path)) == "workers: 2 until 3.1 s, 4 after"
    spans = member_spans(*read_columns(path))
    assert [(s.rank, s.came, s.went) for s in spans] == [
        (1, "start", ""), (2, "start", ""), (3, "join", ""), (4, "join", "")]
    assert spans[2].start == pytest.approx(3.1) and spans[2].end is None


def test_loss_respawn_and_leave(tmp_path):
    path = small_run(tmp_path / "churn.h5", [(2.0, 2, 0, "lost"), (4.0, 5, 0, "respawn"),
                                             (6.0, 1, 0, "leave")], world=4)
    assert counts(path) == [(0.0, 3), (2.0, 2), (4.0, 3), (6.0, 2)]
    assert counts_text(counts(path)) == ("workers: 3 until 2.0 s, 2 until 4.0 s, "
                                         "3 until 6.0 s, 2 after")
    went = {s.rank: (s.went, s.end) for s in member_spans(*read_columns(path))}
    assert went[2] == ("lost", 2.0) and went[1] == ("leave", 6.0) and went[5] == ("", None)


def test_no_changes_one_step(tmp_path):
    path = small_run(tmp_path / "still.h5")
    assert counts(path) == [(0.0, 2)]
    assert counts_text(counts(path)) == "workers: 2 throughout"


def test_report_text_shows_the_count(tmp_path, capsys):
    path = small_run(tmp_path / "join.h5", [(3.1, 3, 0, "join")])
    assert run_report([path]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("  membership changes:")
    assert lines[at + 1].strip() == "workers: 2 until 3.1 s, 3 after"
    assert "rank 3 joined (node 0)" in lines[at + 2]


def test_members_plot_only_with_changes(tmp_path):
    pytest.importorskip("matplotlib")
    path = small_run(tmp_path / "join.h5", [(3.1, 3, 0, "join"), (5.0, 1, 0, "leave")])
    written = write_plots([path], str(tmp_path / "plots"))
    png = tmp_path / "plots" / "members.png"
    assert str(png) in written
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    still = small_run(tmp_path / "still.h5")
    written = write_plots([still], str(tmp_path / "still_plots"))
    assert not any(w.endswith("members.png") for w in written)


def test_a_resume_starts_with_the_launchs_own_ranks(tmp_path, capsys):
    """Joined at 3.1 s, rank 2 left at 4 s, resumed from 6 s with the job's ranks 1 and 2:
    the joiner is out from the resume, rank 2 back."""
    path = small_run(tmp_path / "resumed.h5", [(3.1, 3, 0, "join"), (4.0, 2, 0, "leave")],
                     resumed_at=[6.0])
    assert counts(path) == [(0.0, 2), (pytest.approx(3.1), 3), (4.0, 2)]
    spans = [(s.rank, s.start, s.end, s.came, s.went) for s in member_spans(*read_columns(path))]
    assert spans == [(1, 0.0, None, "start", ""), (2, 0.0, 4.0, "start", "leave"),
                     (2, 6.0, None, "resume", ""), (3, pytest.approx(3.1), 6.0, "join", "resume")]
    assert run_report([path]) == 0
    out = capsys.readouterr().out
    assert "workers: 2 until 3.1 s, 3 until 4.0 s, 2 after" in out
    assert "6.00 s  resumed" in out
