"""Which ranks have a CPU to themselves (mpilb.mpi.cores): the rule, control-group quotas and the
MPILB_SPIN override (no MPI needed)."""

import os
import shutil
import socket
import subprocess
import sys

import pytest

import mpirun
from mpilb.mpi import cores
from mpilb.runfiles.summary import summarize_log
from mpilb.mpi.waiting import Backoff


def ranks(*specs):
    """(machine, cpus, usable) per rank; cpus None where the OS cannot say."""
    return [(h, None if c is None else sorted(c), u) for h, c, u in specs]


def test_unbound_ranks_have_a_cpu_each_only_when_there_are_enough():
    two = ranks(("a", {0, 1}, 2), ("a", {0, 1}, 2))
    assert all(cores.own_core(me, two) for me in two)
    four = ranks(*[("a", {0, 1}, 2)] * 4)   # this VM's test jobs: 4 ranks on 2 cores
    assert not any(cores.own_core(me, four) for me in four)


def test_ranks_bound_to_their_own_cpus_have_them_to_themselves():
    bound = ranks(*[("a", {i}, 1) for i in range(4)])
    assert all(cores.own_core(me, bound) for me in bound)
    stacked = ranks(*[("a", {0}, 1)] * 3)   # every rank bound to CPU 0
    assert not any(cores.own_core(me, stacked) for me in stacked)


def test_only_ranks_on_the_same_host_count():
    job = ranks(("a", {0, 1}, 2), ("a", {0, 1}, 2), ("b", {0, 1}, 2), ("b", {0, 1}, 2),
                ("c", {0}, 1), ("c", {0}, 1))
    assert [cores.own_core(me, job) for me in job] == [True] * 4 + [False] * 2


def test_without_affinity_every_rank_on_the_host_shares():
    job = ranks(("a", None, 4), ("a", None, 4), ("a", None, 4))
    assert cores.own_core(job[0], job)
    assert not cores.own_core(("a", None, 2), job)


def test_a_control_group_quota_caps_the_cpus(tmp_path, monkeypatch):
    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (v2 / "job" / "cpu.max").write_text("150000 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job\n")
    assert cores.cgroup_quota(str(v2), str(proc)) == pytest.approx(1.5)
    (v2 / "job" / "cpu.max").write_text("max 100000\n")
    assert cores.cgroup_quota(str(v2), str(proc)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "slurm").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "slurm" / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu,cpuacct" / "slurm" / "cpu.cfs_period_us").write_text("100000\n")
    proc.write_text("4:memory:/slurm\n3:cpu,cpuacct:/slurm\n")
    assert cores.cgroup_quota(str(v1), str(proc)) == pytest.approx(4.0)
    (v1 / "cpu,cpuacct" / "slurm" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cores.cgroup_quota(str(v1), str(proc)) is None
    assert cores.cgroup_quota(str(v1), str(tmp_path / "missing")) is None
    monkeypatch.setattr(cores, "cgroup_quota", lambda: 1.5)
    assert cores.usable_cpus() == 1   # a CPU and a half cannot keep two ranks busy


class Job:
    """allgather for a job of `n` ranks like this one on one host, none bound."""

    def __init__(self, n, rank=0):
        self.n = n
        self.rank = rank

    def Get_rank(self):
        return self.rank

    def allgather(self, me):
        return [me] * self.n


def test_a_store_polls_only_with_a_cpu_to_spare(monkeypatch):
    monkeypatch.delenv("MPILB_SPIN", raising=False)
    monkeypatch.setattr(cores, "cpu_set", lambda: frozenset({0, 1}))
    monkeypatch.setattr(cores, "usable_cpus", lambda: 2)
    assert cores.spinning(Job(2)) == [False, True]             # the server and a worker, 2 CPUs
    assert cores.spinning(Job(2), stores=[0, 1]) == [False, False]
    assert cores.spinning(Job(1)) == [True]                    # one rank, a CPU to spare
    assert cores.spinning(Job(3)) == [False, False, False]


@pytest.mark.parametrize("choice, n, spins", [("auto", 1, True), ("auto", 64, False),
                                              ("1", 64, True), ("0", 1, False)])
def test_start_waits_follows_the_rule_unless_told(monkeypatch, choice, n, spins):
    monkeypatch.setenv("MPILB_SPIN", choice)
    monkeypatch.setattr(cores, "usable_cpus", lambda: 2)
    monkeypatch.setattr(cores, "cpu_set", lambda: frozenset({0, 1}))
    monkeypatch.setattr(Backoff, "spin_s", 0.0)
    assert cores.start_waits(Job(n, rank=n - 1))[-1] is spins
    assert Backoff.spin_s == (cores.SPIN_S if spins else 0.0)


def test_this_machine_gives_a_sane_answer():
    assert 1 <= cores.usable_cpus() <= (os.cpu_count() or 1)


@pytest.mark.mpi
def test_doctor_says_which_ranks_poll_first():
    res = mpirun.run(2, "doctor", timeout=120)
    line = next(l for l in res.stdout.splitlines() if l.strip().startswith("waits"))
    if cores.usable_cpus() == 2:   # a CPU each, none to spare for rank 0
        assert "rank(s) 1 poll 10 ms before they sleep, rank(s) 0 sleep between polls" in line, line
    res = mpirun.run(2, "doctor", timeout=120, MPILB_SPIN="0")
    assert "every rank sleeps between polls (MPILB_SPIN=0 on rank 0)" in res.stdout, res.stdout


@pytest.mark.mpi
def test_ranks_told_to_poll_on_shared_cpus_still_train_exactly(synth_dir, tmp_path):
    """MPILB_SPIN=1 where four ranks share this machine's CPUs: slower, never stuck; with
    --store local, rows move between workers whose waits poll too."""
    log = tmp_path / "run.h5"
    res = mpirun.run(4, "train", "--data", synth_dir, "--epochs", "2", "--no-progress",
                     "--store", "local", "--inject", "3:compute=4", "--log", log,
                     MPILB_SPIN="1", timeout=180)
    assert res.returncode == 0, res.stderr
    s = summarize_log(str(log))
    cov = s["coverage"]
    assert s["status"] == "finished" and cov["applied"] == cov["expected"] > 0
    assert cov["duplicates"] == 0 and cov["missing"] == 0



@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")
def test_ranks_count_together_by_machine_not_host_name():
    """The nodes of a cluster in a box have their own host names on one machine's CPUs: a
    process under another host name is on the same machine (by host name, every rank of a
    box on 2 CPUs polled first: tests/cluster/test_doorbells.py)."""
    code = "import socket; from mpilb.mpi import cores; print(socket.gethostname(), cores.machine())"
    res = subprocess.run(["unshare", "--uts", "sh", "-c", f"hostname mpilb-other && {sys.executable} -c '{code}'"],
                         capture_output=True, text=True, timeout=30, env=mpirun.env())
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["mpilb-other", cores.machine()] != [socket.gethostname()] * 2
