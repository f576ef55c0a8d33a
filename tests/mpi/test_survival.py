"""A worker that dies does not end the job where the launcher lets the others run on
(`mpiexec -disable-auto-cleanup`, `srun --no-kill`); rank 0 stalls never count against the
workers; SIGUSR1 is a preemption unless it came with a rank's death (Hydra's notice)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mpirun

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _runs import alive, marked_processes  # noqa: E402  (the job's ranks by their mark, as hostile.py finds them)
from mpilb.data.dataset import open_dataset
from mpilb.runfiles.summary import summarize_log
from mpirun import recomputed_coverage

pytestmark = pytest.mark.mpi

SHIM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shim")


def train(data, tmp_path, *extra):
    return ["train", "--data", data, "--hidden", "16", "--no-progress",
            "--log", str(tmp_path / "run.h5"), *map(str, extra)]


def launch(cmd, tmp_path, env=None):
    """Start a job marked by a variable of its own, so its processes can be found later
    (Hydra starts every rank in a session of its own: no process group holds them all)."""
    env = dict(env or mpirun.env())
    env["MPILB_TEST_JOB"] = str(tmp_path)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path, start_new_session=True)
    proc.args_mark = str(tmp_path).encode()
    return proc


def job_processes(proc) -> dict[int, dict]:
    """pid -> environment of every live process of `proc`'s job."""
    return marked_processes(b"MPILB_TEST_JOB=" + proc.args_mark)


def finish(proc, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        time.sleep(0.5)
        left = list(job_processes(proc))
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    assert not left, f"processes left behind: {left}"
    return proc.returncode, out, err


def wait_ranks(proc, n, timeout=60) -> dict[int, int]:
    """PMI rank -> pid of the job's python processes, once all n run."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        found = {int(e[b"PMI_RANK"]): pid for pid, e in job_processes(proc).items()
                 if b"PMI_RANK" in e}
        if len(found) == n:
            return found
        time.sleep(0.1)
    raise AssertionError("ranks did not start")


wait_training = mpirun.wait_training


def assert_degraded_exact(tmp_path, data, epochs):
    s = summarize_log(str(tmp_path / "run.h5"))
    assert s["status"] == "degraded" and s["lost_workers"] == [2], s["status"]
    assert s["epochs_completed"] == epochs
    mine = recomputed_coverage(str(tmp_path / "run.h5"), open_dataset(data).shard_sizes)
    assert mine == s["coverage"] and mine["applied"] == mine["expected"], (mine, s["coverage"])
    assert mine["duplicates"] == mine["missing"] == 0


@pytest.mark.parametrize("launcher", ["mpiexec", "srun"])
def test_crashed_worker_is_survived(synth_dir, tmp_path, launcher):
    timeout = 3
    # the crash comes early and the run is long enough on a quiet machine too (4 epochs took
    # 0.7 s there, so a crash at 1.5 s came after the end)
    args = train(synth_dir, tmp_path, "--epochs", 12, "--inject", "2:crash@0.3",
                 "--worker-timeout", timeout)
    base = [sys.executable, "-m", "mpilb", *args]
    if launcher == "mpiexec":
        cmd = [mpirun.mpiexec(), "-disable-auto-cleanup", "-n", "4", *base]
        env = mpirun.env()
    else:
        cmd = [os.path.join(SHIM, "srun"), "--no-kill", "-n", "4", *base]
        env = mpirun.env(SLURM_SHIM_STATE=tmp_path / "slurm")
        env["PATH"] = os.pathsep.join([SHIM, env["PATH"]])
    proc = launch(cmd, tmp_path, env)
    code, out, err = finish(proc, timeout=120)
    assert code == 3, (code, out, err)
    assert "declared lost" in err and "notice of a failed rank" in err, err
    assert_degraded_exact(tmp_path, synth_dir, 12)
    # no hang in finalize: the end came within --worker-timeout + 10 s of the last epoch
    import h5py
    with h5py.File(tmp_path / "run.h5", "r") as f:
        assert float(f.attrs["wall_s"]) - float(f["epochs/t_end"][-1]) < timeout + 10


def supervised_ranks(proc, n, timeout=60) -> dict[int, int]:
    """PMI rank -> pid of the rank process itself (the child of its --survive-signals
    supervisor, which has the same environment), once all n run."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        procs = job_processes(proc)
        found = {}
        for pid, e in procs.items():
            try:
                with open(f"/proc/{pid}/stat", "rb") as fh:
                    ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
            except OSError:
                continue
            if b"PMI_RANK" in e and ppid in procs and procs[ppid].get(b"PMI_RANK") == e[b"PMI_RANK"]:
                found[int(e[b"PMI_RANK"])] = pid
        if len(found) == n:
            return found
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"supervised ranks did not start: {found}")


def test_a_worker_killed_by_sigkill_is_survived_with_survive_signals(synth_dir, tmp_path):
    """Hydra SIGKILLs every rank of a proxy when one of its children dies by a signal, even
    under -disable-auto-cleanup; under --survive-signals that child is the supervisor, which
    exits 137 instead: the job goes on without the rank, degraded, with exact coverage."""
    timeout, epochs = 3, 60
    cmd = [mpirun.mpiexec(), "-disable-auto-cleanup", "-n", "4", sys.executable, "-m", "mpilb",
           *train(synth_dir, tmp_path, "--epochs", epochs, "--worker-timeout", timeout,
                  "--survive-signals")]
    proc = launch(cmd, tmp_path)
    pids = supervised_ranks(proc, 4)
    wait_training(tmp_path / "run.h5", proc)
    os.kill(pids[2], signal.SIGKILL)
    code, out, err = finish(proc, timeout=120)
    assert code == 3, (code, out, err)
    assert "rank 2 (pid" in err and "was killed by SIGKILL" in err and "declared lost" in err, err
    assert_degraded_exact(tmp_path, synth_dir, epochs)


def test_survive_signals_passes_sigterm_on_to_the_ranks(synth_dir, tmp_path):
    """The ranks run in process groups of their own: a SIGTERM to mpiexec (passed to each
    supervisor's group) reaches every rank once, through its supervisor: a preemption."""
    cmd = [mpirun.mpiexec(), "-disable-auto-cleanup", "-n", "3", sys.executable, "-m", "mpilb",
           *train(synth_dir, tmp_path, "--epochs", 500, "--worker-timeout", 5,
                  "--survive-signals")]
    proc = launch(cmd, tmp_path)
    supervised_ranks(proc, 3)
    wait_training(tmp_path / "run.h5", proc)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, timeout=60)
    assert code == 0, (code, out, err)
    s = summarize_log(str(tmp_path / "run.h5"))
    assert s["status"] == "preempted" and s["lost_workers"] == [], err
    assert (tmp_path / "run.ckpt.h5").exists()


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_the_ranks_end_themselves_when_rank_0_is_gone(synth_dir, tmp_path, fault):
    """Rank 0 stopped (or killed, its supervisor exiting 137 so that Hydra keeps the rest):
    no one else ends the job, so every worker and the parameter store (rank 1) ends itself,
    one line and exit 1, within --worker-timeout + 10 s of rank 0's last word."""
    from mpilb.mpi.watchdog import limit

    timeout = 2
    cmd = [mpirun.mpiexec(), "-disable-auto-cleanup", "-n", "5", sys.executable, "-m", "mpilb",
           *train(synth_dir, tmp_path, "--epochs", 500, "--worker-timeout", timeout,
                  "--servers", 2, "--survive-signals")]
    proc = launch(cmd, tmp_path)
    pids = supervised_ranks(proc, 5)
    wait_training(tmp_path / "run.h5", proc)
    t0 = time.monotonic()
    os.kill(pids[0], getattr(signal, fault))
    others = [pids[r] for r in range(1, 5)]
    while time.monotonic() - t0 < limit(timeout) + 10 and any(alive(p) for p in others):
        time.sleep(0.2)
    took = time.monotonic() - t0
    left = [p for p in others if alive(p)]
    if fault == "SIGSTOP":
        os.kill(pids[0], signal.SIGKILL)
    code, out, err = finish(proc, timeout=60)
    assert not left, (left, err)
    assert limit(timeout) - 1 < took < limit(timeout) + 5, (took, err)
    assert err.count("nothing from rank 0 for") == 4, err
    for r in range(1, 5):
        assert f"rank {r}: nothing from rank 0" in err, err



def test_sigusr1_to_every_rank_is_still_a_preemption(synth_dir, tmp_path):
    """Slurm's --signal=USR1 reaches every task; no rank died, so it preempts (exit 0)."""
    cmd = [mpirun.mpiexec(), "-disable-auto-cleanup", "-n", "4", sys.executable, "-m", "mpilb",
           *train(synth_dir, tmp_path, "--epochs", 50, "--worker-timeout", 5,
                  "--inject", "*:delay=0.001")]   # paced: outlives the signal on a fast machine
    proc = launch(cmd, tmp_path)
    pids = wait_ranks(proc, 4)
    wait_training(tmp_path / "run.h5", proc)
    t0 = time.monotonic()
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR1)
    code, out, err = finish(proc, timeout=60)
    assert code == 0, (code, out, err)
    assert time.monotonic() - t0 < 30
    s = summarize_log(str(tmp_path / "run.h5"))
    assert s["status"] == "preempted" and s["lost_workers"] == []
    assert (tmp_path / "run.ckpt.h5").exists()


def test_rank0_stopped_for_twice_the_timeout_loses_no_worker(synth_dir, tmp_path):
    timeout = 2
    cmd = mpirun.mpilb_cmd(4, *train(synth_dir, tmp_path, "--epochs", 500, "--max-seconds", 8,
                                     "--worker-timeout", timeout))
    proc = launch(cmd, tmp_path)
    pids = wait_ranks(proc, 4)
    wait_training(tmp_path / "run.h5", proc)
    os.kill(pids[0], signal.SIGSTOP)
    time.sleep(2 * timeout)
    os.kill(pids[0], signal.SIGCONT)
    code, out, err = finish(proc, timeout=120)
    assert code == 0, (code, out, err)
    s = summarize_log(str(tmp_path / "run.h5"))
    assert s["status"] == "finished" and s["lost_workers"] == [], err


# ---------------------------------------------------------------- the parts, without MPI
class _Peer:
    def __init__(self, rank):
        from mpilb.mpi import wire

        self.rank, self.step, self.lost, self.stopped, self.last_seen = rank, 0, False, False, 0.0
        self.left = False   # (let go: server/roster.py)
        self.link = type("Link", (), {"recv_req": None, "recv": wire.new_message(0)})()
        self.link.recv[1][wire.Push.KIND] = wire.PushKind.GRAD   # a push arrived


def test_a_usr1_vote_counts_only_pushes_sent_after_the_signal():
    """A worker that died right after a push has that push still on its way: it must not
    count as heard from, or Hydra's notice of its death is taken for a preemption."""
    from types import SimpleNamespace

    from mpilb.server.stopsignals import StopSignals
    from mpilb.run.signals import PREEMPTED

    peers = {1: _Peer(1), 2: _Peer(2)}
    roster = SimpleNamespace(peers=peers, present=lambda: list(peers.values()))
    signals = StopSignals(None, roster, SimpleNamespace(now=lambda: 1.0))
    PREEMPTED.clear()
    try:
        signals.report(0, signal.SIGUSR1)
        for p in peers.values():
            p.step += 1            # each one's push in flight at the signal arrives
        assert signals.judge(preempted=False) is None
        assert not PREEMPTED.is_set()
        peers[1].step += 1  # rank 1 pushed again: alive; rank 2 not yet
        signals.judge(preempted=False)
        assert not PREEMPTED.is_set()
        signals.report(2, signal.SIGUSR1)   # rank 2 reports the signal itself: all alive
        signals.judge(preempted=False)
        assert PREEMPTED.is_set()
    finally:
        PREEMPTED.clear()


def test_a_usr1_after_mpi_reported_a_worker_dead_is_its_notice_not_a_preemption():
    """With the dead worker's failed receive seen at once (before Hydra's SIGUSR1 for the
    same death arrives), the vote started by the signal no longer expects the dead rank and
    passed on the others' pushes: `preempted`, exit 0, in 3 of 5 runs of the command above."""
    from types import SimpleNamespace

    from mpilb.server.liveness import Liveness
    from mpilb.server.stopsignals import StopSignals
    from mpilb.run.signals import PREEMPTED

    peers = {1: _Peer(1), 2: _Peer(2)}
    roster = SimpleNamespace(peers=peers, lost=[],
                             present=lambda: [p for p in peers.values() if not p.lost])
    signals = StopSignals(None, roster, SimpleNamespace(now=lambda: 1.0))
    liveness = Liveness(
        SimpleNamespace(worker_timeout=60.0), roster,
        ledger=SimpleNamespace(take_back=lambda r, lost: None, holders=None),
        balancer=SimpleNamespace(remove_worker=lambda r: None),
        remote=SimpleNamespace(lose=lambda r: None), bell=SimpleNamespace(forget=lambda r: None),
        outbox=None, tracker=None, stop=None, signals=signals, log_shards=lambda: None,
        after_loss=lambda: None)
    peers[2].lose = lambda: setattr(peers[2], "lost", True)
    PREEMPTED.clear()
    try:
        liveness.declare_lost(peers[2], "ended (MPI: receive failed, nothing received)")
        signals.report(0, signal.SIGUSR1)
        signals.report(1, signal.SIGUSR1)
        peers[1].step += 2   # rank 1 goes on pushing
        signals.judge(preempted=False)
        assert not PREEMPTED.is_set()
    finally:
        PREEMPTED.clear()


def test_a_receive_mpi_fails_declares_its_worker_lost_at_once():
    """Under -disable-auto-cleanup MPICH may fail a dead worker's receive (MPI_ERR_IN_STATUS
    from Testsome) instead of leaving it pending: that worker is lost, the rest go on."""
    from mpilb.mpi import comm as C
    from mpilb.server.receive import Receiver

    class Req:
        def __init__(self, outcome):
            self.outcome = outcome

        def Test(self):
            if self.outcome == "fail":
                raise C.MPIError(C.MPI.ERR_OTHER)
            return self.outcome == "done"

    lost = []

    def declare_lost(w, why=""):
        lost.append((w.rank, why))
        w.lost = True

    order = [_Peer(1), _Peer(2), _Peer(3)]
    reqs = [Req("done"), Req("fail"), Req("pending")]
    receiver = Receiver(None, None, None, None, None, declare_lost)
    assert receiver.failed(order, reqs) == [0]
    assert [r for r, _ in lost] == [2] and "ended (MPI: " in lost[0][1]
    assert reqs[1] == C.REQUEST_NULL and order[1].link.recv_req == C.REQUEST_NULL
    assert C.finished(Req("fail")) and not C.finished(Req("pending"))


def test_a_receive_mpi_failed_and_freed_is_not_taken_for_the_previous_push_again():
    """The cause of "rank 2: batch [1504, 1536) of shard 0 lies outside its task [1536, 1600):
    dropped" (2 of 9 runs of `mpiexec -disable-auto-cleanup -n 4 ... --inject 2:crash@1`).
    Rank 2 pushed [1504, 1536) and died; rank 0 applied the push and posted the next receive.
    A Testsome then failed (MPI_ERR_IN_STATUS) and, as MPI does, freed every request it
    completed: rank 1's, which got a push, and rank 2's failed one. Both handles are
    MPI_REQUEST_NULL, which tests as complete, so rank 2's buffer, still holding the push of
    [1504, 1536), was handled a second time; its receive posted again never completed, and
    rank 2 was declared lost only after --worker-timeout. The buffer tells them apart."""
    from mpilb.mpi import comm as C
    from mpilb.mpi import wire
    from mpilb.core.balancer import BalancerConfig, build_balancer
    from mpilb.server.peers import Link, Peer
    from mpilb.server.receive import Receiver
    from mpilb.core.tasks import TaskLedger

    class Req:
        def __init__(self, outcome):
            self.outcome = outcome

        def Test(self):
            return self.outcome == "done"   # a freed request (MPI_REQUEST_NULL) is "done"

    class Comm:
        def Irecv(self, buf, source, tag):
            return Req("pending")

    lost = []

    def declare_lost(w, why=""):
        lost.append((w.rank, why))
        w.lose()

    server = Receiver(Comm(), None, None, None, None, declare_lost)
    order = [Peer(r, link=Link.allocate(4, True)) for r in (1, 2)]
    ledger = TaskLedger(build_balancer("static", [1, 2], [1600], BalancerConfig(batch=32)),
                        [1600], (1, 2))
    ledger.assign(2, 0, 1504, 1600)
    push = dict(step=47, version=1343, epoch=0, shard=0, lo=1504, hi=1536, batch=32, loss=1.0,
                compute_s=0.0, io_s=0.0, comm_s=0.0, idle_s=0.0, nonfinite=False, t=1.0)
    wire.encode_push(order[1].link.recv[1], **push)   # rank 2's last push arrives
    assert ledger.matches(2, 0, 0, 1504, 1536) and not ledger.advance(2, 1536)
    server.post(order[1])                       # and its next receive is posted
    server.post(order[0])
    wire.encode_push(order[0].link.recv[1], **{**push, "lo": 0, "hi": 32})   # rank 1's push
    # the failed Testsome freed rank 1's completed request and rank 2's failed one
    reqs = [Req("done"), Req("done")]
    assert server.failed(order, reqs) == [0]
    assert [r for r, _ in lost] == [2] and "ended (MPI: " in lost[0][1]
    assert reqs[1] == C.REQUEST_NULL
    # handled again, the old push would have been the batch "outside its task": dropped
    assert ledger.matches(2, 0, 0) and not ledger.matches(2, 0, 0, 1504, 1536)


def test_a_failed_send_to_a_dead_worker_frees_its_parameter_buffer():
    """The server's ParamRing tests its sends with comm.finished: a send MPI failed (its
    worker died) is done, and does not raise out of the optimizer step."""
    import numpy as np

    from mpilb.mpi import comm as C
    from mpilb.core.corrections import build_correction
    from mpilb.core.optimizers import build_optimizer
    from mpilb.server.modes import ParamRing

    class FailedSend:
        def Test(self):
            raise C.MPIError(C.MPI.ERR_OTHER)

    store = ParamRing(np.zeros(4, np.float32), build_optimizer("sgd", 4, lr=0.5),
                       build_correction("none"), nominal_batch=1, finished=C.finished)
    store.sending(FailedSend(), rank=2)
    assert store._target() == store.cur and store.pending() == []


def test_a_supervisor_exits_with_a_status_for_a_rank_killed_by_a_signal():
    """What the launcher sees: the rank's own exit code, or 128 + N for signal N."""
    from mpilb.run.supervise import exit_status

    assert exit_status(9) == (137, 9)          # killed by SIGKILL
    assert exit_status(15) == (143, 15)        # killed by SIGTERM
    assert exit_status(3 << 8) == (3, None)    # exit(3)
    assert exit_status(0) == (0, None)


def test_a_sigterm_that_reached_every_rank_but_a_silent_one_came_with_its_death():
    """Open MPI's mpirun sends SIGTERM to the survivors of a dead rank and SIGKILL 1 s later:
    the rank that the others' reports show missing, silent since the signal, is taken as
    ended half that grace after it (and the loss of any rank that did not report it fails
    the vote); a SIGTERM that no worker reported went to rank 0 alone, a preemption."""
    from mpilb.server.vote import SignalVote

    peers = {r: _Peer(r) for r in (1, 2, 3)}
    vote = SignalVote.start(signal.SIGTERM, 1.0, 100.0, peers.values(), kill_grace=1.0)
    vote.report(0)
    assert vote.ended(peers, 101.0) is None and not vote.came_with_loss(2)   # rank 0 alone
    vote.report(1)
    vote.report(3)
    assert vote.ended(peers, 100.2) is None      # too early to tell
    assert vote.ended(peers, 100.6) == 2
    assert vote.came_with_loss(2) and not vote.came_with_loss(1)
    peers[2].last_seen = 100.1                   # it pushed after the signal: alive
    assert vote.ended(peers, 100.6) is None
    assert "not a preemption" in vote.loss_text(2) and "rank(s) 1, 3" in vote.loss_text(2)
    # rank 0 acted on its own SIGTERM and stopped 1 and 3 at their pushes before their
    # reports came: those still count (the vote expects only rank 2 then)
    peers[2].last_seen = 0.0
    late = SignalVote.start(signal.SIGTERM, 1.0, 100.0, [peers[2]], kill_grace=1.0)
    late.report(0)
    late.report(1)
    late.report(3)
    assert late.ended(peers, 100.6) == 2 and late.came_with_loss(2)
    assert "rank(s) 1, 3" in late.loss_text(2)
    usr1 = SignalVote.start(signal.SIGUSR1, 1.0, 100.0, [peers[2]])
    usr1.report(1)
    assert usr1.reported == set()   # (a SIGUSR1's vote counts those present only)
    no_grace = SignalVote.start(signal.SIGTERM, 1.0, 100.0, peers.values())
    no_grace.report(1)
    assert no_grace.ended(peers, 1000.0) is None  # elsewhere: --worker-timeout decides


def test_a_push_from_a_link_that_kept_rank_0_waiting_is_taken_once_its_chunks_are_in(monkeypatch):
    """Rank 0 streams a push's slice chunk by chunk, waiting for each chunk: a worker behind
    a slow link held it (and every other worker) for each of its pushes. A worker's first
    push, and its next after one whose chunks kept rank 0 waiting over DEFER_S, is taken
    when its chunks are all in (its header is held meanwhile); one that then came at once
    is streamed again."""
    from types import SimpleNamespace

    from mpilb.core.decisions import DEFER_S
    from mpilb.mpi import comm as C
    from mpilb.server import receive as R
    from mpilb.server.peers import Link, Peer

    w = Peer(1, link=Link.allocate(4, True))
    assert w.link.defer   # from its first push: a slow link's would hold rank 0 unknown
    chunks_in = [False]
    handed = []

    class Waits:
        def all_in(self, link):
            return chunks_in[0]

        def finish(self, link, lost):
            return True

        def post(self, link, comm, source):
            link.rest = ["chunk"]

    class Comm:
        def Irecv(self, buf, source, tag):
            return "header"

    arrivals = iter([[0], None, None, None])
    fake = SimpleNamespace(**{k: getattr(C, k) for k in dir(C) if not k.startswith("__")})
    fake.Request = SimpleNamespace(Testsome=lambda reqs: next(arrivals, None))
    monkeypatch.setattr(R, "C", fake)
    bell = SimpleNamespace(took=lambda r: None, rings_with=lambda r: False, via=lambda r: None,
                           enabled=False)
    roster = SimpleNamespace(peers={1: w})
    receiver = R.Receiver(Comm(), roster, bell, SimpleNamespace(in_flight=lambda: False),
                          SimpleNamespace(settle=lambda r: None), None,
                          slices=SimpleNamespace(waits=Waits()))
    w.link.rest = ["chunk"]
    chores = SimpleNamespace(next_push_due=lambda: (None, 0.0, None), run=lambda: None,
                             CHORES_S=0.01, CHORES_RUNG_S=0.025, RUNG_NAP_S=0.1)
    steps = []

    def done():
        steps.append(1)
        if len(steps) == 3:
            assert handed == [] and 1 in receiver.deferred   # its header is in, chunks not
            chunks_in[0] = True
        return bool(handed)

    receiver.serve(done, lambda peer: handed.append(peer.rank), chores)
    assert handed == [1] and not receiver.deferred
    assert not w.link.defer   # its chunks came at once: the next push streams again
    w.link.waited = 0.5       # ... and kept rank 0 waiting: deferred again after it
    receiver._take(w, 0, [None], lambda peer: None)
    assert w.link.defer
    # a deferred push whose chunks came at once and whose step took long: the step is not
    # a wait for its chunks, and the next push streams
    receiver.deferred[1] = (0, time.monotonic())
    receiver._take(w, 0, [None], lambda peer: time.sleep(3 * DEFER_S))
    assert not w.link.defer
