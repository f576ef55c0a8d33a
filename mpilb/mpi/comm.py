"""Everything MPI: the only module that imports mpi4py.

The messages themselves (header slots, tags, encoding) are in wire.py; this module moves
them. Lowercase (pickle-based) mpi4py calls are only used for rare control messages:
start-up checks, errors, shutdown.

MPICH's blocking waits spin a core. On an oversubscribed node a spinning rank steals the CPU
the workers need, so every wait here polls with :class:`Backoff` instead.
"""

from __future__ import annotations

import ctypes
import os
import re
import socket
import sys
import time
from typing import Optional

from mpilb.core.topology import number_nodes
from mpilb.mpi.waiting import Backoff
from mpilb.mpi.wire import TAG_ERROR, TAG_LEAVE, TAG_PREEMPT

# UCX's TCP transport (MPICH's ch4:ucx between nodes; UCX_TLS=tcp) moves a large message in
# fragments of at most UCX_TCP_RX_SEG_SIZE (64 KB by default), and a fragment moves only when
# both ends call MPI: a rank that sleeps between polls, as every wait here does, moved a
# 1-2 MB slice a fragment a wake-up. Measured on the cluster in a box (2-core VM, unshaped
# links, -hosts n0:1,n1:2,n2:2, bench ps --params 1000000 --servers 2): 46 updates/s with
# 64 KB, 90 with 128 KB, 175 with 256 KB, 230-242 with 512 KB, 279 with 1 MB, 231 with 4 MB
# (one store, whose rank 0 polls finely while it sends: 227 and 223). Set before MPI starts,
# unless the user set it; it changes nothing within a node (shared memory) and costs no
# memory that showed (peak RSS of that run's ranks 72-107 MB either way).
TCP_SEGMENT = "1m"
os.environ.setdefault("UCX_TCP_RX_SEG_SIZE", TCP_SEGMENT)

ABORT_PAUSE_S = 0.3   # before MPI_Abort: see abort()

try:
    import mpi4py

    mpi4py.rc.threads = True
    mpi4py.rc.thread_level = "funneled"
    from mpi4py import MPI
except ImportError as exc:  # pragma: no cover - mpi4py is an install requirement
    raise ImportError("mpilb needs mpi4py: pip install mpi4py (and an MPI library, e.g. pip install mpich)") from exc

def wait(req: "MPI.Request", backoff: Optional[Backoff] = None, timeout: Optional[float] = None,
         on_poll=None) -> bool:
    """Wait for one request (or every request of a list) without spinning. Returns False
    on timeout.

    `on_poll` (optional) is called between polls, e.g. to serve other duties.
    """
    done = (lambda: MPI.Request.Testall(req)) if isinstance(req, list) else req.Test
    backoff = backoff or Backoff()
    backoff.reset()
    deadline = None if timeout is None else time.monotonic() + timeout
    while not done():
        if on_poll is not None:
            on_poll()
        if deadline is not None and time.monotonic() > deadline:
            return False
        backoff.sleep()
    return True


def complete(req: "MPI.Request", on_poll=None) -> None:
    """Finish a request whose transfer is under way: keep MPI progressing, yielding the
    core after the first few polls (Backoff.FREE_POLLS).

    `on_poll` (optional) is called every :data:`COMPLETE_POLL_S` while the transfer lasts:
    a message copied in pieces moves only while its sender calls MPI, so a sender stopped or
    killed mid-transfer would keep this loop going for ever; the caller's poll (a watch on
    rank 0's silence) can end it.
    """
    polls = 0
    next_poll = None
    while not req.Test():
        polls += 1
        if polls > Backoff.FREE_POLLS:
            if on_poll is not None:
                now = time.monotonic()
                if next_poll is None:
                    next_poll = now + COMPLETE_POLL_S
                elif now >= next_poll:
                    on_poll()
                    next_poll = now + COMPLETE_POLL_S
            time.sleep(0)


COMPLETE_POLL_S = 0.05


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
            if backoff.bell is not None:
                backoff.bell.took(source)
            req = msg.Irecv(buf)
            complete(req, on_poll)
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


def nodes(comm=None) -> list[int]:
    """Node index of every rank, in rank order (collective): the ranks that share memory
    (COMM_TYPE_SHARED) are one node, and nodes are numbered in order of their lowest rank,
    so rank 0 is on node 0 (topology.number_nodes)."""
    comm = comm or MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        lowest = node.allreduce(comm.Get_rank(), op=MPI.MIN)
    finally:
        node.Free()
    return number_nodes(comm.allgather(lowest))


def _library_text() -> str:
    """The MPI library's version text, without the NUL terminator that Open MPI includes
    (HDF5 refuses strings with NULs in them, and the run log records this text)."""
    return MPI.Get_library_version().replace("\x00", "").strip()


def library_version() -> str:
    """First line of the MPI library's version string."""
    return _library_text().splitlines()[0].strip()


def library_file() -> str:
    """Path of the MPI library this process loaded ('' if unknown: not Linux)."""
    try:
        with open("/proc/self/maps") as fh:
            found = re.search(r"\s(/\S*/lib(?:mpi|mpich|impi)[\w.-]*\.so[\w.]*)$", fh.read(), re.M)
    except OSError:  # not Linux
        return ""
    return found.group(1) if found else ""


def library_named() -> str:
    """The MPI library in a few words for a message: its version line and its file."""
    path = library_file()
    return " ".join(library_version().split()) + (f" ({path})" if path else "")


def open_mpi_launcher() -> Optional[dict]:
    """This rank's Open MPI `mpirun` (ORTE) settings where it started the job, else None.

    Keys: `recovery` (`--enable-recovery` / `--mca orte_enable_recovery 1`: the job goes on
    when a rank dies), `abort_on_non_zero` (False under `--mca orte_abort_on_non_zero_status
    0`: the same, and the ranks' exit codes are not passed on) and `kill_grace` (the seconds from the SIGTERM `mpirun` sends every
    rank when it ends the job, after a rank ended or on its own SIGTERM, to its SIGKILL:
    `odls_base_sigkill_timeout`, 1 by default). mpirun passes its MCA settings to the ranks
    as OMPI_MCA_* variables; `orte_hnp_uri` is set only under mpirun (not under srun)."""
    env = os.environ
    if "OMPI_MCA_orte_hnp_uri" not in env or not _library_text().startswith("Open MPI"):
        return None
    try:
        grace = float(env.get("OMPI_MCA_odls_base_sigkill_timeout", "1"))
    except ValueError:
        grace = 1.0
    on = ("1", "t", "true", "enabled", "yes", "y")
    return {"recovery": env.get("OMPI_MCA_orte_enable_recovery", "0").lower() in on,
            "abort_on_non_zero": env.get("OMPI_MCA_orte_abort_on_non_zero_status",
                                         "1").lower() in on,
            "kill_grace": grace}


def exit_codes_ignored() -> bool:
    """Does the launcher drop the ranks' exit codes? Open MPI's mpirun does under the
    settings that keep a job going when a rank dies (`--mca orte_abort_on_non_zero_status
    0`, `--enable-recovery`): it exited 0 where every rank returned 2. MPI_Abort's code
    still comes through (not under --enable-recovery, where mpirun exits 0 always)."""
    launcher = open_mpi_launcher()
    return launcher is not None and (launcher["recovery"] or not launcher["abort_on_non_zero"])


def launcher_kill_grace() -> Optional[float]:
    """Seconds from a launcher's SIGTERM to its SIGKILL, where the launcher is known to
    follow one with the other that soon (Open MPI's mpirun); None otherwise."""
    launcher = open_mpi_launcher()
    return None if launcher is None else launcher["kill_grace"]


def mpi_info() -> dict:
    """What this process's MPI is, for `mpilb doctor` (local: no communication).

    Keys: `library` (the library's version text), `standard` (MPI standard version the
    library implements) and `compiled_standard` (the one mpi4py was compiled for), `vendor`,
    `mpi4py` (version), `mpi4py_mpicc` (the compiler mpi4py was built with, as mpi4py 3 records it;
    '' for a binary wheel and from mpi4py 4 on), `mpi4py_extension` (the file of the loaded
    mpi4py.MPI extension), `libmpi` (path of the loaded MPI library, '' if unknown), `thread_requested` and
    `thread_level` (names), `cuda_support` (the library's MPIX_Query_cuda_support: True,
    False, or None where the library has no such query).
    """
    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    libmpi = library_file()
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
        "library": _library_text(),
        "standard": "%d.%d" % MPI.Get_version(),
        "compiled_standard": f"{MPI.VERSION}.{MPI.SUBVERSION}",
        "vendor": f"{vendor} {'.'.join(map(str, version))}",
        "mpi4py": mpi4py.__version__,
        "mpi4py_mpicc": mpi4py.get_config().get("mpicc", ""),
        "mpi4py_extension": getattr(MPI, "__file__", "") or "",
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
    # Hydra's proxy forwards a rank's output from a pipe and may act on MPI_Abort's request
    # first, killing the job with the last lines (the one that says why) still unread: a
    # suite run saw exit 1 and nothing on stderr. A line printed and flushed just before
    # MPI_Abort (3 ranks, MPICH 5.0, this 2-core VM) was lost in 12 of 150 jobs, and in 0 of
    # 150 with this pause. The job is ending anyway.
    time.sleep(ABORT_PAUSE_S)
    MPI.COMM_WORLD.Abort(code)


def tell_leave(comm, code: int, skip=()) -> None:
    """Rank 0 ends a job that lost a rank, where MPI_Abort ends rank 0 alone (Open MPI's
    mpirun --enable-recovery): the others, waiting at the final barrier the lost rank never
    reaches, leave at once with `code` (:func:`leave_if_told`) instead of after its 30 s."""
    for r in range(1, comm.Get_size()):
        if r not in skip:
            comm.isend(int(code), dest=r, tag=TAG_LEAVE)   # not waited for: the job ends


def leave_if_told(comm) -> None:
    """End this rank now if rank 0 said so (:func:`tell_leave`)."""
    if comm.Iprobe(source=0, tag=TAG_LEAVE):
        code = comm.recv(source=0, tag=TAG_LEAVE)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wtime() -> float:
    return MPI.Wtime()


def send_error(comm, text: str, code: int = 1) -> None:
    """Tell rank 0 this rank failed, and the job's exit code for it (pickled; rare)."""
    req = comm.isend((text, code), dest=0, tag=TAG_ERROR)
    wait(req, timeout=2.0)


def poll_error(comm) -> Optional[tuple[int, str, int]]:
    """(rank, text, exit code) of a worker's error report, if one is waiting."""
    status = MPI.Status()
    if comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_ERROR, status=status):
        src = status.Get_source()
        text, code = comm.recv(source=src, tag=TAG_ERROR)
        return src, text, code
    return None


def notify_preempt(comm, signum: int = 15):
    """Tell rank 0 this rank received signal `signum` (rare, small). Returns the request."""
    return comm.isend(int(signum), dest=0, tag=TAG_PREEMPT)


def drain(comm) -> None:
    """Receive stray control messages (preemption notices, late errors) before finalising."""
    status = MPI.Status()
    for tag in (TAG_PREEMPT, TAG_ERROR):
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
            comm.recv(source=status.Get_source(), tag=tag)


def poll_preempt(comm) -> Optional[tuple[int, int]]:
    """(rank, signal number) of a worker's signal report, if one is waiting."""
    status = MPI.Status()
    if comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_PREEMPT, status=status):
        src = status.Get_source()
        return src, int(comm.recv(source=src, tag=TAG_PREEMPT))
    return None


def finished(req: "MPI.Request") -> bool:
    """Test a request whose peer may be gone: MPI's report of a failed transfer (a dead
    rank, under a launcher that keeps the others running) counts as finished."""
    try:
        return req.Test()
    except MPI.Exception:
        return True


Request = MPI.Request
REQUEST_NULL = MPI.REQUEST_NULL
MPIError = MPI.Exception
ANY_SOURCE = MPI.ANY_SOURCE
