"""The CPUs a rank may use, and whether it has one to itself.

A worker whose node has at least one CPU per rank of the job there polls for its messages
without sleeping for a moment at the start of each wait (:attr:`waiting.Backoff.spin_s`):
a sleep and the wake-up that ends it cost ~0.1-0.2 ms on a virtual machine, once at each
end of a push's round trip. A parameter store (rank 0, and the other store ranks of ``--servers K``)
polls on after each push it handles, which with several workers is all the time, so it
does so only where its node has a CPU more than that: its own threads (the evaluation) and
the workers' (their shard readers) need CPU too. With one worker and the server on two
CPUs, a polling server made the worker's steps a third slower: its reader thread lost
the CPU it had while the server slept. Where ranks outnumber CPUs they share them, and a
polling rank would take the CPU from the rank it waits for, so every wait sleeps as before.
Ranks count together by machine, not host name (:func:`machine`): the nodes of a cluster in a
box have names of their own but share one machine's CPUs, and there every rank polled first,
rank 0 on a node of its own 10 ms after each push (a third of its wall time in CPU with
workers that take 50 ms a step).
``MPILB_SPIN=1`` or ``0`` forces the choice (``auto``, the default, decides as above).
"""

from __future__ import annotations

import math
import os
import socket
from typing import Optional

from mpilb.mpi.waiting import Backoff

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


def machine() -> str:
    """Which machine's CPUs this process runs on: the kernel's boot id, the same in every
    namespace and container of one machine (the nodes of a cluster in a box have their own
    host names but share its CPUs), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def own_core(me: tuple, everyone: list, spare: int = 0) -> bool:
    """Whether the rank described by `me` has a CPU to itself, given every rank's
    ``(machine, cpus, usable)`` (`cpus`: a sorted list of CPU numbers, or None): the ranks
    on its machine whose CPUs overlap its own, plus `spare` CPUs, must be no more than the
    CPUs it may use."""
    where, cpus, usable = me
    mine = set(cpus) if cpus is not None else None
    sharing = sum(1 for m, c, _ in everyone
                  if m == where and (mine is None or c is None or mine & set(c)))
    return sharing + spare <= usable


def facts(comm) -> list[tuple]:
    """Collective: every rank's ``(machine, cpus, usable, MPILB_SPIN)`` (see :func:`own_core`)."""
    cpus = cpu_set()
    return comm.allgather((machine(), sorted(cpus) if cpus is not None else None, usable_cpus(),
                           os.environ.get("MPILB_SPIN", "auto")))


def spinning(comm, stores=(0,), everyone=None) -> list[bool]:
    """Collective (unless given `everyone`, :func:`facts`' answer): for every rank, whether
    its waits poll first: a worker where it has a CPU to itself, a store (the ranks in
    `stores`) where its node has one more (see the module's docstring); ``MPILB_SPIN=1`` or
    ``0`` on a rank decides for it."""
    everyone = facts(comm) if everyone is None else everyone
    known = [e[:3] for e in everyone]
    return [e[3] == "1" if e[3] in ("0", "1") else own_core(e[:3], known, spare=int(r in stores))
            for r, e in enumerate(everyone)]


def start_waits(comm, stores=(0,), everyone=None) -> list[bool]:
    """Collective (unless given `everyone`): make this process's waits poll for
    :data:`SPIN_S` seconds before they sleep where :func:`spinning` says so. Returns every
    rank's answer."""
    spins = spinning(comm, stores, everyone)
    Backoff.poll_first(SPIN_S if spins[comm.Get_rank()] else 0.0)
    return spins
