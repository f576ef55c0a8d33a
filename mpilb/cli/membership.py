"""`mpilb leave RUN.h5 --rank R`: let one worker of a running job go; `mpiexec -n J mpilb
join RUN.h5`: J more workers for it (docs/membership.md).

The command reaches the job without MPI: it checks the run log (a run of this user, still
running, R a worker still in it: a rank of the job, or a worker that joined or replaced one,
as its members/ rows say), writes a request file into the directory beside the log
(server/roster.py) and waits for rank 0's answer there. Rank 0 looks for requests twice a
second; the worker leaves after its current step. Every refusal is one line and exit 2.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from mpilb.errors import MpilbError, UsageError
from mpilb.runfiles.summary import open_log
from mpilb.runfiles.requests import JOIN_PREFIX, LEAVE_PREFIX, answer_of, requests_dir, write_atomically

ANSWER_WAIT_S = 30.0


def _running(log: str, what: str = "let its workers go",
             ended: str = "it has no worker to let go") -> tuple[dict, dict]:
    """The run log of a run of this user that is running now, else one line (UsageError)."""
    attrs, cols = open_log(log)
    owner = os.stat(log).st_uid
    if owner != os.getuid():
        raise UsageError(f"{log}: a run of another user (uid {owner}): only its owner can {what}")
    status = attrs.get("status", "")
    if status != "running":
        raise UsageError(f"{log}: the run has ended (status {status}): {ended}")
    if not _written_now(log):
        raise UsageError(f"{log}: no run is writing this log (its status says running, but no "
                         f"process holds it: the run was killed?)")
    return attrs, cols


def leave(log: str, rank: int, wait_s: float = ANSWER_WAIT_S) -> int:
    """Ask the run writing `log` to let worker `rank` go; returns the exit code."""
    attrs, cols = _running(log)
    size = int(attrs.get("world_size", 1))
    stores = json.loads(attrs.get("stores", "[0]"))
    members = cols["members"]
    if not 0 <= rank < size and not _joined(members, rank):
        raise UsageError(f"--rank {rank}: the run has ranks 0-{size - 1}"
                         + (f" and workers that joined ({', '.join(map(str, _joiners(members)))})"
                            if _joiners(members) else ""))
    if rank == 0:
        raise UsageError("--rank 0 is the parameter server, not a worker: only a worker can leave")
    if rank in stores:
        raise UsageError(f"--rank {rank} holds parameters (a store of --servers), not a worker: "
                         f"only a worker can leave")
    events = [_text(e) for w, e in zip(members["worker"], members["event"]) if int(w) == rank]
    if events and events[-1] in ("leave", "lost"):
        raise UsageError(f"--rank {rank} " + ("has left the run already" if events[-1] == "leave"
                                              else "was lost: it is no longer in the run"))
    where = requests_dir(log)
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        request = os.path.join(where, f"{LEAVE_PREFIX}{rank}")
        write_atomically(request, f"{os.getpid()}\n")
    except OSError as exc:
        raise UsageError(f"{log}: cannot write the request beside the run log ({exc.strerror})") from None
    deadline = time.monotonic() + wait_s
    while (answer := answer_of(request)) is None:
        _not_ended(log, request, "it has no worker to let go")
        if time.monotonic() > deadline:
            raise MpilbError(f"{log}: no answer from the run within {wait_s:g} s (is rank 0 "
                             f"stopped?); the request stays in {where} and is taken when it goes on")
        time.sleep(0.1)
    _remove(request + ".answer", where)
    if answer.startswith("refused: "):
        raise UsageError(f"{log}: {answer}")
    print(f"{log}: {answer}")
    return 0


def _remove(path: str, where: str) -> None:
    """A request's file done with, and the requests directory `where` if that left it empty
    (other requests in it, or rank 0 removes it at the end)."""
    for remove in (lambda: os.unlink(path), lambda: os.rmdir(where)):
        try:
            remove()
        except OSError:
            pass


def _not_ended(log: str, request: str, ended: str) -> None:
    """While waiting for rank 0's answer to `request`: the run ended without one (it had
    answered the requests there at its end, before this one was written) is one line
    (UsageError, exit 2), the request and its directory removed. (Before: the wait went on
    for ANSWER_WAIT_S and ended with exit 1, "no answer".)"""
    if _written_now(log) or answer_of(request) is not None:
        return
    _remove(request, os.path.dirname(request))
    try:
        status = open_log(log)[0].get("status", "?")
    except Exception:   # (a log being replaced or damaged: its end is all that is known)
        status = "?"
    raise UsageError(f"{log}: the run has ended (status {status}): {ended}")


def _joiners(members) -> list[int]:
    """The ids of the workers that joined the run or replaced a lost one (members/ rows)."""
    return sorted({int(w) for w, e in zip(members["worker"], members["event"])
                   if _text(e) in ("join", "respawn")})


def _joined(members, rank: int) -> bool:
    return rank in _joiners(members)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def join(log: str, wait_s: float = ANSWER_WAIT_S) -> int:
    """This process becomes a worker of the run writing `log` (each rank of a launch of J
    ranks does, on its own: run/worker_join.py)."""
    from mpilb.mpi.launcher import env_world_size
    from mpilb.run.worker_join import Phases

    phases = Phases(say=bool(os.environ.get("MPILB_DEBUG")))
    if env_world_size() > 1:
        return _join_launch(log, wait_s, phases)
    attrs, values, ready = _ready(log, phases)
    return _ask(log, attrs, values, ready, phases, wait_s, start_mpi=True)


def _ready(log: str, phases):
    """A joiner's checks and preparation before it asks: the run log (a run of this user,
    running, that takes joins), the run's configuration, the data and model sized."""
    from mpilb.run.worker_join import prepare

    attrs, _ = _running(log, "add workers to it", "it takes no more workers")
    values = json.loads(attrs["config"])
    if not values.get("join", True):
        raise UsageError(f"{log}: the run was started with --no-join: it takes no workers that join")
    phases.mark("started")
    ready = prepare(values)
    phases.mark("prepared")
    return attrs, values, ready


def _join_launch(log: str, wait_s: float, phases) -> int:
    """A rank of a join launch of J > 1 ranks. MPI starts first: MPI_Init waits for every
    rank of the launch, so a rank that failed its checks before it (a node without the
    data, a run that ended) left the others in MPI_Init for good (measured: a launch of 2
    whose rank 1 was refused waited until it was killed). The launch then agrees on the
    checks: where every rank failed them alike, the launch's rank 0 says it once; where some
    did, each of those says why, naming its rank and host, and the others join. Every rank
    finalises alone (each is a joiner of its own: one that ended must not hold the others'
    end, nor they its own)."""
    from mpilb.cli.launch import exit_code
    from mpilb.mpi import comm as C
    from mpilb.mpi.departure import finalize_alone
    from mpilb.run.worker_join import ready_to_connect

    ready_to_connect()
    comm, rank, _ = C.world()
    finalize_alone()
    phases.mark("mpi")
    try:
        attrs, values, ready = _ready(log, phases)
        failed = None
    except Exception as exc:   # (told to the launch's other ranks, which would wait for it)
        failed = exc
    why = "" if failed is None else str(failed)
    whys = comm.allgather(why)   # (once, at the start: the launch's ranks, not the run's)
    if failed is not None and all(w == why for w in whys):
        raise failed   # the same for every rank: said once, by the launch's rank 0 (main)
    if failed is not None:
        raise RankError(f"rank {rank} of this launch (on {socket.gethostname()}): {why}",
                        exit_code(failed))
    try:
        return _ask(log, attrs, values, ready, phases, wait_s, start_mpi=False)
    except UsageError as exc:   # (a refusal of this rank's join: its siblings may be joined)
        raise RankError(f"rank {rank} of this launch (on {socket.gethostname()}): {exc}", 2) from None


def _withdraw(request: str, exc: BaseException) -> None:
    """Tell rank 0 that this joiner will not connect to the port it was offered, and why
    (server/admission.py, `.withdrawn`)."""
    why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    try:
        write_atomically(request + ".withdrawn", why + "\n")
    except OSError:
        pass   # (rank 0 then drops the offer after its timeout)


class RankError(MpilbError):
    """What only this rank of a join launch met: said by this rank (the launch's other
    ranks go on), with its exit code."""

    def __init__(self, text: str, code: int):
        super().__init__(text)
        self.exit_code = code


def _ask(log: str, attrs: dict, values: dict, ready, phases, wait_s: float, start_mpi: bool) -> int:
    """Ask rank 0 to join (the request file), take its port, connect and work."""
    from mpilb.run.worker_join import ready_to_connect, run_joined

    where = requests_dir(log)
    request = os.path.join(where, f"{JOIN_PREFIX}{os.getpid()}")
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        write_atomically(request, f"{socket.gethostname()} {os.getpid()}\n{ready.signature()}\n")
    except OSError as exc:
        raise UsageError(f"{log}: cannot write the request beside the run log ({exc.strerror})") from None
    phases.mark("asked")
    if start_mpi:
        ready_to_connect()   # while rank 0 takes the request
        phases.mark("mpi")
    port, offered = _offered(request, log, time.monotonic() + wait_s)
    try:
        if values.get("store") == "local":   # its node's shards, checked (run/worker_join.py)
            from mpilb.run.worker_join import hold_node_copies

            hold_node_copies(ready, json.loads(attrs.get("hostnames", "[]")),
                             int(attrs.get("world_size", 1)), offered.get("files") or [])
        phases.mark("offered")
        from mpilb.mpi import doorbell

        bell, ringback = doorbell.join_job(offered.get("bell"))
    except BaseException as exc:   # rank 0 drops the port it offered at once (not after 60 s)
        _withdraw(request, exc)
        raise
    write_atomically(request + ".connecting", json.dumps(ringback))
    if not os.path.exists(request + ".port"):   # the run ended meanwhile (Admissions.turn_away)
        bell.close()
        raise UsageError(f"{log}: refused: the run has ended")
    return run_joined(ready, port, request, log, bell, phases)


def _offered(request: str, log: str, deadline: float) -> tuple[str, dict]:
    """Rank 0's answer to a join request: the port it opened for this joiner and what it
    wrote beside it (server/admission.py: "bell", its doorbell's invitation; with --store
    local "files", its shards' entries), or its refusal (UsageError)."""
    polls = 0
    while not os.path.exists(request + ".port"):
        answer = answer_of(request)
        if answer is not None:
            os.unlink(request + ".answer")
            raise UsageError(f"{log}: {answer}")
        polls += 1
        if polls % 25 == 0:   # (every 0.25 s: the log's lock, not every 10 ms)
            _not_ended(log, request, "it takes no more workers")
        if time.monotonic() > deadline:
            raise MpilbError(f"{log}: no answer from the run within {ANSWER_WAIT_S:g} s (is rank 0 stopped?)")
        time.sleep(0.01)
    with open(request + ".port") as fh:
        port, _, rest = fh.read().partition("\n")
    try:
        facts = json.loads(rest) if rest.strip() else {}
    except ValueError:
        facts = {}
    return port.strip(), facts if isinstance(facts, dict) else {}


def _written_now(log: str) -> bool:
    """Does a process hold the run log's lock (runlog.RunLog._lock): is a run writing it?"""
    try:
        fd = os.open(log, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True   # a file system without locks: take the status's word
    finally:
        os.close(fd)
    return False
