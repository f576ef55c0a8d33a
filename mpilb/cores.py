"""The CPUs a rank may use, and whether it has one to itself.

A rank whose node has at least one CPU per rank of the job there polls for its messages
without sleeping for a moment at the start of each wait (:attr:`waiting.Backoff.spin_s`):
a sleep and the wake-up that ends it cost ~0.1-0.2 ms on a virtual machine, several times
per push round trip. Where ranks outnumber CPUs they share them, and a polling rank would
take the CPU from the rank it waits for, so every wait sleeps as before.
``MPILB_SPIN=1`` or ``0`` forces the choice (``auto``, the default, decides as above).
"""

from __future__ import annotations

import math
import os
import socket
from typing import Optional

# How long a wait polls before it sleeps on a rank with a CPU to itself: longer than a
# push's round trip and than rank 0's wait for the next push in the runs measured (10 ms
# took about all of the gain of never sleeping, 2 ms half of it; docs/architecture.md,
# "Waiting without spinning")
SPIN_S = 10e-3


def cpu_set() -> Optional[frozenset]:
    """The CPUs this process may run on (its affinity), or None where the OS cannot say."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return None


def cgroup_quota(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> Optional[float]:
    """CPUs' worth of time the process's control group may use per period (a container's
    ``--cpus``), or None when unlimited or unknown. cgroup v2 (``cpu.max``) and v1
    (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``)."""
    try:
        lines = open(proc).read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.lstrip("/")
        try:
            if controllers == "":   # v2
                quota, period = open(os.path.join(root, path, "cpu.max")).read().split()[:2]
                if quota != "max":
                    return int(quota) / int(period)
            elif "cpu" in controllers.split(","):   # v1
                base = os.path.join(root, "cpu", path)
                if not os.path.isdir(base):
                    base = os.path.join(root, "cpu,cpuacct", path)
                quota = int(open(os.path.join(base, "cpu.cfs_quota_us")).read())
                period = int(open(os.path.join(base, "cpu.cfs_period_us")).read())
                if quota > 0:
                    return quota / period
        except (OSError, ValueError):
            continue
    return None


def usable_cpus() -> int:
    """How many CPUs this process can keep busy at once: its affinity, capped by a control
    group's quota."""
    cpus = cpu_set()
    n = len(cpus) if cpus is not None else (os.cpu_count() or 1)
    quota = cgroup_quota()
    if quota is not None:
        n = min(n, max(1, math.floor(quota)))
    return max(1, n)


def own_core(me: tuple, everyone: list) -> bool:
    """Whether the rank described by `me` has a CPU to itself, given every rank's
    ``(host, cpus, usable)`` (`cpus`: a sorted list of CPU numbers, or None): the ranks on
    its host whose CPUs overlap its own must be no more than the CPUs it may use."""
    host, cpus, usable = me
    mine = set(cpus) if cpus is not None else None
    sharing = sum(1 for h, c, _ in everyone
                  if h == host and (mine is None or c is None or mine & set(c)))
    return sharing <= usable


def spin_here(comm) -> bool:
    """Collective: True on the ranks that have a CPU to themselves (see :func:`own_core`),
    unless ``MPILB_SPIN`` says otherwise."""
    cpus = cpu_set()
    me = (socket.gethostname(), sorted(cpus) if cpus is not None else None, usable_cpus())
    everyone = comm.allgather(me)
    choice = os.environ.get("MPILB_SPIN", "auto")
    if choice in ("0", "1"):
        return choice == "1"
    return own_core(me, everyone)


def start_waits(comm) -> bool:
    """Collective: make this process's waits poll for :data:`SPIN_S` seconds before they
    sleep where it has a CPU to itself (:func:`spin_here`). Returns whether they do."""
    from .waiting import Backoff

    spin = spin_here(comm)
    Backoff.spin_s = SPIN_S if spin else 0.0
    return spin
