"""Everything MPI: the only module that imports mpi4py.

Messages between the server and a worker are single contiguous byte buffers: a fixed-size
float64 header followed by a float32 payload (a gradient or the parameters), so a push or a
pull is one buffer message and nothing is pickled in the hot path. Lowercase (pickle-based)
mpi4py calls are only used for rare control messages: start-up checks, errors, shutdown.

MPICH's blocking waits spin a core. On an oversubscribed node a spinning rank steals the CPU
the workers need, so every wait here polls with :class:`Backoff` instead.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from enum import IntEnum
from typing import Optional

import numpy as np

try:
    import mpi4py

    mpi4py.rc.threads = True
    mpi4py.rc.thread_level = "funneled"
    from mpi4py import MPI
except ImportError as exc:  # pragma: no cover - mpi4py is an install requirement
    raise ImportError("mpilb needs mpi4py: pip install mpi4py (and an MPI library, e.g. pip install mpich)") from exc

HEADER_FIELDS = 48
HEADER_BYTES = HEADER_FIELDS * 8

# Tags. PUSH: worker -> server gradient; REPLY: server -> worker parameters or command;
# ERROR: a worker's exception text (pickled, rare); SHARD: samples sent between workers.
TAG_PUSH = 11
TAG_REPLY = 12
TAG_ERROR = 13
TAG_SHARD_BASE = 1000   # shard rows between workers: tag and tag+1 (samples, labels)
SHARD_TAGS = 10000      # transfer tags cycle through this many pairs
TAG_PREEMPT = 15


class Push(IntEnum):
    """Header fields of a worker -> server push (float64 slots)."""

    KIND = 0          # PushKind
    STEP = 1          # worker's step counter (pushes so far)
    VERSION = 2       # server version the gradient was computed on
    EPOCH = 3
    SHARD = 4
    LO = 5            # sample positions [LO, HI) of the shard's permuted order
    HI = 6
    BATCH = 7
    LOSS = 8          # loss summed over the batch
    COMPUTE_S = 9     # since the previous push
    IO_S = 10
    COMM_S = 11
    IDLE_S = 12
    NEXT_SHARD = 13   # pipeline: the batch already being computed (-1 if none)
    NEXT_LO = 14
    NEXT_HI = 15
    NEXT_EPOCH = 16
    NONFINITE = 17    # 1 if the gradient holds NaN/Inf (payload not to be applied)
    T = 18            # worker wall clock (seconds since training start)


class PushKind(IntEnum):
    GRAD = 1


class Reply(IntEnum):
    """Header fields of a server -> worker reply (float64 slots)."""

    CMD = 0           # Cmd
    VERSION = 1       # version of the parameters in the payload
    BATCH = 2         # batch size to use from now on
    HELD_S = 3        # seconds the server held this reply (ssp/sync wait): idle, not comm
    RETRY = 4         # 1: the last gradient was rejected (non-finite); recompute the batch once
    N_ASSIGN = 5      # tasks handed to the worker: epoch, shard, start, end, src, tag
    ASSIGN = 6        # src -1: read from own store; else receive rows from rank src (tag)
    N_ORDER = 18      # rows this worker must send: epoch, shard, start, end, dst, tag
    ORDER = 19
    TRUNC_EPOCH = 31  # stop the task on this shard at TRUNC_END (the rest went elsewhere)
    TRUNC_SHARD = 32
    TRUNC_END = 33
    DROP = 34         # 1: forget every task held (the server took them back: sit rounds out)


TASK_FIELDS = 6       # per assignment / per send order
class Cmd(IntEnum):
    PARAMS = 1        # payload holds parameters; carry on
    STOP = 2          # finish: no payload
    ORDERS = 3        # header only, not a reply: send these rows, then keep waiting


MAX_ASSIGN = 2
MAX_ORDER = 2


class Backoff:
    """Sleep between polls, growing from `start` to `cap` seconds; reset on progress.

    A short first sleep keeps latency low when messages come fast; the cap bounds the
    wake-ups per second (and so the CPU) when a rank waits a long time.

    When the caller knows about when the awaited message is due (``reset(due, grace)``, a
    ``time.monotonic()`` value), the sleeps are long until just before it, then every
    `fine` seconds until `grace` seconds after it, and only then grow again. A rank that
    waits for a round's reply or for the next push thus notices it within ~`fine` seconds
    without polling all the time in between. A wrong estimate costs little: too early and
    the rank polls finely for a while, too late and it sleeps through at most `fine` (the
    first sleep never goes past ``due - fine``).
    """

    def __init__(self, start: float = 20e-6, cap: float = 1e-3, fine: float = 50e-6):
        self.start = start
        self.cap = cap
        self.fine = fine
        self.delay = start
        self.due: Optional[float] = None
        self.grace = 0.0

    def reset(self, due: Optional[float] = None, grace: float = 0.0) -> None:
        self.delay = self.start
        self.due = due
        self.grace = grace

    def sleep(self) -> None:
        if self.due is not None:
            ahead = self.due - time.monotonic()
            if ahead > self.fine:
                time.sleep(min(ahead - self.fine, self.cap))
                return
            if ahead > -self.grace:
                self.short()
                return
            self.due = None           # overdue: back off from the fine interval on
            self.delay = max(self.delay, self.fine)
        time.sleep(self.delay)
        self.delay = min(self.cap, self.delay * 2)

    @staticmethod
    def short() -> None:
        """The shortest sleep (the kernel's timer slack, ~50 us): a transfer is under way
        and needs MPI progress soon, but another process may need this core."""
        time.sleep(1e-6)


class WaitEstimate:
    """How long a recurring wait lasts when it is short: a low quantile, tracked by an
    asymmetric EWMA that follows shorter waits quickly and longer ones slowly. As a
    ``(due, grace)`` for :meth:`Backoff.reset`, fine polling starts a little before it.
    """

    def __init__(self, down: float = 0.5, up: float = 0.05, early: float = 0.8):
        self.down = down
        self.up = up
        self.early = early
        self.value: Optional[float] = None

    def update(self, seconds: float) -> None:
        if self.value is None:
            self.value = seconds
        else:
            self.value += (self.down if seconds < self.value else self.up) * (seconds - self.value)

    def window(self, start: float) -> tuple[Optional[float], float]:
        """(due, grace) for a wait that began at ``start`` (``time.monotonic()``)."""
        if self.value is None:
            return None, 0.0
        return start + self.early * self.value, 2.0 * self.value + 1e-3


def new_message(payload_floats: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Allocate one message buffer and its header/payload views.

    Returns:
        (buf, header, payload): `buf` uint8 of HEADER_BYTES + 4*payload_floats bytes,
        `header` float64 view of its first HEADER_FIELDS slots, `payload` float32 view of
        the rest.
    """
    buf = np.zeros(HEADER_BYTES + 4 * payload_floats, dtype=np.uint8)
    return buf, buf[:HEADER_BYTES].view(np.float64), buf[HEADER_BYTES:].view(np.float32)


def wait(req: "MPI.Request", backoff: Optional[Backoff] = None, timeout: Optional[float] = None,
         on_poll=None) -> bool:
    """Wait for one request without spinning. Returns False on timeout.

    `on_poll` (optional) is called between polls, e.g. to serve other duties.
    """
    backoff = backoff or Backoff()
    backoff.reset()
    deadline = None if timeout is None else time.monotonic() + timeout
    while not req.Test():
        if on_poll is not None:
            on_poll()
        if deadline is not None and time.monotonic() > deadline:
            return False
        backoff.sleep()
    return True


def complete(req: "MPI.Request") -> None:
    """Finish a request whose transfer is under way: keep MPI progressing, yield the core."""
    while not req.Test():
        time.sleep(0)


def recv_when_ready(comm, buf, source: int, tag: int, backoff: Optional[Backoff] = None,
                    on_poll=None, due: Optional[float] = None, grace: float = 0.0) -> None:
    """Receive one message into `buf`, sleeping with backoff until it starts to arrive.

    A matched probe tells when the message is there; the receive itself then runs without
    sleeping, so a large transfer is not stretched over many sleeps. `due`, `grace`: when
    the message is expected (see :class:`Backoff`).
    """
    backoff = backoff or Backoff()
    backoff.reset(due, grace)
    while True:
        msg = comm.improbe(source=source, tag=tag)
        if msg is not None:
            req = msg.Irecv(buf)
            complete(req)
            return
        if on_poll is not None:
            on_poll()
        backoff.sleep()


def world():
    """(comm, rank, size) of COMM_WORLD."""
    comm = MPI.COMM_WORLD
    return comm, comm.Get_rank(), comm.Get_size()


def local_rank(comm=None) -> int:
    """This rank's index on its node: Slurm, Open MPI or MPICH variables, else a shared-memory split."""
    for var in ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"):
        value = os.environ.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    comm = comm or MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def library_version() -> str:
    """First line of the MPI library's version string."""
    return MPI.Get_library_version().strip().splitlines()[0].strip()


def mpi_info() -> dict:
    """What this process's MPI is, for `mpilb doctor` (local: no communication).

    Keys: `library` (the library's version text), `standard` (MPI standard version the
    library implements) and `compiled_standard` (the one mpi4py was compiled for), `vendor`,
    `mpi4py` (version), `mpi4py_mpicc` (the compiler mpi4py was built with; '' for a binary
    wheel), `libmpi` (path of the loaded MPI library, '' if unknown), `thread_requested` and
    `thread_level` (names), `cuda_support` (the library's MPIX_Query_cuda_support: True,
    False, or None where the library has no such query).
    """
    import ctypes
    import re

    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    libmpi = ""
    try:
        with open("/proc/self/maps") as fh:
            found = re.search(r"\s(/\S*/lib(?:mpi|mpich|impi)[\w.-]*\.so[\w.]*)$", fh.read(), re.M)
        libmpi = found.group(1) if found else ""
    except OSError:  # not Linux
        pass
    cuda_support = None
    try:
        query = getattr(ctypes.CDLL(libmpi or None), "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            cuda_support = bool(query())
    except OSError:
        pass
    vendor, version = MPI.get_vendor()
    return {
        "library": MPI.Get_library_version().strip(),
        "standard": "%d.%d" % MPI.Get_version(),
        "compiled_standard": f"{MPI.VERSION}.{MPI.SUBVERSION}",
        "vendor": f"{vendor} {'.'.join(map(str, version))}",
        "mpi4py": mpi4py.__version__,
        "mpi4py_mpicc": mpi4py.get_config().get("mpicc", ""),
        "libmpi": libmpi,
        "thread_requested": str(mpi4py.rc.thread_level),
        "thread_level": names.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "cuda_support": cuda_support,
    }


def hostnames(comm) -> list[str]:
    """Host name of every rank, in rank order (collective)."""
    return comm.allgather(socket.gethostname())


def abort(code: int = 1) -> None:
    """End every rank of the job now (used when one rank cannot go on)."""
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(code)


def wtime() -> float:
    return MPI.Wtime()


def send_error(comm, text: str) -> None:
    """Tell rank 0 this rank failed (pickled; rare)."""
    req = comm.isend(text, dest=0, tag=TAG_ERROR)
    wait(req, timeout=2.0)


def poll_error(comm) -> Optional[tuple[int, str]]:
    """(rank, text) of a worker's error report, if one is waiting."""
    status = MPI.Status()
    if comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_ERROR, status=status):
        src = status.Get_source()
        return src, comm.recv(source=src, tag=TAG_ERROR)
    return None


def notify_preempt(comm):
    """Tell rank 0 this rank received a preemption signal (rare, small). Returns the request."""
    return comm.isend(comm.Get_rank(), dest=0, tag=TAG_PREEMPT)


def drain(comm) -> None:
    """Receive stray control messages (preemption notices, late errors) before finalising."""
    status = MPI.Status()
    for tag in (TAG_PREEMPT, TAG_ERROR):
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
            comm.recv(source=status.Get_source(), tag=tag)


def poll_preempt(comm) -> bool:
    """True if some worker reported a preemption signal."""
    status = MPI.Status()
    if comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_PREEMPT, status=status):
        comm.recv(source=status.Get_source(), tag=TAG_PREEMPT)
        return True
    return False


Request = MPI.Request
ANY_SOURCE = MPI.ANY_SOURCE
