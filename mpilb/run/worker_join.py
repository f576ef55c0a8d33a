"""A worker that joins a running job (`mpiexec -n J mpilb join RUN.h5`, cli/membership.py):
the run's configuration from its log, a connection to rank 0 (mpi/joining.py), then the
same worker loop as every other worker, on that connection. At the end it meets rank 0
once more (mpi/departure.py) and disconnects, so that both launches end with exit 0.

Every rank of a joiner's launch is a joiner of its own: its own request, port and
connection (MPI_COMM_SELF connects), so that J of them join as J workers.

The path to the first push is ordered so that the joiner's own start overlaps rank 0's
(docs/membership.md): what the request must name (the data's shard sizes, the model's
size) first, then the request, then, while rank 0 looks for it (twice a second) and opens
a port, MPI's start and the worker's code; the doorbell with rank 0 is opened from what
rank 0 writes beside the port, so that the joiner's pushes and rank 0's replies ring as
the job's own workers' do (mpi/doorbell.py).

With `--store local` a joiner reads the shards its node holds (those placed on the job's
workers on its host), checked against rank 0's checksums first where its node is not rank
0's (:func:`hold_node_copies`); the rows of the others come from rank 0
(worker/row_exchange.py, server/relay.py). A joiner let go (`mpilb leave`, SIGUSR2) takes
the rows still on their way, meets rank 0 on its connection, disconnects and finalises
alone (:func:`leave_the_run`): its launch exits 0 while the run goes on."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

from mpilb.errors import MpilbError, UsageError
from mpilb.runfiles.requests import answer_of

CONNECT_TIMEOUT_S = 60.0   # rank 0 accepts or drops a joiner well within this (server/admission.py)
ANSWER_POLL_S = 0.005      # the answer follows rank 0's accept by a few ms


@dataclass
class Phases:
    """When each step of a join was reached (seconds from the joiner's start), said in one
    line on stderr at its admission where `say` (MPILB_DEBUG=1): started, the run log
    read, prepared (data and model), asked (the request written), mpi (MPI started and the
    worker's code imported), offered (rank 0's port read), connected, admitted."""

    say: bool = False
    start: float = field(default_factory=time.monotonic)
    marks: list = field(default_factory=list)

    def mark(self, name: str) -> None:
        self.marks.append((name, time.monotonic() - self.start))

    def line(self) -> str:
        return "mpilb: join phases (s from its start): " + ", ".join(f"{n} {t:.3f}" for n, t in self.marks)

    def tell(self) -> None:
        if self.say:
            print(self.line(), file=sys.stderr, flush=True)


@dataclass
class Prepared:
    """What a joiner has ready before it asks to join: its configuration (the run's), its
    data, and what rank 0 compares with its own (the shards' sizes, the model's size)."""

    cfg: object
    dataset: object
    num_params: int
    held: set | None = None   # --store local: the shards it reads itself (hold_node_copies)

    def signature(self) -> str:
        """The lines after "HOST PID" in the request (server/admission.py reads them)."""
        return json.dumps({"shards": list(map(int, self.dataset.shard_sizes)),
                           "params": int(self.num_params)})


def prepare(values: dict) -> Prepared:
    """What the request names, before it is written (the rest waits for rank 0 meanwhile:
    :func:`ready_to_connect`)."""
    from mpilb.config.sections import Config
    from mpilb.data.dataset import open_dataset
    from mpilb.run.components import config_model, hold_out_validation

    # --inject names ranks of the job, not of this launch (whose world is 1 rank, or 2 once
    # merged): it stays the job's (a joiner with it failed its check at once: "rank 2 is
    # not in this job of 2 rank(s)")
    cfg = Config.from_values(dict(values, inject=[]))
    cfg.store_ranks = (0,)   # (the stores of the job: known once connected, stores_joined)
    dataset = hold_out_validation(cfg.inputs, open_dataset(values["data"], check_files=False))
    return Prepared(cfg, dataset, config_model(cfg, dataset).num_params)


def hold_node_copies(ready: Prepared, hosts: list[str], world_size: int, files: list) -> None:
    """--store local: the shards this joiner reads itself, its node's (those placed on the
    job's workers on this host; none where no worker of the job runs here), into
    `ready.held`; on another node than rank 0's, its copies of them are checked against
    rank 0's entries `files` (file, samples, sha256), as a node's first rank checks them at
    start-up (DataError, one line). Rank 0 computes the same set (server/relay.py)."""
    import socket

    from mpilb.core.topology import workers_of
    from mpilb.worker.node_copies import verify_joiner_copies
    from mpilb.worker.row_exchange import node_shards

    cfg, host = ready.cfg, socket.gethostname()
    held = node_shards(len(ready.dataset.shard_sizes), host, workers_of(cfg, world_size),
                       cfg.inputs.replicas, hosts)
    if files and hosts:
        verify_joiner_copies(cfg.inputs.data, [tuple(f) for f in files], sorted(held), host, hosts[0])
    ready.held = held


def ready_to_connect() -> None:
    """While rank 0 answers the request: MPI's start and the worker's code (imported now,
    not between the connection and the first push)."""
    from mpilb.mpi import comm as C
    from mpilb.worker import loop  # noqa: F401

    C.world()


def run_joined(ready: Prepared, port: str, request: str, log: str = "", bell=None,
               phases: Phases | None = None) -> int:
    """Join the run at MPI port `port` with what `ready` holds; returns the exit code.
    `bell`: this joiner's doorbell with rank 0 (doorbell.join_job), rung from its admission."""
    from mpilb.mpi import doorbell, joining

    phases = phases or Phases()
    comm = joining.connect(port, CONNECT_TIMEOUT_S)
    if comm is None:
        answer = answer_of(request)
        for stale in (request + ".connecting", request + ".answer"):
            try:
                os.unlink(stale)   # (rank 0 must not accept it now: mpi/joining.py)
            except OSError:
                pass
        if answer is not None and answer.startswith("refused"):
            raise UsageError(f"{log}: {answer}")
        raise MpilbError(f"{log}: rank 0 did not accept this joiner within {CONNECT_TIMEOUT_S:g} s "
                         f"(is it stopped?)")
    phases.mark("connected")
    deadline = time.monotonic() + 10.0
    while (answer := answer_of(request)) is None and time.monotonic() < deadline:
        time.sleep(ANSWER_POLL_S)
    if answer is not None:
        print(f"mpilb: {'error: ' if answer.startswith('refused') else ''}{answer}", file=sys.stderr, flush=True)
        try:
            os.unlink(request + ".answer")
        except OSError:
            pass
    if bell is not None and answer is not None and answer.startswith("joined as worker "):
        bell.rank = int(answer.rsplit(" ", 1)[1])   # its rings name it by its id in the job
        doorbell.install(bell)
    phases.mark("admitted")
    phases.tell()
    return work(ready, comm, answer)


def work(ready: Prepared, comm, answer) -> int:
    """Be a worker of the run on `comm` (rank 0 of the run is its rank 0) until the run ends
    (`answer`: rank 0's word, "joined as worker N" or "refused: ..."); the exit code. A
    joiner's and a replacement's (run/replacement.py) alike."""
    from mpilb.cli.launch import _install_signal_handlers
    from mpilb.mpi import departure, joining
    from mpilb.worker.loop import Worker

    cfg, dataset = ready.cfg, ready.dataset
    cfg.store_ranks = stores_joined(comm)
    _install_signal_handlers(comm.Get_size())   # a worker's: its SIGTERM is told to rank 0
    try:
        worker = Worker(cfg, dataset, comm, comm.Get_rank(),
                        joined=ready.held if ready.held is not None else set())
        worker.run()   # (turned away as the run ended: STOP at once)
    except Exception as exc:   # told to rank 0, which ends the run as for any worker's
        return _failed(comm, exc, answer)
    if worker.left:
        return leave_the_run(worker, comm, answer)
    departure.end_together(comm, comm.Get_rank(), timeout=None)
    joining.disconnect(comm)
    return 2 if answer is not None and answer.startswith("refused") else 0


def stores_joined(comm) -> tuple:
    """The store ranks on a joiner's communicator: every rank before the joiner's own, the
    last (--servers K > 1: rank 0 and the other stores accepted it together, store s as its
    rank s: server/store_joins.py; else rank 0 alone)."""
    return tuple(range(comm.Get_size() - 1))


def _failed(comm, exc: BaseException, answer) -> int:
    """This joiner failed: rank 0 is told (its one line names the worker), this launch ends
    with the error's exit code without the job's end (rank 0 ends the run)."""
    from mpilb.cli.launch import describe, exit_code
    from mpilb.mpi import comm as C
    from mpilb.mpi import departure

    worker = answer.removeprefix("joined as ") if answer else "a joiner"
    text = describe(exc, 1).removeprefix("rank 1: ")
    C.send_error(comm, text, exit_code(exc))
    departure.finalize_alone()   # (MPI_Finalize would wait for rank 0, which ends the run)
    print(f"mpilb: error: {worker}: {text}", file=sys.stderr, flush=True)
    return exit_code(exc)


def leave_the_run(worker, comm, answer) -> int:
    """Rank 0 let this joiner go (LEAVE, after its step): the rows still on their way to
    it are taken, it says it is done and rank 0 answers (server/farewell.py), both
    disconnect, and it finalises alone (the other ranks of its launch, if any, run on).
    Exit 0; rank 0 that does not answer within 30 s (stopped) leaves it to finalise alone
    connected, which MPICH's local finalize allows."""
    from mpilb.mpi import departure, joining

    worker.rows.settle_receives()
    met, _ = departure.end_together(comm, comm.Get_rank(), timeout=30.0)
    if met:
        joining.disconnect(comm)
    departure.finalize_alone()
    who = answer.removeprefix("joined as ") if answer else "this worker"
    print(f"mpilb: {who} left the run (let go); the run goes on", file=sys.stderr, flush=True)
    return 0
