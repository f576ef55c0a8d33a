"""Shared pytest fixtures (additive: each block belongs to the module it serves)."""

import sys
from pathlib import Path

import pytest

# tests/unit, tests/mpi, tests/cluster and tests/openmpi share tests/mpirun.py
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_sessionstart(session):
    """Compile mpilb's modules once, before any test starts a process.

    Every rank of every `mpiexec` the suite starts imports mpilb (~150 modules). An editable
    install leaves no bytecode, and where PYTHONDONTWRITEBYTECODE is set (as in some CI
    images) no process writes any: each would compile every module from source again, ~1.3
    CPU-seconds more per 4-rank launch measured here (22% of a one-epoch run). compileall
    writes the bytecode whatever that variable says; Python still checks each file's
    timestamp, so an edited module is never run from stale bytecode. A read-only tree is
    left as it is."""
    import compileall

    compileall.compile_dir(str(Path(__file__).resolve().parent.parent / "mpilb"), quiet=2)

# ---------------------------------------------------------------- datasets (mpilb.data.dataset)


@pytest.fixture
def small_dataset(tmp_path):
    """A synthetic dataset of 2000 x 16, 4 classes, 4 shards (1600 train, 400 test)."""
    from mpilb.data.dataset import prepare_synthetic

    return prepare_synthetic(tmp_path / "small", samples=2000, features=16, classes=4, shards=4, seed=0)


# ---------------------------------------------------------------- engine (mpilb.server/worker)


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory):
    """scikit-learn's digits as an mpilb dataset (8 shards), made once per session."""
    from mpilb.data.dataset import prepare_digits

    root = tmp_path_factory.mktemp("digits") / "digits"
    prepare_digits(root, shards=8, seed=0)
    return str(root)


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory):
    """A 12000 x 32 synthetic dataset with 12 shards, made once per session."""
    from mpilb.data.dataset import prepare_synthetic

    root = tmp_path_factory.mktemp("synth") / "synth"
    prepare_synthetic(root, samples=12000, features=32, classes=10, shards=12, seed=0)
    return str(root)


# ---------------------------------------------------------------- MPICH's leftovers

SHM = "/dev/shm"


def _mpich_segments() -> set:
    import os

    try:
        return {n for n in os.listdir(SHM) if n.startswith("mpich_shm_")}
    except OSError:
        return set()


def _mapped_segments() -> set:
    """Segments some live process still maps (a running MPI job's)."""
    import glob

    names = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as fh:
                for line in fh:
                    if "/mpich_shm_" in line:
                        names.add("mpich_shm_" + line.split("/mpich_shm_", 1)[1].split()[0])
        except OSError:
            continue
    return names


@pytest.fixture(scope="session", autouse=True)
def mpich_segments_left_by_killed_jobs():
    """The suite kills and aborts jobs on purpose; MPICH then leaves its shared-memory
    segment in /dev/shm (~4 MB each, docs/faults.md). Remove the ones this session left,
    unless a live process still maps one."""
    import os

    before = _mpich_segments()
    yield
    for name in _mpich_segments() - before - _mapped_segments():
        try:
            os.unlink(os.path.join(SHM, name))
        except OSError:
            pass
