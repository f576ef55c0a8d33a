"""Doorbells (mpilb/mpi/doorbell.py): rings wake a sleeping rank, stale rings cost nothing, a rank
that cannot ring keeps polling, and a job trains the same with them off."""

from __future__ import annotations

import ast
import secrets
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from mpilb.mpi import doorbell
from mpilb.mpi.doorbell import Doorbell
from mpilb.runfiles.summary import summarize_log

import mpirun

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets")


@pytest.fixture
def pair():
    """Rank 0 and rank 1 bells on this process, ringing each other."""
    prefix = f"\0mpilb-test-{secrets.token_hex(6)}-"
    bells = []
    for rank, peers in ((0, (1,)), (1, (0,))):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(prefix + str(rank))
        sock.setblocking(False)
        bells.append(Doorbell(sock, rank, prefix, peers))
    yield bells
    for b in bells:
        b.close()


@linux_only
def test_a_ring_ends_a_wait_at_once_and_silence_times_out(pair):
    server, worker = pair
    t = time.monotonic()
    assert server.wait(0.05) == 0
    assert time.monotonic() - t >= 0.04
    worker.ring(0)
    t = time.monotonic()
    assert server.wait(5.0) == 1
    assert time.monotonic() - t < 1.0    # woken by the ring, not the timeout
    assert server.owed == {1}             # its message is announced, not taken
    server.took(1)
    assert server.owed == set()


@linux_only
def test_a_ring_for_a_message_already_taken_is_stale(pair):
    server, worker = pair
    worker.ring(0)
    worker.ring(0)
    server.took(1)   # MPI found both pushes before the rings were read
    server.took(1)
    assert server.wait(1.0) == 2
    assert server.owed == set()


@linux_only
def test_rest_polls_for_an_announced_message_until_it_comes(pair, monkeypatch):
    server, worker = pair
    worker.ring(0)
    assert server.wait(1.0) == 1
    slept = []
    monkeypatch.setattr(doorbell.time, "sleep", lambda s: slept.append(s))
    for _ in range(doorbell.Backoff.FREE_POLLS):
        server.rest(10.0)                 # announced, not taken: polled again at once...
    assert slept == []
    server.rest(10.0)                     # ...then with short sleeps, no long one
    assert slept == [1e-6]
    monkeypatch.undo()
    server.owed_until = time.monotonic() - 1.0   # late (its sender lost its core a while)
    naps = []
    for _ in range(8):
        t = time.monotonic()
        server.rest(10.0)
        naps.append(time.monotonic() - t)
    assert server.owed == {1}                    # still expected: it was sent
    assert max(naps) < doorbell.OWED_NAP_S + 0.02 and sum(naps) < 0.1   # woke often, not once in 10 s
    server.took(1)                               # it came: the numbering is the sender's
    assert server.owed == set() and server.taken[1] == server.heard[1] == 1
    worker.ring(0)                               # and its next ring is owed again
    server.wait(1.0)
    assert server.owed == {1}
    server.forget(1)                             # a lost sender: nothing more to wait for
    assert server.owed == set()
    t = time.monotonic()
    server.rest(0.05)
    assert time.monotonic() - t >= 0.04


@linux_only
def test_a_late_message_does_not_make_later_rings_look_stale(pair, monkeypatch):
    """Rank 0 once gave up on a rung push after 2 ms and counted it as taken; when it came,
    the count ran ahead, every later ring looked stale, and rank 0 slept through each push
    still in transfer (up to its 100 ms nap): a one-worker epoch took 14.6 s, not 1.6."""
    server, worker = pair
    worker.ring(0)                       # push 1 announced...
    server.wait(1.0)
    server.owed_until = time.monotonic() - 1.0
    server.rest(0.001)                   # ...late...
    server.took(1)                       # ...then taken
    worker.ring(0)                       # push 2 announced, not visible to MPI yet
    server.wait(1.0)
    assert server.owed == {1}            # owed: rank 0 polls for it instead of resting
    t = time.monotonic()
    server.rest(10.0)
    assert time.monotonic() - t < 0.05


@linux_only
def test_rings_go_only_to_peers_and_a_silent_bell_just_sleeps(pair):
    server, worker = pair
    worker.ring(5)                        # not a peer: nothing is sent
    assert server.wait(0.01) == 0
    silent = Doorbell()
    assert not silent.enabled and not silent.rings_with(0)
    silent.ring(0)
    t = time.monotonic()
    assert silent.wait(0.02) == 0 and time.monotonic() - t >= 0.015


def test_a_backoff_naps_on_its_bell(pair, monkeypatch):
    from mpilb.mpi.waiting import Backoff

    server, worker = pair
    b = Backoff(bell=server)
    assert b.bell is server and b.nap == server.wait
    assert Backoff(bell=Doorbell()).nap is time.sleep   # a silent bell: plain sleeps


OPEN_SCRIPT = textwrap.dedent("""
    from mpilb.mpi import comm as C, doorbell
    comm, rank, size = C.world()
    bell = doorbell.open_job(comm, rank, size)
    rows = comm.gather((rank, int(bell.enabled), sorted(bell.peers)), root=0)
    if rank == 0:
        print(repr(rows), flush=True)
""")


@pytest.mark.mpi
@pytest.mark.parametrize("off", [False, True])
def test_open_job_pairs_rank_0_with_every_rank_on_its_node(tmp_path, off):
    script = tmp_path / "bells.py"
    script.write_text(OPEN_SCRIPT)
    extra = {"MPILB_DOORBELL": "0"} if off else {}
    res = subprocess.run([mpirun.mpiexec(), "-n", "3", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=60, env=mpirun.env(**extra))
    assert res.returncode == 0, res.stderr
    rows = ast.literal_eval(res.stdout.strip().splitlines()[-1])
    if off or not sys.platform.startswith("linux"):
        assert [enabled for _, enabled, _ in rows] == [0, 0, 0]
    else:
        assert rows == [(0, 1, [1, 2]), (1, 1, [0]), (2, 1, [0])]


@pytest.mark.mpi
def test_a_job_without_doorbells_trains_with_exact_coverage(synth_dir, tmp_path):
    log = tmp_path / "run.h5"
    res = mpirun.run(4, "train", "--data", synth_dir, "--epochs", "2", "--no-progress",
                     "--log", log, MPILB_DOORBELL="0")
    assert res.returncode == 0, res.stderr
    s = summarize_log(str(log))
    cov = s["coverage"]
    assert s["status"] == "finished" and cov["applied"] == cov["expected"] > 0
    assert cov["duplicates"] == 0 and cov["missing"] == 0


@linux_only
def test_a_poke_asks_for_progress_and_announces_no_message(pair):
    server, worker = pair
    worker.poke(0)
    assert server.wait(1.0) == 1
    assert server.take_poke() and not server.take_poke()
    assert server.owed == set() and server.heard == {}   # no message to wait for
    worker.ring(0)                                       # the numbering is not disturbed
    assert server.wait(1.0) == 1 and server.heard == {1: 1}


@linux_only
def test_a_message_counted_without_a_ring_keeps_the_numbering(pair):
    server, worker = pair
    server.ring(1, wake=False)   # a reply the worker polls for: counted, not sent
    assert worker.wait(0.01) == 0
    worker.took(0)               # it found the reply itself
    server.ring(1)               # the next one is rung as message 2
    assert worker.wait(1.0) == 1 and worker.heard == {0: 2} and worker.owed == {0}
    worker.took(0)
    assert worker.owed == set()


MIXED_SCRIPT = textwrap.dedent("""
    import os, socket, sys
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 2:   # this rank cannot bind its socket: it must poll
        def refuse(self, *a):
            raise OSError("no sockets here")
        socket.socket.bind = refuse
    from mpilb.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.mpi
def test_a_rank_that_cannot_ring_trains_alongside_ranks_that_do(synth_dir, tmp_path):
    """Rank 2 has no doorbell: rank 0 polls (its naps still end on the others' rings) and
    the run is exact."""
    script = tmp_path / "mixed.py"
    script.write_text(MIXED_SCRIPT)
    log = tmp_path / "run.h5"
    res = subprocess.run([mpirun.mpiexec(), "-n", "4", sys.executable, str(script), "train",
                          "--data", synth_dir, "--epochs", "2", "--no-progress", "--log", str(log)],
                         capture_output=True, text=True, timeout=120, env=mpirun.env())
    assert res.returncode == 0, res.stderr
    s = summarize_log(str(log))
    cov = s["coverage"]
    assert s["status"] == "finished" and cov["applied"] == cov["expected"] > 0
    assert cov["duplicates"] == 0 and cov["missing"] == 0
    assert all(w["samples"] > 0 for w in s["per_worker"])


def test_rank_0_resting_on_network_rings_wakes_when_a_push_is_due():
    """A ring over UDP may be lost: rank 0 looks for the push it expects at its due time
    (plus grace), not only at its next chores' nap (RUNG_NAP_S, 100 ms)."""
    from types import SimpleNamespace

    from mpilb.mpi import comm as C
    from mpilb.server.receive import Receiver

    class Bell:
        enabled = True

        def __init__(self, via):
            self.via_, self.rests = via, []

        def rings_with(self, rank):
            return True

        def via(self, rank):
            return self.via_

        def rest(self, longest):
            self.rests.append(longest)

        def wait(self, timeout):
            return 0

        def took(self, rank):
            pass

        def take_poke(self):
            return False

    class Chores:
        CHORES_S, CHORES_RUNG_S, RUNG_NAP_S = 0.01, 0.025, 0.1

        def next_push_due(self):
            return time.monotonic() + 0.01, 0.002, 0.05

        def run(self):
            pass

    for via, longest in ((doorbell.NETWORK, 0.012), (doorbell.LOCAL, 0.1)):
        w = SimpleNamespace(rank=1, link=SimpleNamespace(recv_req=C.REQUEST_NULL))
        bell = Bell(via)
        outbox = SimpleNamespace(in_flight=lambda: False)
        receiver = Receiver(None, SimpleNamespace(peers={1: w}), bell, outbox, None, None)
        receiver.serve(lambda: len(bell.rests) >= 2, None, Chores())
        assert abs(bell.rests[-1] - longest) < 0.005, (via, bell.rests)
