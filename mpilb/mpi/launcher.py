"""What the launcher (mpiexec, mpirun, srun) says about the job, read from the variables it
gives every process it starts.

These are readable before MPI starts (the command sizes BLAS threads from them) and tell what MPI
cannot: when the launcher belongs to another MPI library than the one mpi4py loaded, MPI
gives every process a world of its own, and only the launcher's variables still say that it
started several (:func:`mismatch`). Only the standard library is imported here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Mapping, Optional


@dataclass
class Launch:
    """The launcher of this process.

    Attributes:
        name: who started it ("mpiexec (MPICH Hydra)", "srun --mpi=pmix", ...).
        size: how many processes it says it started (None: it does not say).
        rank: this process's index among them (None: it does not say).
        evidence: the variables that say so, as ``NAME=VALUE``.
    """

    name: str
    size: Optional[int] = None
    rank: Optional[int] = None
    evidence: list = field(default_factory=list)


def _number(env: Mapping[str, str], *names: str) -> tuple[Optional[int], list]:
    """The first of `names` that holds a number, and ``["NAME=VALUE"]`` for it."""
    for name in names:
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value), [f"{name}={value}"]
    return None, []


def launch(env: Optional[Mapping[str, str]] = None) -> Launch:
    """Which launcher started this process, with the job size and rank it announces.

    Open MPI's variables are read first (they also appear under Slurm, where mpirun starts
    its daemons with srun), then MPICH's Hydra (``MPI_LOCALNRANKS``), then srun's own step
    variables, then any PMI or PMIx launcher. Slurm's job-wide ``SLURM_NTASKS`` alone says
    nothing: a batch script's own process sees it too.
    """
    env = os.environ if env is None else env

    def read(name, sizes, ranks, extra=()):
        size, seen = _number(env, *sizes)
        rank, seen_rank = _number(env, *ranks)
        return Launch(name, size, rank, seen + seen_rank + [f"{v}={env[v]}" for v in extra if v in env])

    if open_mpi(env):
        return read("Open MPI mpirun", ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_RANK",))
    if "MPI_LOCALNRANKS" in env:   # set by MPICH's Hydra only
        return read("mpiexec (MPICH Hydra)", ("PMI_SIZE",), ("PMI_RANK",), ("MPI_LOCALNRANKS",))
    if "SLURM_STEP_ID" in env:
        return read(f"srun --mpi={env.get('SLURM_MPI_TYPE', '?')}",
                    ("PMI_SIZE", "SLURM_STEP_NUM_TASKS"), ("PMI_RANK", "PMIX_RANK", "SLURM_PROCID"))
    if "PMI_SIZE" in env:
        return read("a PMI launcher", ("PMI_SIZE",), ("PMI_RANK",))
    if "PMIX_RANK" in env:
        return read("a PMIx launcher", (), ("PMIX_RANK",))
    return Launch("none (singleton: one process without mpiexec)")


def open_mpi(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether Open MPI's mpirun (or its orted) started this process."""
    return "OMPI_COMM_WORLD_SIZE" in (os.environ if env is None else env)


def announced_size() -> int:
    """The job size the launcher announces (1 without one): usable before MPI starts."""
    return launch().size or 1


def announced_rank() -> int:
    """This process's rank as the launcher announces it (0 without one)."""
    return launch().rank or 0


def env_world_size() -> int:
    """The job size as the launcher's variables give it, read the way BLAS threads are sized
    (any of them, Slurm's job-wide count included; 1 without one)."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS"):
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value) or 1
    return 1


def one_blas_thread_per_rank(joins: bool = False) -> None:
    """Several ranks share a node's cores: one BLAS thread per rank in a multi-rank job,
    unless the user says otherwise; also in a launch of `mpilb join` (`joins`), of any
    size: its ranks are workers of a job whose other ranks may share their node. Only
    effective before numpy is imported."""
    if joins or env_world_size() > 1:
        one_blas_thread()


def one_blas_thread() -> None:
    """One BLAS thread, unless the user says otherwise (a rank among others on its node, as a
    replacement worker is: run/replacement.py). Only effective before numpy is imported."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")


def mismatch(world_size: int, library: str, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The one-line problem when MPI gives this process a world of 1 but the launcher says
    it started several (a size above 1, or a rank above 0), else None. `library`: the MPI
    library mpi4py loaded, as the message names it."""
    job = launch(env)
    if world_size != 1 or ((job.size or 1) <= 1 and not job.rank):
        return None
    started = f"{job.size} processes" if job.size else "several processes"
    return (f"{job.name} started {started} ({', '.join(job.evidence)}) but MPI sees a world "
            f"of 1: mpi4py uses {library}, not the MPI library this launcher belongs to, so "
            f"each process would train alone. Launch with that library's own mpiexec (srun "
            f"--mpi=pmix or --mpi=pmi2 under Slurm), or rebuild mpi4py against the launcher's "
            f"MPI: pip install --no-binary mpi4py --force-reinstall mpi4py (`mpilb doctor` "
            f"shows both; docs/slurm.md)")


# Reads the library mpi4py loads without starting MPI (MPI_Get_library_version may be called
# before MPI_Init), in a process of its own so that this one's first import still starts MPI.
_PROBE = ("import mpi4py, re; mpi4py.rc.initialize = False; from mpi4py import MPI; "
          "v = ' '.join(MPI.Get_library_version().splitlines()[0].split()); "
          "m = re.search(r'\\s(/\\S*/lib(?:mpi|mpich|impi)[\\w.-]*\\.so[\\w.]*)$', "
          "open('/proc/self/maps').read(), re.M); print(v + (f' ({m.group(1)})' if m else ''))")


def foreign_mpi(env: Optional[Mapping[str, str]] = None, probe=None) -> Optional[str]:
    """The one-line problem when Open MPI's mpirun started this process but mpi4py loads
    another MPI library (the MPICH wheel): its MPI_Init fails in every process with an
    error stack ("unsupported PMI version PMIx") before mpilb could say anything, so it is
    checked before MPI starts. None where the launcher is not Open MPI's, or its library is
    what mpi4py loads, or the library cannot be read (MPI then reports for itself).
    `probe`: returns the library's name as :func:`mpilb.mpi.comm.library_named` does
    (default: asked of a separate process, ~0.1 s, only under Open MPI's launcher)."""
    env = os.environ if env is None else env
    if not open_mpi(env):
        return None
    library = (probe or _library_in_a_subprocess)()
    if not library or "Open MPI" in library:
        return None
    job = launch(env)
    started = f"{job.size} processes" if job.size else "this process"
    return (f"{job.name} started {started} ({', '.join(job.evidence)}) but mpi4py uses "
            f"{library}, not Open MPI: MPI cannot start under this launcher. Launch with that "
            f"library's own mpiexec, or rebuild mpi4py against Open MPI: pip install "
            f"--no-binary mpi4py --force-reinstall mpi4py (`mpilb doctor` shows both; "
            f"docs/slurm.md)")


def _library_in_a_subprocess() -> str:
    try:
        res = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return res.stdout.strip() if res.returncode == 0 else ""
