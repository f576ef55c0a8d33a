"""Rank 0's membership bookkeeping (server/roster.py) with fake peers: leave requests, their
refusals, the request files of `mpilb leave`, and the `members/` rows. No MPI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from mpilb.core.worker_state import Membership, Waiting
from mpilb.server.peers import Peer, Roster
from mpilb.runfiles.requests import answer_of, requests_dir
from mpilb.server.roster import Members


class FakeLog:
    def __init__(self, path=""):
        self.path = path
        self.rows = []

    def append(self, group, **row):
        self.rows.append((group, row))


def members(ranks=(1, 2, 3), path="", stop_reason=None):
    roster = Roster({r: Peer(rank=r, waiting=Waiting.COMPUTING) for r in ranks})
    sent, handed, logged = [], [], []
    m = Members(FakeLog(path), SimpleNamespace(now=lambda: 2.5), roster, [0, 0, 1, 1],
                SimpleNamespace(reason=stop_reason), hand_back=handed.append,
                send_leave=sent.append, log_row=logged.append)
    return m, roster, sent, handed, logged


def test_a_computing_worker_leaves_at_its_reply_an_idle_one_at_once():
    m, roster, sent, handed, logged = members()
    assert m.request(2, "SIGUSR2") == "rank 2 leaves after its current step"
    w = roster.peers[2]
    assert w.leaving and w.present and not sent   # its push is still to come
    m.depart(w)   # (the server does this where its reply would go)
    assert w.membership is Membership.LEFT and not w.present and not w.lost
    assert sent == [w] and handed == [w] and logged == [w] and m.left == [2]
    assert m.log.rows == [("members", dict(t=2.5, worker=2, node=1, event="leave"))]
    assert roster.lost == [] and not roster.all_stopped()

    roster.peers[3].go_idle()
    m.request(3, "mpilb leave")
    assert roster.peers[3].left and m.left == [2, 3]   # idle: no push to wait for


def test_refusals_leave_the_worker_in_the_run():
    m, roster, sent, *_ = members(ranks=(1, 2))
    assert m.request(5, "x").startswith("refused: rank 5 is not a worker")
    roster.peers[1].lose()
    assert m.request(1, "x") == "refused: rank 1 was lost"
    assert "is the last worker" in m.request(2, "x")
    assert not roster.peers[2].leaving and not sent
    stopping, roster, *_ = members(stop_reason="epochs")
    assert stopping.request(1, "x").startswith("refused: the run is stopping (epochs)")
    m, roster, *_ = members()
    m.request(1, "x")
    assert m.request(1, "x") == "rank 1 is leaving already"
    m.depart(roster.peers[1])
    assert m.request(1, "x") == "refused: rank 1 has left the run already"


def test_requests_from_files_are_answered_and_the_directory_goes_at_the_end(tmp_path):
    log = str(tmp_path / "run.h5")
    m, roster, *_ = members(path=log)
    where = requests_dir(log)
    os.makedirs(where)
    for name in ("leave-2", "leave-9", "leave-x"):
        open(os.path.join(where, name), "w").close()
    m.poll(0.0)
    assert answer_of(os.path.join(where, "leave-2")) == "rank 2 leaves after its current step"
    assert answer_of(os.path.join(where, "leave-9")).startswith("refused: rank 9 is not a worker")
    assert answer_of(os.path.join(where, "leave-x")) == "refused: leave-x names no rank"
    assert sorted(os.listdir(where)) == ["leave-2.answer", "leave-9.answer", "leave-x.answer"]
    assert roster.peers[2].leaving
    for name in os.listdir(where):
        os.unlink(os.path.join(where, name))   # (what mpilb leave does once it read them)
    open(os.path.join(where, "leave-3"), "w").close()   # came too late
    m.close()
    assert os.listdir(where) == ["leave-3.answer"]
    assert answer_of(os.path.join(where, "leave-3")) == "refused: the run has ended"
    os.unlink(os.path.join(where, "leave-3.answer"))
    m.close()
    assert not os.path.exists(where)


def test_requests_left_by_a_killed_run_of_the_same_log_are_not_taken(tmp_path):
    log = str(tmp_path / "run.h5")
    os.makedirs(requests_dir(log))
    open(os.path.join(requests_dir(log), "leave-2"), "w").close()
    m, roster, *_ = members(path=log)
    m.poll(0.0)
    assert not roster.peers[2].leaving and not os.path.exists(requests_dir(log))


def test_with_a_local_store_a_worker_holding_the_only_copy_of_a_shard_stays():
    from mpilb.server.roster import sole_copies

    ledger = SimpleNamespace(holders={0: [1], 1: [2], 2: [1, 2], 3: [3, 2]}, gone={3})
    assert sole_copies(ledger, 1) == [0]
    assert sole_copies(ledger, 2) == [1, 3]
    assert sole_copies(SimpleNamespace(holders=None, gone=set()), 1) == []
    m, roster, sent, *_ = members()
    m.sole_copies = lambda rank: [0, 4]
    answer = m.request(1, "x")
    assert answer.startswith("refused: rank 1 holds the only copy left of shard(s) 0, 4 (--store local")
    assert not roster.peers[1].leaving


def test_a_request_written_after_the_runs_end_is_refused_at_once(synth_dir, tmp_path, monkeypatch):
    """`mpilb leave` (and `mpilb join`) that found the run running, then wrote its request
    after rank 0 had answered the requests there at its end: refused in one line, exit 2,
    within a second, its request and the directory removed (before: it waited 30 s for an
    answer and ended with exit 1, "no answer from the run"; seen in the churn test on a
    fast machine)."""
    from mpilb.cli import membership
    from mpilb.errors import UsageError
    from mpilb.runfiles.summary import open_log

    log = tmp_path / "run.h5"
    done = subprocess.run([sys.executable, "-m", "mpilb", "train", "--data", synth_dir, "--model",
                           "softmax", "--epochs", "1", "--no-progress", "--log", str(log)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    attrs, cols = open_log(str(log))
    attrs = dict(attrs, world_size=3)
    monkeypatch.setattr(membership, "_running", lambda *a, **k: (attrs, cols))  # (it was running)
    t0 = time.monotonic()
    with pytest.raises(UsageError, match="the run has ended \\(status finished\\): it has no worker"):
        membership.leave(str(log), 2)
    assert time.monotonic() - t0 < 2.0
    assert not os.path.exists(requests_dir(str(log)))
