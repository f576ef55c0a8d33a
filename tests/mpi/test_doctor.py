"""`mpilb doctor`: the checks as pure functions, and the command under mpiexec."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig

import pytest

from mpilb.cli import doctor as D
from mpilb.mpi.launcher import launch

TIMEOUT = 120


def run_doctor(n: int, **env_extra) -> subprocess.CompletedProcess:
    """`mpiexec -n N mpilb doctor` (n=0: without mpiexec), with a hard timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI_"))}
    env.pop("MPILB_CUDA_AWARE", None)
    env["PATH"] = sysconfig.get_path("scripts") + os.pathsep + env.get("PATH", "")
    env.update({k: str(v) for k, v in env_extra.items()})
    cmd = [sys.executable, "-m", "mpilb", "doctor"]
    if n:
        mpiexec = shutil.which("mpiexec", path=env["PATH"])
        assert mpiexec, "mpiexec not found: pip install mpich"
        cmd = [mpiexec, "-n", str(n), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:   # a hang: end mpiexec and every rank it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def facts(host="h", local_rank=0, gpus=0, cupy="13.3.0", driver_gpus=None, cuda_support=False):
    return dict(host=host, local_rank=local_rank, gpus=gpus, cupy=cupy, cuda_visible=None,
                driver_gpus=driver_gpus, cuda_support=cuda_support)


# ---------------------------------------------------------------- pure checks
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="doorbells are Linux only")
def test_doorbells_line_and_ranks_on_rank_0s_host_that_cannot_ring(monkeypatch):
    monkeypatch.delenv("MPILB_DOORBELL", raising=False)
    ranks = [facts("a"), facts("a", 1), facts("a", 2), facts("b")]
    out = D.Findings()
    line = D._doorbell_line({1: "local", 2: "local", 3: "network"}, ranks, out)
    assert line == ("rank 0 <-> 3 of 3 rank(s) (2 through local sockets, 1 over the network by "
                    "UDP; the others poll)") and not out.warnings   # 3: another host
    out = D.Findings()
    assert D._doorbell_line({1: "local", 2: "local"}, ranks, out).startswith("rank 0 <-> 2 of 3 rank(s)")
    assert len(out.warnings) == 1 and "rank(s) 3 on other hosts cannot ring" in out.warnings[0]
    out = D.Findings()
    D._doorbell_line({1: "local", 3: "network"}, ranks, out)
    assert len(out.warnings) == 1 and "rank(s) 2 share rank 0's host" in out.warnings[0]
    monkeypatch.setenv("MPILB_DOORBELL", "0")
    assert D._doorbell_line({}, ranks, D.Findings()).startswith("off (MPILB_DOORBELL=0)")
    assert D._doorbell_line({}, ranks[:1], D.Findings()) == "not used (one rank)"



def test_one_worker_per_gpu_is_clean_and_rank0_needs_no_gpu():
    out = D.Findings()
    ranks = [facts(local_rank=0, gpus=2)] + [facts(local_rank=i, gpus=2) for i in (1, 2)]
    lines = D._gpu_lines(ranks, cuda_aware=False, out=out)
    assert not out.errors and not out.warnings
    assert "server, needs no GPU" in lines[0]
    assert [re.search(r"uses GPU (\d)", line).group(1) for line in lines[1:]] == ["1", "0"]


def test_more_workers_than_gpus_is_a_warning():
    out = D.Findings()
    ranks = [facts(local_rank=i, gpus=1) for i in range(3)]
    D._gpu_lines(ranks, cuda_aware=False, out=out)
    assert not out.errors
    assert any("2 workers share 1 GPU(s)" in w for w in out.warnings)


def test_gpus_without_cupy_and_cupy_without_gpus_say_what_to_do():
    out = D.Findings()
    ranks = [facts(cupy=None), facts(cupy=None, driver_gpus=4, local_rank=1),
             facts(host="g", cupy="13.3.0", gpus=0)]
    D._gpu_lines(ranks, cuda_aware=False, out=out)
    assert any("pip install cupy-cuda12x" in w and "rank(s) 1:" in w for w in out.warnings)
    assert any("no GPU visible" in w and "--device cpu" in w and "rank(s) 2:" in w
               for w in out.warnings)


def test_cuda_aware_switch_against_the_library():
    out = D.Findings()
    D._gpu_lines([facts(), facts(gpus=1, cuda_support=False)], cuda_aware=True, out=out)
    assert any("unset MPILB_CUDA_AWARE" in e for e in out.errors)
    out = D.Findings()
    D._gpu_lines([facts(), facts(gpus=1, cuda_support=None)], cuda_aware=True, out=out)
    assert not out.errors and any("cannot say" in w for w in out.warnings)
    out = D.Findings()
    D._gpu_lines([facts(), facts(gpus=1, cuda_support=True)], cuda_aware=True, out=out)
    assert not out.errors and not out.warnings


def test_launcher_world_mismatch_and_old_library_are_errors():
    info = dict(libmpi="/opt/a/lib/libmpi.so.12", vendor="MPICH 4.1", standard="4.1",
                compiled_standard="4.1", mpi4py_mpicc="", thread_level="funneled",
                thread_requested="funneled")
    out = D.Findings()
    D._check_mpi(info, 4, "srun --mpi=pmix", 4, out)
    assert not out.errors and not out.warnings
    D._check_mpi(info, 1, "srun --mpi=pmix", 4, out)
    assert len(out.errors) == 1 and "started 4 processes but MPI sees a world of 1" in out.errors[0]
    out = D.Findings()
    D._check_mpi(dict(info, standard="3.1", thread_level="single"), 2, "x", None, out)
    assert any("built against MPI 4.1 but runs with a library implementing MPI 3.1" in e
               for e in out.errors)
    assert any("thread level single" in e for e in out.errors)


# ---------------------------------------------------------------- how mpi4py was built
SOURCE_BUILD = {"tags": ["cp311-cp311-linux_x86_64"], "installer": "pip", "files": []}
PYPI_WHEEL = {"tags": ["cp311-cp311-manylinux_2_5_x86_64"], "installer": "pip", "files": []}


def _mpi4py_info(mpicc="", extension="MPI.cpython-311-x86_64-linux-gnu.so",
                 libmpi="/opt/mpi/lib/libmpi.so.40"):
    return dict(mpi4py="4.1.2", mpi4py_mpicc=mpicc, libmpi=libmpi,
                mpi4py_extension=f"/venv/lib/python3.11/site-packages/mpi4py/{extension}")


def test_a_source_built_mpi4py_4_is_not_called_a_binary_wheel(monkeypatch):
    from mpilb.cli import installation as I

    dists = {"mpi4py": SOURCE_BUILD}
    monkeypatch.setattr(I, "distribution", lambda name: dists.get(name, {}))
    line = D.mpi4py_line(_mpi4py_info())
    assert line.startswith("4.1.2 (built from source") and "wheel" not in line
    # the binary wheels from PyPI: one extension per MPI ABI, a manylinux tag
    dists = {"mpi4py": PYPI_WHEEL, "mpich": {"files": ["/venv/lib/libmpi.so.12"]}}
    line = D.mpi4py_line(_mpi4py_info(extension="MPI.mpich.cpython-311-x86_64-linux-gnu.so",
                                      libmpi="/venv/lib/libmpi.so.12"))
    assert line == "4.1.2 (binary wheel for the mpich ABI, libmpi from the mpich wheel)"
    line = D.mpi4py_line(_mpi4py_info(extension="MPI.openmpi.cpython-311-x86_64-linux-gnu.so"))
    assert line == "4.1.2 (binary wheel for the openmpi ABI, the system's libmpi)"
    # mpi4py 3 still records its compiler
    assert D.mpi4py_line(_mpi4py_info(mpicc="/opt/mpi/bin/mpicc")) == (
        "4.1.2 (built with /opt/mpi/bin/mpicc)")
    dists = {"mpi4py": {"installer": "conda", "tags": [], "files": []}}
    assert D.mpi4py_line(_mpi4py_info()) == "4.1.2 (conda package)"


def test_a_slurm_job_on_the_mpich_wheel_is_told_to_use_the_sites_mpi():
    out = D.Findings()
    D._check_build("4.1.2 (binary wheel for the mpich ABI, libmpi from the mpich wheel)",
                   "srun --mpi=pmi2", out)
    assert len(out.warnings) == 1 and "docs/slurm.md" in out.warnings[0]
    out = D.Findings()
    D._check_build("4.1.2 (built from source (...))", "srun --mpi=pmix", out)
    D._check_build("4.1.2 (binary wheel for the mpich ABI, libmpi from the mpich wheel)",
                   "mpiexec (MPICH Hydra)", out)
    assert not out.warnings


def _debian_open_mpi(root):
    """Debian's layout: /usr/bin/mpiexec -> /etc/alternatives/mpiexec -> mpiexec.openmpi ->
    orterun, mpicc -> ... -> opal_wrapper, libmpi in the multiarch directory."""
    (root / "usr/bin").mkdir(parents=True)
    (root / "etc/alternatives").mkdir(parents=True)
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libmpi.so.40.30.2").write_text("")
    for tool, real in (("mpiexec", "orterun"), ("mpicc", "opal_wrapper")):
        (root / "usr/bin" / real).write_text("")
        (root / "usr/bin" / f"{tool}.openmpi").symlink_to(real)
        (root / "etc/alternatives" / tool).symlink_to(root / "usr/bin" / f"{tool}.openmpi")
        (root / "usr/bin" / tool).symlink_to(root / "etc/alternatives" / tool)
    return lib / "libmpi.so.40.30.2"


def test_debians_alternatives_symlinks_are_the_same_installation(tmp_path):
    from mpilb.cli.installation import same_installation

    libmpi = str(_debian_open_mpi(tmp_path))
    library = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4"
    mpiexec, mpicc = str(tmp_path / "usr/bin/mpiexec"), str(tmp_path / "usr/bin/mpicc")
    assert same_installation(mpiexec, libmpi, library)
    info = dict(libmpi=libmpi, library=library, vendor="Open MPI 4.1.4", standard="3.1",
                compiled_standard="3.1", mpi4py_mpicc=mpicc, thread_level="funneled",
                thread_requested="funneled")
    out = D.Findings()
    D._check_mpi(info, 2, "Open MPI mpirun", 2, out)
    assert not out.errors and not out.warnings
    # what is another installation: another prefix, or MPICH's Hydra beside Open MPI's library
    (tmp_path / "opt/mpich/bin").mkdir(parents=True)
    (tmp_path / "opt/mpich/bin/mpiexec.hydra").write_text("")
    assert not same_installation(str(tmp_path / "opt/mpich/bin/mpiexec.hydra"), libmpi, library)
    (tmp_path / "usr/bin/mpiexec.hydra").write_text("")
    assert not same_installation(str(tmp_path / "usr/bin/mpiexec.hydra"), libmpi, library)
    out = D.Findings()
    D._check_mpi(dict(info, mpi4py_mpicc=str(tmp_path / "opt/mpich/bin/mpiexec.hydra")), 2, "x",
                 2, out)
    assert len(out.warnings) == 1 and "different MPI installations" in out.warnings[0]


def test_hdf5_locking(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for value, expected in (("FALSE", "off"), ("BEST_EFFORT", "best effort")):
        monkeypatch.setenv("HDF5_USE_FILE_LOCKING", value)
        assert D._check_hdf5(D.Findings()).startswith(expected)
    monkeypatch.delenv("HDF5_USE_FILE_LOCKING")
    monkeypatch.setattr(D, "_fs_type", lambda path: "lustre")
    out = D.Findings()
    assert D._check_hdf5(out).startswith("on (HDF5_USE_FILE_LOCKING unset)")
    assert any("set HDF5_USE_FILE_LOCKING=FALSE" in w and "lustre" in w for w in out.warnings)
    monkeypatch.setattr(D, "_fs_type", lambda path: "ext4")
    out = D.Findings()
    D._check_hdf5(out)
    assert not out.warnings


def test_fs_type_finds_the_root_mount():
    if not os.path.exists("/proc/mounts"):
        pytest.skip("no /proc/mounts")
    assert D._fs_type("/") is not None


# ---------------------------------------------------------------- the command

@pytest.mark.mpi
def test_doctor_under_mpiexec():
    proc = run_doctor(2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"^  MPI library +\S", out, re.M)
    assert re.search(r"^  world size +2 rank", out, re.M)
    for key in ("thread level", "mpi4py", "h5py", "HDF5", "numpy", "CuPy", "HDF5 file locking",
                "CUDA-aware MPI"):
        assert re.search(rf"^  {key} +\S", out, re.M), key
    assert re.search(r"^  rank 0 <-> 1: latency [\d.]+ us \(8 B\), bandwidth [\d.]+ GB/s "
                     r"\(4 MiB\)$", out, re.M)
    assert out.count("mpilb doctor:") == 1, "only rank 0 prints"
    if sys.platform.startswith("linux"):
        assert re.search(r"^  doorbells +rank 0 <-> 1 of 1 rank", out, re.M)
    # the layout of the job: one node here, its two ranks talk through shared memory
    assert re.search(r"^  2 rank\(s\) on 1 node\(s\); parameter store\(s\) on rank\(s\) 0$",
                     out, re.M)
    assert re.search(r"^  store 0 <-> workers: shared memory 1; network none$", out, re.M)


def test_layout_section_names_the_nodes_and_where_stores_would_go():
    from mpilb.cli.doctor import layout_section

    lines = layout_section([0, 0, 1, 1, 2, 2], ["a", "a", "b", "b", "c", "c"])
    assert "node 2 (c): rank(s) 4, 5" in lines
    assert "store 0 <-> workers: shared memory 1; network 2-5" in lines
    assert lines[-3:] == ["stores with --servers 2: ranks 0, 2", "stores with --servers 3: "
                          "ranks 0, 2, 4", "stores with --servers per-node: ranks 0, 2, 4"]


@pytest.mark.mpi
def test_doctor_reports_a_launcher_that_does_not_match_the_library():
    # What a singleton sees when Open MPI's mpirun starts an MPICH-built mpi4py.
    proc = run_doctor(0, OMPI_COMM_WORLD_SIZE=4)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ERROR: Open MPI mpirun started 4 processes but MPI sees a world of 1" in proc.stdout
    assert "skipped: one rank" in proc.stdout


@pytest.mark.mpi
def test_doctor_refuses_cuda_aware_on_a_library_without_cuda():
    proc = run_doctor(0, MPILB_CUDA_AWARE=1)
    if "the MPI library reports no CUDA support" not in proc.stdout:
        pytest.skip("this MPI library reports CUDA support or cannot say")
    assert proc.returncode == 1
    assert "ERROR: MPILB_CUDA_AWARE=1 but the MPI library is not CUDA-aware" in proc.stdout


@pytest.mark.parametrize("env, label, size", [
    ({"OMPI_COMM_WORLD_SIZE": "4"}, "Open MPI mpirun", 4),
    ({"PMI_SIZE": "3", "MPI_LOCALNRANKS": "3", "SLURM_STEP_ID": "0"}, "mpiexec (MPICH Hydra)", 3),
    ({"SLURM_STEP_ID": "0", "SLURM_MPI_TYPE": "pmi2", "PMI_SIZE": "8", "PMI_FD": "5"},
     "srun --mpi=pmi2", 8),
    ({"SLURM_STEP_ID": "0", "SLURM_MPI_TYPE": "pmix", "SLURM_STEP_NUM_TASKS": "9"},
     "srun --mpi=pmix", 9),
    ({}, "none (singleton", None),
])
def test_launcher_is_named_with_the_size_it_started(monkeypatch, env, label, size):
    for var in ("OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_ID", "SLURM_MPI_TYPE",
                "SLURM_STEP_NUM_TASKS", "PMI_SIZE", "PMI_FD", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    job = launch()
    name, started = job.name, job.size
    assert name.startswith(label) and started == size
