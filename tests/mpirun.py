"""Run mpilb under mpiexec from tests: subprocesses with hard timeouts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

SCRIPTS = sysconfig.get_path("scripts")


def mpiexec() -> str:
    path = shutil.which("mpiexec", path=SCRIPTS + os.pathsep + os.environ.get("PATH", ""))
    if path is None:
        raise RuntimeError("mpiexec not found: pip install mpich (the [mpi] extra)")
    return path


def env(**extra) -> dict:
    e = dict(os.environ)
    e["PATH"] = SCRIPTS + os.pathsep + e.get("PATH", "")
    e.setdefault("MPILB_CACHE", os.path.join(os.getcwd(), ".mpilb-cache"))
    e.update({k: str(v) for k, v in extra.items()})
    return e


def mpilb_cmd(n: int, *args) -> list[str]:
    """Command line for `mpiexec -n N python -m mpilb ARGS` (n=0: no mpiexec)."""
    base = [sys.executable, "-m", "mpilb", *map(str, args)]
    return base if n == 0 else [mpiexec(), "-n", str(n), *base]


def run(n: int, *args, timeout: float = 120, cwd=None, **extra_env) -> subprocess.CompletedProcess:
    """Run mpilb on n ranks; raises if it outlives `timeout` (a hang is a failure)."""
    return subprocess.run(mpilb_cmd(n, *args), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env(**extra_env))


def wait_training(log, proc, timeout=60, output=None):
    """Until the run log holds applied updates (start-up is over).

    Fails at once when `proc` ends first, with `output()` (or its output) as the message.
    """
    import time

    from mpilb.runfiles.runlog import holds_updates

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, output() if output else proc.communicate()
        if holds_updates(log):
            return
        time.sleep(0.2)
    raise AssertionError("training did not start")

def recomputed_coverage(log: str, shard_sizes: list[int]) -> dict:
    """The summary's coverage (docs/logs.md) over the completed epochs, from updates/ (epoch, shard, lo, hi)."""
    import numpy as np

    from mpilb.runfiles.runlog import read_columns

    _, cols = read_columns(log)
    up, ep = cols["updates"], cols["epochs"]
    offsets = np.concatenate([[0], np.cumsum(shard_sizes)]).astype(np.int64)
    total = int(offsets[-1])
    out = {"expected": 0, "applied": 0, "duplicates": 0, "missing": 0}
    for e in sorted(set(int(x) for x in ep["epoch"])):
        counts = np.zeros(total, dtype=np.int64)
        rows = np.flatnonzero(up["epoch"] == e)
        for s, lo, hi in zip(up["shard"][rows], up["lo"][rows], up["hi"][rows]):
            assert 0 <= lo < hi <= shard_sizes[s], (e, s, lo, hi)
            counts[offsets[s] + lo: offsets[s] + hi] += 1
        out["expected"] += total
        out["applied"] += int(np.count_nonzero(counts))
        out["duplicates"] += int(np.count_nonzero(counts > 1))
        out["missing"] += int(np.count_nonzero(counts == 0))
    return out


def config_stub(**options):
    """A stand-in for a run's Config holding just `options`, each in its section
    (``config_stub(servers=3).updates.servers``), for parts tested without build_config."""
    from types import SimpleNamespace

    from mpilb.config.sections import SECTION_OF, SECTIONS

    parts = {attr: {} for attr in SECTIONS}
    for name, value in options.items():
        parts[SECTION_OF[name]][name] = value
    return SimpleNamespace(**{attr: SimpleNamespace(**v) for attr, v in parts.items()})


def checkpoint_floats(path) -> dict:
    """Every float dataset of an HDF5 file (a checkpoint: parameters, optimizer state), by
    path: two runs that must have stepped the same floats compare these."""
    import h5py

    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda k, v: out.__setitem__(k, v[()])
                     if isinstance(v, h5py.Dataset) and v.dtype.kind == "f" else None)
    return out


def finished_exact(log) -> dict:
    """The run's summary, after asserting it finished with every sample applied once."""
    from mpilb.runfiles.summary import summarize_log

    s = summarize_log(str(log))
    cov = s["coverage"]
    assert s["status"] == "finished", s["status"]
    assert cov["applied"] == cov["expected"] and cov["duplicates"] == cov["missing"] == 0, cov
    return s
