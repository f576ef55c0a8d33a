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
