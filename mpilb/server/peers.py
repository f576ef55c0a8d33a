"""The server's view of each worker: its link (buffers, requests) and an explicit state.

A worker's state has two parts, waiting and membership (:mod:`mpilb.core.worker_state`),
changed only by the named methods below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mpilb.core.worker_state import Membership, Waiting, WorkerState
from mpilb.mpi import wire, wire_format
from mpilb.mpi.waiting import WaitEstimate


class Headers:
    """Header-only send buffers of one kind (replies, or orders) for one worker.

    A buffer whose last send is not known to be finished is never written again: another
    is made. A send need not finish before its receiver takes it (a message above MPI's
    eager size, or any once the transport's buffers toward that rank are full: under Open
    MPI's shared memory even a 384-byte reply header to a dead worker never finished), and
    a worker that died after its push, not yet declared lost, takes nothing: waiting for
    such a send blocked rank 0 for good (a wake of that idle worker at an epoch's start, or
    its STOP). Alive, a worker receives its messages in order, so the pool stays
    at the two a pipelined worker needs."""

    def __init__(self, n: int):
        self.bufs = [wire.new_message(0) for _ in range(n)]
        self.reqs: list = [None] * n

    def take(self, finished) -> int:
        """Index of a buffer free to write (`finished`: request -> done), made if none is."""
        for i, req in enumerate(self.reqs):
            if req is None or finished(req):
                return i
        self.bufs.append(wire.new_message(0))
        self.reqs.append(None)
        return len(self.bufs) - 1

    def __len__(self) -> int:
        return len(self.bufs)


@dataclass
class Link:
    """Message buffers and outstanding requests of one worker (MPI requests are opaque here)."""

    recv: wire.MessageBuffer        # the next push (its payload: this rank's slice)
    replies: Headers                # reply headers: x1, x2 pipelined, more while sends hang
    orders_msg: Headers             # headers for Cmd.ORDERS
    reply_req: Optional[object] = None    # the latest reply header's send
    recv_req: Optional[object] = None
    orders_req: Optional[object] = None   # the latest orders' send
    sends: list = field(default_factory=list)   # every send to it not known to be finished
    comm: Optional[object] = None   # a worker that joined: its own communicator (roster.py),
    dest: int = -1                  # and its rank there; None, -1: MPI_COMM_WORLD, its rank
    # --chunk-kb (mpi/chunks.py): per store, the chunks of the worker's slice, or None
    plans: list = field(default_factory=list)
    rest: list = field(default_factory=list)   # receives of rank 0's chunks after the first
    streamed: bool = False   # its reply's parameters went with the step (Op.STREAM)
    broken: Optional[str] = None   # a chunk of its push failed to come: it is lost
    late: bool = False   # chunks of its last push still to come (chunks.STALL_S passed)
    waited: float = 0.0   # s rank 0 waited in its last push for its chunks (ChunkWaits)
    # its pushes are taken once their chunks are in (receive.py): from its first push (a
    # slow link's would hold rank 0 before it is known slow) until one came within DEFER_S
    defer: bool = True

    @property
    def chunked(self) -> bool:
        """Some store exchanges chunks with this worker (its applied pushes stream)."""
        return any(p is not None for p in self.plans)

    def address(self, world, rank: int) -> tuple:
        """(communicator, rank) to reach this worker at: `world`, `rank` unless it joined."""
        return (world, rank) if self.comm is None else (self.comm, self.dest)

    @classmethod
    def allocate(cls, n: int, pipelined: bool, push_floats: Optional[int] = None,
                 fmt: Optional[wire_format.WireFormat] = None) -> "Link":
        # pipelined workers compute on the previous reply while the next is sent: two slots
        # (the parameters are sent from the ParamRing itself, not from a copy per worker);
        # a push may carry more than the n parameters' gradient (the model's state after it);
        # --wire other than fp32: n wire values, then the state in float32
        push_floats = n if push_floats is None else push_floats
        recv = (wire.new_message(push_floats) if fmt is None or fmt.is_fp32
                else wire_format.new_message(fmt, n, push_floats - n))
        return cls(recv=recv, replies=Headers(2 if pipelined else 1), orders_msg=Headers(1))

    def sent(self, req) -> None:
        """Keep `req`, a send to this worker, until it is known to be finished."""
        self.sends.append(req)

    def pending(self, finished) -> list:
        """The sends to this worker not finished yet (`finished`: request -> done)."""
        self.sends = [r for r in self.sends if not finished(r)]
        return self.sends


@dataclass
class Peer(WorkerState):
    """One worker as rank 0 sees it (its state read through :class:`WorkerState`)."""

    rank: int
    link: Optional[Link] = None
    batch: int = 0
    waiting: Waiting = Waiting.IDLE
    membership: Membership = Membership.ACTIVE
    held_since: float = 0.0
    benched_at: float = 0.0
    probing: int = 0         # back from the bench for a try: pushes left until the verdict
    lags: list = field(default_factory=list)   # its step minus the others' longest, per round
    drop: bool = False       # the next reply tells it to forget its tasks
    retry: bool = False      # ask the worker to recompute its last batch
    retried: bool = False    # that batch was already retried once
    leaving: bool = False    # asked to leave: its next reply is LEAVE (roster.py)
    step: int = 0
    last_seen: float = 0.0
    pushed_at: float = 0.0   # when its last push was taken (time.monotonic())
    told_at: float = 0.0     # when rank 0 last sent it anything (keep-alives: watchdog.py)
    awaiting: bool = False   # sent work and parameters, its next push is to come
    push_gap: WaitEstimate = field(default_factory=WaitEstimate)   # reply -> next push
    last_gap: Optional[float] = None   # reply -> push of its last push (its step's cost)
    last_push: Optional[wire.PushMsg] = None
    # accumulators for the workers/ log (since the last row)
    samples: int = 0
    compute_s: float = 0.0
    io_s: float = 0.0
    comm_s: float = 0.0
    idle_s: float = 0.0
    # per epoch
    epoch_busy: float = 0.0
    epoch_finish: Optional[float] = None

    # ----------------------------------------------------------------- reading
    @property
    def present(self) -> bool:
        """Still in the run (active or benched): not stopped, lost or left."""
        return self.membership in (Membership.ACTIVE, Membership.BENCHED)

    # ----------------------------------------------------------------- waiting
    def wake(self) -> None:
        """An idle worker was sent work."""
        self.waiting = Waiting.COMPUTING

    def hold(self, now: float) -> None:
        """Its push was taken; the reply waits (ssp bound, sync round)."""
        self.waiting = Waiting.HELD
        self.held_since = now

    def release(self, now: float) -> float:
        """Its reply goes out now. Returns the seconds it was held (0 if it was not)."""
        held_s = now - self.held_since if self.held else 0.0
        self.waiting = Waiting.COMPUTING
        return held_s

    # ----------------------------------------------------------------- membership
    def bench(self, now: float) -> None:
        """Sits sync rounds out; its next reply tells it to drop its tasks."""
        self.membership = Membership.BENCHED
        self.probing = 0
        self.benched_at = now
        self.batch = 0
        self.drop = True

    def unbench(self, probe_batch: int) -> None:
        """Back for a try: two probing steps at `probe_batch` decide (see sitout.py)."""
        self.membership = Membership.ACTIVE
        self.probing = 2   # two steps: the first after a long idle wait runs cold
        self.batch = probe_batch

    # ----------------------------------------------------------------- accounting
    def take_row(self) -> dict:
        """Its `workers/` counters since the last row (and reset them)."""
        row = dict(samples=self.samples, compute_s=self.compute_s, io_s=self.io_s,
                   comm_s=self.comm_s, idle_s=self.idle_s)
        self.samples, self.compute_s, self.io_s, self.comm_s, self.idle_s = 0, 0.0, 0.0, 0.0, 0.0
        return row


def present(peers) -> list[Peer]:
    """The workers still in the run (the old `active()`)."""
    return [p for p in peers if p.present]


class Roster:
    """Every worker of the run as rank 0 sees it, and the ranks lost so far (those that
    left: :class:`~mpilb.server.roster.Members`).

    Args:
        peers: rank -> :class:`Peer`.
    """

    def __init__(self, peers: dict):
        self.peers = peers
        self.lost: list[int] = []   # ranks declared lost, in order

    def present(self) -> list[Peer]:
        """Workers still in the run (active or benched; not stopped, not lost)."""
        return [p for p in self.peers.values() if p.present]

    def all_stopped(self) -> bool:
        return all(w.stopped or w.lost or w.left for w in self.peers.values())
