"""Where boxes are recorded and how one is removed by name: its directory under BASE holds
`state.json`; its namespaces are `mpilb-<name>-n<K>` (nodes) and `mpilb-<name>-br` (the
bridge), so that a box can be found and torn down without the process that made it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

from mpilb.errors import UsageError
from mpilb.clusterbox.system import BoxError, netns_list, netns_pids, sh

BASE = Path("/tmp/mpilb-box")
PREFIX = "mpilb-"
_NAME = re.compile(r"^[a-z][a-z0-9]{0,23}$")


def check_name(name: str) -> str:
    if not _NAME.match(name or ""):
        raise UsageError(f"box name {name!r}: use 1-24 lower-case letters and digits, "
                         "starting with a letter")
    return name


def box_dir(name: str) -> Path:
    return BASE / name


def namespaces(name: str) -> list[str]:
    """The network namespaces box `name` has now (nodes first, the bridge last)."""
    mine = [ns for ns in netns_list() if ns.startswith(f"{PREFIX}{name}-")]
    return sorted(mine, key=lambda ns: (ns.endswith("-br"), len(ns), ns))


def read_state(name: str) -> dict | None:
    try:
        return json.loads((box_dir(name) / "state.json").read_text())
    except (OSError, ValueError):
        return None


def write_state(name: str, state: dict) -> None:
    path = box_dir(name) / "state.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), to tell a pid reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner_alive(state: dict) -> bool:
    """Whether the process that made the box (None for `up` from the command line) lives."""
    owner = state.get("owner")
    if owner is None:
        return True
    return start_time(owner["pid"]) == owner["start"]


def boxes() -> list[str]:
    """Names of the boxes recorded under BASE or with namespaces left."""
    names = {p.name for p in BASE.glob("*") if (p / "state.json").exists()} if BASE.is_dir() else set()
    for ns in netns_list():
        if ns.startswith(PREFIX) and ns.count("-") >= 2:
            names.add(ns[len(PREFIX):].rsplit("-", 1)[0])
    return sorted(names)


def _kill_all(namespace: str, timeout: float = 10) -> None:
    """SIGKILL every process in the network namespace and wait until none is left."""
    deadline = time.monotonic() + timeout
    while True:
        pids = netns_pids(namespace)
        if not pids:
            return
        if time.monotonic() > deadline:
            raise BoxError(f"processes {pids} in namespace {namespace} did not die")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def teardown(name: str) -> list[str]:
    """Remove box `name`: kill the processes in its namespaces (holders, runs), delete the
    namespaces (their veths and bridge go with them) and its directory. Returns what was
    removed; removing a box that is not there is no error."""
    removed = []
    for ns in namespaces(name):
        _kill_all(ns)
        try:
            sh("ip", "netns", "delete", ns)
        except BoxError:
            if ns in netns_list():
                raise
            continue   # another process tore it down meanwhile
        removed.append(ns)
    path = box_dir(name)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def stale() -> list[str]:
    """Boxes whose maker died without tearing them down: its pid is gone (or reused), or
    namespaces are left with no state recorded."""
    found = []
    for name in boxes():
        state = read_state(name)
        if state is None:
            if box_dir(name).exists() and time.time() - box_dir(name).stat().st_mtime < 60:
                continue   # another process is writing it now
            found.append(name)
        elif not owner_alive(state):
            found.append(name)
    return found
