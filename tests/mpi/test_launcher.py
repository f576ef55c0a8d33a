"""A launcher of another MPI library: `mpilb train` refuses a world of 1 that the launcher
says is one of several processes (exit 2, one line from launcher rank 0, no run files)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpilb.mpi.launcher import launch, mismatch

from mpirun import run

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = "Open MPI v4.1.4 (/usr/lib/x86_64-linux-gnu/libmpi.so.40)"
# Every variable a launcher of either family (or Slurm) sets, removed for the subprocess runs.
LAUNCHER_VARS = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "HYDRA_",
                 "SLURM_")


@pytest.mark.parametrize("env, evidence", [
    ({"PMI_SIZE": "4", "PMI_RANK": "1"}, "PMI_SIZE=4, PMI_RANK=1"),
    ({"MPI_LOCALNRANKS": "4", "PMI_SIZE": "4", "PMI_RANK": "0"}, "mpiexec (MPICH Hydra) started 4"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"}, "Open MPI mpirun started 4"),
    ({"PMIX_RANK": "3"}, "a PMIx launcher started several processes (PMIX_RANK=3)"),
    ({"SLURM_STEP_ID": "0", "SLURM_MPI_TYPE": "none", "SLURM_STEP_NUM_TASKS": "8",
      "SLURM_PROCID": "5"}, "srun --mpi=none started 8 processes (SLURM_STEP_NUM_TASKS=8, "
                            "SLURM_PROCID=5)"),
])
def test_a_world_of_one_under_a_launcher_of_several_is_named(env, evidence):
    text = mismatch(1, LIBRARY, env)
    assert text is not None and evidence in text
    assert "MPI sees a world of 1" in text and LIBRARY in text and "\n" not in text
    assert mismatch(4, LIBRARY, env) is None   # the world the launcher started: fine


@pytest.mark.parametrize("env", [
    {},                                                       # no launcher: a singleton
    {"PMI_SIZE": "1", "PMI_RANK": "0"},                       # mpiexec -n 1
    {"MPI_LOCALNRANKS": "1", "PMI_SIZE": "1", "PMI_RANK": "0"},
    {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"},
    {"PMIX_RANK": "0"},
    {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"},   # srun -n 1
    {"SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"},   # a batch script itself
])
def test_one_process_launches_are_fine(env):
    assert mismatch(1, LIBRARY, env) is None


def test_open_mpi_variables_win_over_slurms():
    # Open MPI's mpirun inside a job starts its daemons with srun: the step says 2 (nodes)
    env = {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0", "SLURM_STEP_ID": "1",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}
    assert launch(env).name == "Open MPI mpirun" and mismatch(1, LIBRARY, env) is None


def _train(tmp_path, digits_dir, env_extra, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    env.update(env_extra, PYTHONPATH=str(ROOT), MPILB_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "mpilb", "train", "--data", digits_dir, "--epochs", "1", *args]
    return subprocess.run(cmd, cwd=tmp_path / "work", env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_train_refuses_a_mismatched_launcher_before_writing_anything(tmp_path, digits_dir, rank):
    (tmp_path / "work").mkdir()
    fixed = ["--log", str(tmp_path / "work" / "run.h5")] if rank == "1" else []
    proc = _train(tmp_path, digits_dir, {"PMI_SIZE": "4", "PMI_RANK": rank}, *fixed)
    assert proc.returncode == 2, proc.stderr
    assert list((tmp_path / "work").iterdir()) == []   # no runs/NNN.h5, no checkpoint
    lines = (proc.stdout + proc.stderr).splitlines()
    if rank == "0":
        assert len(lines) == 1 and lines[0].startswith("mpilb: error: a PMI launcher started 4 "
                                                       "processes (PMI_SIZE=4, PMI_RANK=0)")
    else:
        assert lines == []   # the other processes of the job stay quiet: one line in all


def test_one_process_run_with_a_launcher_of_one_still_trains(tmp_path, digits_dir):
    (tmp_path / "work").mkdir()
    proc = _train(tmp_path, digits_dir, {"PMI_SIZE": "1", "PMI_RANK": "0"})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "work" / "runs" / "001.h5").exists()


@pytest.mark.mpi
def test_mpiexec_n_1_still_trains(tmp_path, digits_dir):
    log = tmp_path / "one.h5"
    proc = run(1, "train", "--data", digits_dir, "--epochs", "1", "--log", log)
    assert proc.returncode == 0, proc.stderr
    import h5py

    with h5py.File(log) as f:
        assert f.attrs["status"] == "finished" and int(f.attrs["world_size"]) == 1
