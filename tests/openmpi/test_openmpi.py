"""mpilb under Open MPI: Debian's Open MPI 4 with mpi4py built from source against it, in a
virtual environment of its own (.ci/run makes it; MPILB_OMPI_PYTHON names its python,
default /opt/mpilb-ompi/bin/python). A subset of the MPI scenarios: a digits run with exact
coverage, --servers 2, a preemption, and a crashed or killed worker (and a killed rank 0)
with and without the flags that let Open MPI's mpirun keep the other ranks running
(docs/faults.md). Skips without it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import pytest

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))
from mpirun import wait_training as wait_for_updates  # noqa: E402
from mpirun import recomputed_coverage  # noqa: E402
from mpilb.data.dataset import open_dataset  # noqa: E402
from mpilb.runfiles.summary import summarize_log  # noqa: E402

pytestmark = pytest.mark.mpi

PYTHON = os.environ.get("MPILB_OMPI_PYTHON", "/opt/mpilb-ompi/bin/python")
MPIRUN = os.environ.get("MPILB_OMPI_MPIRUN") or shutil.which("mpirun.openmpi") or ""
# the documented flag: a rank's non-zero exit does not end the job (docs/faults.md)
SURVIVE = ["--mca", "orte_abort_on_non_zero_status", "0"]
# and mpilb's, for a rank killed by a signal: mpirun's exit code would be 128 + N otherwise
SIGNALS = ["--survive-signals"]


def _why_not() -> str | None:
    if not os.path.exists(PYTHON):
        return f"no Open MPI environment at {PYTHON} (.ci/run builds it; or set MPILB_OMPI_PYTHON)"
    if not MPIRUN:
        return "no mpirun.openmpi on PATH (apt-get install openmpi-bin; or set MPILB_OMPI_MPIRUN)"
    probe = subprocess.run([PYTHON, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
                           capture_output=True, text=True, timeout=60)
    if not probe.stdout.startswith("Open MPI"):
        return f"{PYTHON}'s mpi4py is not on Open MPI: {(probe.stdout or probe.stderr).strip()[:120]}"
    return None


WHY = _why_not()
if WHY is not None:
    pytest.skip(WHY, allow_module_level=True)


def env() -> dict:
    e = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             PYTHONPATH=str(TESTS.parent))   # this checkout's mpilb
    e.setdefault("MPILB_CACHE", str(TESTS.parent / ".mpilb-cache"))
    return e


def mpirun(n: int, *args, flags=()) -> list[str]:
    return [MPIRUN, "--oversubscribe", *flags, "-n", str(n), PYTHON, "-m", "mpilb", *map(str, args)]


def train(data, tmp_path, *extra):
    return ["train", "--data", data, "--hidden", "16", "--no-progress",
            "--log", tmp_path / "run.h5", *extra]


class Job:
    """An mpirun job whose output lines are timed as they come."""

    def __init__(self, cmd, cwd):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env(), cwd=cwd, start_new_session=True)
        self.out: list[tuple[float, str]] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.out)),
                         threading.Thread(target=self._read, args=(self.proc.stderr, None))]
        for t in self._readers:
            t.start()

    def _read(self, stream, timed):
        for line in stream:
            if timed is None:
                self.err.append(line)
            else:
                timed.append((time.monotonic(), line))

    def wait(self, timeout):
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.ended = time.monotonic()
        for t in self._readers:
            t.join(10)
        return self.proc.returncode

    def line_at(self, prefix):
        return next((t for t, line in self.out if line.startswith(prefix)), None)

    @property
    def stderr(self):
        return "".join(self.err)


def run(cmd, cwd, timeout=360) -> tuple[int, Job]:
    # 300 epochs take ~10 s on a quiet 2-core machine; a loaded one (the 1-minute load
    # average at 10) made them outlast 120 s
    job = Job(cmd, cwd)
    return job.wait(timeout), job


def assert_exact(log, data, status, lost=()):
    s = summarize_log(str(log))
    assert s["status"] == status and s["lost_workers"] == list(lost), (s["status"], s["lost_workers"])
    mine = recomputed_coverage(str(log), open_dataset(data).shard_sizes)
    assert mine == s["coverage"] and mine["applied"] == mine["expected"], (mine, s["coverage"])
    assert mine["duplicates"] == mine["missing"] == 0
    return s


def test_digits_run_has_exact_coverage(digits_dir, tmp_path):
    code, job = run(mpirun(4, *train(digits_dir, tmp_path, "--epochs", 3)), tmp_path)
    assert code == 0, job.stderr
    s = assert_exact(tmp_path / "run.h5", digits_dir, "finished")
    assert s["epochs_completed"] == 3
    with h5py.File(tmp_path / "run.h5", "r") as f:
        assert str(f.attrs["mpi_library"]).startswith("Open MPI"), f.attrs["mpi_library"]


def test_two_stores(digits_dir, tmp_path):
    code, job = run(mpirun(4, *train(digits_dir, tmp_path, "--epochs", 3, "--servers", 2)), tmp_path)
    assert code == 0, job.stderr
    assert assert_exact(tmp_path / "run.h5", digits_dir, "finished")["epochs_completed"] == 3


def wait_training(log, job, timeout=90):
    wait_for_updates(log, job.proc, timeout, output=lambda: job.stderr)


def ranks_of(job) -> list[int]:
    """pids of the job's python ranks (mpirun's children)."""
    out = subprocess.run(["pgrep", "-P", str(job.proc.pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def rank_pids(job, n, timeout=60) -> dict[int, int]:
    """MPI rank -> pid of the rank process itself (under --survive-signals the child of its
    supervisor, which has the same OMPI_COMM_WORLD_RANK), once all n run: call it once
    training has started, when every supervisor has forked its rank."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        found, parents = {}, [job.proc.pid]
        while parents:
            out = subprocess.run(["pgrep", "-P", ",".join(map(str, parents))],
                                 capture_output=True, text=True).stdout
            parents = [int(p) for p in out.split()]
            for pid in parents:
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                rank = [v for v in environ if v.startswith(b"OMPI_COMM_WORLD_RANK=")]
                if rank:
                    found[int(rank[0].split(b"=")[1])] = pid   # the deepest one wins
        if len(found) == n:
            return found
        assert job.proc.poll() is None, job.stderr
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not start: {found}")


def test_sigterm_to_every_rank_preempts(digits_dir, tmp_path):
    """A scheduler's preemption (Slurm signals every task): exit 0, `preempted`. (SIGTERM
    to mpirun itself ends the ranks the same way, but mpirun then exits 1 of its own.)"""
    job = Job(mpirun(4, *train(digits_dir, tmp_path, "--epochs", 2000)), tmp_path)
    wait_training(tmp_path / "run.h5", job)
    ranks = ranks_of(job)
    assert len(ranks) == 4, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    code = job.wait(60)
    assert code == 0, job.stderr
    s = summarize_log(str(tmp_path / "run.h5"))
    assert s["status"] == "preempted" and s["lost_workers"] == [], s["status"]
    assert "SIGTERM: checkpointing and stopping" in job.stderr
    assert (tmp_path / "run.ckpt.h5").exists()


def test_crashed_worker_is_survived_with_the_flag(digits_dir, tmp_path):
    """`--mca orte_abort_on_non_zero_status 0`: the run goes on without the dead rank,
    ends degraded with exact coverage, and mpirun exits 3 soon after the run's end."""
    # long enough to outlast --worker-timeout after the crash: a run whose work the others
    # finish before the dead rank is declared lost ends `finished` (60 epochs took 1.5 s here)
    code, job = run(mpirun(4, *train(digits_dir, tmp_path, "--epochs", 300, "--inject", "2:crash@0.3",
                                     "--worker-timeout", 3), flags=SURVIVE), tmp_path)
    assert code == 3, (code, job.stderr)
    s = assert_exact(tmp_path / "run.h5", digits_dir, "degraded", lost=[2])
    assert s["epochs_completed"] == 300
    end = job.line_at("mpilb: degraded")
    assert end is not None and job.ended - end < 10, job.out
    assert "preempt" not in job.stderr


def test_a_worker_killed_by_sigkill_is_survived_with_the_flags(digits_dir, tmp_path):
    """kill -9 of a worker under the flag and --survive-signals: the run goes on without it,
    ends degraded with exact coverage, and mpirun exits rank 0's 3 (not 137: its supervisor
    exits 137 as a status, which mpirun passes over under that flag) soon after the run."""
    job = Job(mpirun(4, *train(digits_dir, tmp_path, "--epochs", 300, "--worker-timeout", 3,
                               *SIGNALS), flags=SURVIVE), tmp_path)
    wait_training(tmp_path / "run.h5", job)   # the supervisors have forked their ranks by then
    pids = rank_pids(job, 4)
    os.kill(pids[2], signal.SIGKILL)
    code = job.wait(360)
    assert code == 3, (code, job.stderr)
    assert "rank 2 (pid" in job.stderr and "was killed by SIGKILL" in job.stderr, job.stderr
    s = assert_exact(tmp_path / "run.h5", digits_dir, "degraded", lost=[2])
    assert s["epochs_completed"] == 300
    end = job.line_at("mpilb: degraded")
    assert end is not None and job.ended - end < 10, (job.ended - end if end else job.out)
    assert "preempt" not in job.stderr


@pytest.mark.parametrize("fault", ["crash", "SIGKILL"])
def test_a_lost_worker_without_the_flag_fails_the_log(digits_dir, tmp_path, fault):
    """Plain mpirun ends the job when a worker exits (crash: status 17) or is killed: SIGTERM
    to the survivors, SIGKILL 1 s later. That SIGTERM is no preemption: the log ends
    `failed`, and no line says preemption."""
    inject = ["--inject", "2:crash@0.3"] if fault == "crash" else []
    job = Job(mpirun(4, *train(digits_dir, tmp_path, "--epochs", 2000, "--worker-timeout", 5,
                               *inject)), tmp_path)
    if fault == "SIGKILL":
        wait_training(tmp_path / "run.h5", job)
        os.kill(rank_pids(job, 4)[2], signal.SIGKILL)
    code = job.wait(120)
    assert code == (17 if fault == "crash" else 137), (code, job.stderr)
    s = summarize_log(str(tmp_path / "run.h5"))
    assert s["status"] == "failed", (s["status"], job.stderr)
    assert "preemption signal" not in job.stderr and "preempted" not in job.stderr, job.stderr
    assert "rank 2" in job.stderr and "not a preemption" in job.stderr, job.stderr


def test_a_killed_rank_0_under_the_flags_is_no_success(digits_dir, tmp_path):
    """kill -9 of rank 0 under the flag and --survive-signals: its supervisor dies by the same
    signal (a status would be passed over, and the workers' own ends too: mpirun exited 0),
    so mpirun exits 137 once the workers have ended themselves."""
    from mpilb.mpi.watchdog import limit

    job = Job(mpirun(4, *train(digits_dir, tmp_path, "--epochs", 2000, "--worker-timeout", 2,
                               *SIGNALS), flags=SURVIVE), tmp_path)
    wait_training(tmp_path / "run.h5", job)   # the supervisors have forked their ranks by then
    pids = rank_pids(job, 4)
    os.kill(pids[0], signal.SIGKILL)
    killed = time.monotonic()
    code = job.wait(limit(2) + 60)
    assert code == 137, (code, job.stderr)
    assert "rank 0 (pid" in job.stderr and "nothing from rank 0" in job.stderr, job.stderr
    assert job.ended - killed < limit(2) + 10, job.ended - killed


def test_with_recovery_the_job_ends_soon_after_the_run(digits_dir, tmp_path):
    """`--enable-recovery` also lets the run go on, but MPI_Abort then ends rank 0 alone:
    rank 0 tells the others to leave (they waited 30 s at the final barrier for the dead
    rank). mpirun exits 0 there whatever the ranks say (why the docs advise the other flag)."""
    code, job = run(mpirun(4, *train(digits_dir, tmp_path, "--epochs", 300, "--inject", "2:crash@0.3",
                                     "--worker-timeout", 3), flags=["--enable-recovery"]), tmp_path)
    assert code == 0, (code, job.stderr)
    assert assert_exact(tmp_path / "run.h5", digits_dir, "degraded", lost=[2])["epochs_completed"] == 300
    end = job.line_at("mpilb: degraded")
    assert end is not None and job.ended - end < 10, (job.ended - end if end else job.out)


def test_bad_input_under_the_flag_still_exits_2(digits_dir, tmp_path):
    """That flag makes mpirun drop the ranks' exit codes (it exited 0 where every rank
    returned 2): rank 0 ends such a job with MPI_Abort(2), whose code comes through."""
    code, job = run(mpirun(4, *train(digits_dir, tmp_path, "--batch", -3), flags=SURVIVE), tmp_path)
    if code < 0 and "ORTE_ERROR_LOG" in job.stderr:
        # Open MPI's mpirun itself crashed while it took the abort apart (SIGSEGV, "Data
        # unpack would read past end of buffer": one CI run of 2026-12-06 in many; the
        # test alone passed 3 of 3 after it): its bug, not the job's exit code. Once more.
        code, job = run(mpirun(4, *train(digits_dir, tmp_path, "--batch", -3), flags=SURVIVE),
                        tmp_path)
    assert code == 2, (code, job.stderr)
    assert job.stderr.count("mpilb: error:") == 1 and "--batch" in job.stderr, job.stderr


def test_open_mpis_mpirun_with_an_mpich_mpi4py_is_one_line_and_exit_2(digits_dir, tmp_path):
    """The other mismatch: Open MPI's mpirun starting a python whose mpi4py loads MPICH (the
    bundled wheel). MPICH's MPI_Init failed in every rank with an error stack ("unsupported
    PMI version PMIx") and mpirun exited 16; mpilb now checks before MPI starts."""
    mpich = subprocess.run([sys.executable, "-c", "import mpi4py; mpi4py.rc.initialize = False; "
                            "from mpi4py import MPI; print(MPI.Get_library_version())"],
                           capture_output=True, text=True, timeout=60).stdout
    if not mpich.startswith("MPICH"):
        pytest.skip(f"this python's mpi4py is not on MPICH: {mpich[:80]}")
    cmd = [MPIRUN, "--oversubscribe", "-n", "3", sys.executable, "-m", "mpilb",
           *map(str, train(digits_dir, tmp_path, "--epochs", 1))]
    code, job = run(cmd, tmp_path)
    assert code == 2, (code, job.stderr)
    lines = [ln for ln in job.stderr.splitlines() if ln.startswith("mpilb:") or "Traceback" in ln]
    assert len(lines) == 1 and "Open MPI mpirun started 3 processes" in lines[0], job.stderr
    assert "but mpi4py uses MPICH" in lines[0] and "unsupported PMI" not in job.stderr, job.stderr
    assert not (tmp_path / "run.h5").exists() and not list(tmp_path.glob("runs/*"))
