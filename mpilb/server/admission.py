"""Workers that join a running job (`mpilb join RUN.h5`, cli/membership.py), on rank 0.

The handshake goes through files in the requests directory beside the run log
(server/roster.py), so that rank 0 never blocks in MPI_Comm_accept while it serves:

    joiner: join-PID                 "I want to join" (it holds "HOST PID")
    rank 0: join-PID.port            the name of a port opened for this joiner, and
                                     how to ring rank 0's doorbell (mpi/doorbell.py); or
            join-PID.answer          "refused: ..."
    joiner: join-PID.connecting      "I am in MPI_Comm_connect now", and how to ring it
            (or join-PID.withdrawn   "I gave up after the port: why", e.g. its node's copies)
    rank 0: accepts (~20 ms), then join-PID.answer "joined as worker N"

Rank 0 looks for requests twice a second, and at every round of its chores while a port
it offered waits for its joiner's `.connecting` (Members.poll): the admission proper then
costs the joiner one chores interval, not half a second.

A joiner that dies on the way is dropped with one line (:meth:`Admissions.drop`) and the
run goes on; nothing of it was counted: it gets an id and a place only once accepted.

The joiner becomes a worker like the others: a :class:`~mpilb.server.peers.Peer` on its own
communicator, a place in the ledger and the balancer; it is woken with work at once. Its
id in the logs is above every rank of the job.

With --servers K > 1 every other store takes part in the accept (:meth:`accept_on_stores`,
server/store_joins.py): the joiner's communicator then holds every store (store s its rank
s, the joiner rank K), and its slices go to each store as a job's worker's do. With --mode
ssp it starts at the slowest busy worker's step (it is woken as an idle worker is); with
--mode sync one accepted while a round is open is admitted at that round's close
(:meth:`defer_to_round`, server/round_entry.py).

With `--store local` a joiner reads its node's shards, checked against the checksums its
port file names, and is one more holder of them, one that sends no rows; rows of other
shards reach it through rank 0 (relay.py). A joiner let go (`mpilb leave`, SIGUSR2) is told
LEAVE like any worker, then both disconnect (farewell.py) and the run goes on.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Optional

from mpilb.core.holdings import Holding
from mpilb.runfiles.requests import JOIN_PREFIX, write_atomically
from mpilb.server.farewell import Farewells
from mpilb.server.peers import Peer
from mpilb.server.relay import hold_node_copies
from mpilb.server.round_entry import Entry, RoundEntry

PORT_SUFFIX = ".port"
CONNECTING_SUFFIX = ".connecting"
WITHDRAWN_SUFFIX = ".withdrawn"
END_TIMEOUT_S = 30.0
ACCEPT_TIMEOUT_S = 5.0    # a joiner says it connects and calls MPI_Comm_connect at once
OFFER_TIMEOUT_S = 60.0    # from a port offered to the joiner saying it connects


@dataclass
class Offer:
    """A port offered to one joiner (its request file `path`, its host and process)."""

    path: str
    port: str
    host: str
    pid: int
    since: float

    @property
    def who(self) -> str:
        return f"pid {self.pid} on {self.host}" if self.pid else os.path.basename(self.path)

    def here(self) -> bool:
        """Is the joiner's process on this host (where rank 0 can see it)?"""
        return self.pid > 0 and self.host == socket.gethostname()

    def gone(self) -> bool:
        """Has the joiner's process ended? (Only seen on rank 0's host: elsewhere, no.)"""
        return self.here() and not process_alive(self.pid)


def process_alive(pid: int) -> bool:
    """Is `pid` a process that has not ended (a zombie awaiting its parent has)?"""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True


def remove(*paths: str) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def ringback_of(path: str) -> dict:
    """How a joiner's doorbell is rung (its `.connecting` file: a JSON object with "local",
    a socket name, or "net", an address): {} where it has none."""
    try:
        with open(path) as fh:
            found = json.loads(fh.read() or "{}")
    except (OSError, ValueError):
        return {}
    return {k: found[k] for k in ("local", "net") if found.get(k)} if isinstance(found, dict) else {}


def withdrawal(request: str) -> str:
    """Why the joiner of `request` gave up before it connected (its `.withdrawn`, removed)."""
    try:
        with open(request + WITHDRAWN_SUFFIX) as fh:
            why = fh.read().strip()
    except OSError:
        why = ""
    remove(request + WITHDRAWN_SUFFIX)
    return why or "no reason given"


def who_asks(path: str) -> tuple[str, int, dict]:
    """(host, pid, what it brings) of a request file: "HOST PID", then a JSON line of the
    joiner's shard sizes and model size (run/worker_join.py); ("", 0, {}) where it names none."""
    try:
        with open(path) as fh:
            first, _, rest = fh.read().partition("\n")
        host, pid = first.split()
        return host, int(pid), (json.loads(rest) if rest.strip() else {})
    except (OSError, ValueError):
        return "", 0, {}


class Admissions:
    """Joins of a run (rank 0): the handshake, then the joiner served as a worker.

    Every step of an admission is bounded, so that a joiner that dies in it costs the run
    at most :data:`ACCEPT_TIMEOUT_S` once (docs/membership.md, "When a join fails"): rank 0
    calls MPI_Comm_accept only for a joiner whose process it does not see ended, and with
    MPICH's timeout; a joiner that never says it connects is dropped after
    :data:`OFFER_TIMEOUT_S`, or at once when its process is seen gone.

    Args:
        server: the :class:`~mpilb.server.loop.ParameterServer`.
        members: its :class:`~mpilb.server.roster.Members` (the `members/` rows).
    """

    def __init__(self, server, members):
        self.server = server
        self.members = members
        self.offers: dict[str, Offer] = {}   # request path -> the port it was offered
        self.ports: list[str] = []           # every port opened: closed at the job's end only
        self.joined: list = []   # (worker id, communicator)
        self.relay = None        # --store local: rows for joiners (relay.py), from the first
        self.farewells = Farewells(server, lambda: self.relay)   # joiners let go (farewell.py)
        self.last_id = 0         # the highest id handed out (a joiner turned away has one)
        self.reserved = None     # the id the stores accepted the next joiner as (K > 1)
        self.entering = RoundEntry(lambda: server.rule)   # --mode sync: at a round's close

    def poll(self, directory: str, names: list[str]) -> None:
        """The requests directory's files `names`: new requests get a port (or a refusal),
        offers whose joiner says it connects are accepted."""
        present = set(names)
        for name in sorted(names):
            if name.startswith(JOIN_PREFIX) and "." not in name:
                try:
                    self.offer(os.path.join(directory, name))
                except OSError:
                    pass
        mono = time.monotonic()
        for path, offer in list(self.offers.items()):
            try:
                if os.path.basename(path) + WITHDRAWN_SUFFIX in present:   # (not after 60 s)
                    self.drop(offer, f"withdrew ({withdrawal(path)})", tell=False)
                elif offer.gone():
                    self.drop(offer, "ended before it connected", tell=False)
                elif os.path.basename(path) + CONNECTING_SUFFIX in present:
                    self.accept(offer)
                elif mono - offer.since > OFFER_TIMEOUT_S:
                    self.drop(offer, f"did not connect within {OFFER_TIMEOUT_S:g} s of its port")
            except OSError:
                pass

    def refusal(self) -> str:
        s = self.server
        cfg = s.cfg
        if s.stop.reason:
            return f"the run is stopping ({s.stop.reason})"
        if not cfg.faults.join:
            return "the run was started with --no-join: it takes no workers that join"
        return ""

    def mismatch(self, brings: dict) -> str:
        """Why a joiner's data or model are not the run's ("" where they are, or unknown)."""
        s = self.server
        ours = list(map(int, s.tracker.shard_sizes))
        if "shards" in brings and brings["shards"] != ours:
            theirs = brings["shards"]
            return (f"the joiner's data (--data {s.cfg.inputs.data}) is not the run's: "
                    f"{len(theirs)} shards of {sum(theirs)} samples, the run's {len(ours)} of {sum(ours)}")
        if "params" in brings and brings["params"] != s.model.num_params:
            return (f"the joiner's model has {brings['params']} parameters, the run's "
                    f"{s.model.num_params}: not the run's model")
        return ""

    def offer(self, path: str) -> None:
        """A joiner asks: a port of its own, or why not."""
        host, pid, brings = who_asks(path)
        why = self.refusal() or self.mismatch(brings)
        if why:
            write_atomically(path + ".answer", f"refused: {why}\n")
        else:
            from mpilb.mpi import joining

            port = joining.open_port()
            self.ports.append(port)
            self.offers[path] = Offer(path, port, host, pid, time.monotonic())
            bell = self.server.receiver.bell.invitation()
            offered = {"bell": bell, **local_store_facts(self.server)}
            write_atomically(path + PORT_SUFFIX, port + "\n" + json.dumps(offered) + "\n")
        os.unlink(path)

    def drop(self, offer: Offer, why: str, tell: bool = True) -> None:
        """The admission of `offer`'s joiner ends without it: one line, the run goes on, and
        (`tell`: it may still be there to read it) the joiner's answer. Its port stays open,
        unused (see mpi/joining.py)."""
        self.offers.pop(offer.path, None)
        remove(offer.path + PORT_SUFFIX, offer.path + CONNECTING_SUFFIX)
        print(f"mpilb: a join ({offer.who}) was dropped: the joiner {why}; the run goes on",
              file=sys.stderr, flush=True)
        if tell:
            write_atomically(offer.path + ".answer", f"refused: the joiner {why}\n")

    def connected(self, offer: Offer):
        """The joiner of `offer` says it waits in MPI_Comm_connect: its communicator, or None
        (dropped). Never called for a process seen ended: its connection request may wait at
        rank 0 all the same, and answering it would end rank 0 (MPICH's UCX transport
        crashed so, measured: signal 11, on an accept whose connector had ended)."""
        if offer.gone():
            self.drop(offer, "ended before it connected", tell=False)
            return None
        self.offers.pop(offer.path, None)
        remove(offer.path + CONNECTING_SUFFIX, offer.path + PORT_SUFFIX)
        comm = self.accept_on_stores(offer)
        if comm is None:
            ended = offer.here()
            if ended and process_alive(offer.pid):
                # Its connection, if it came now, would reach the receive MPICH left posted
                # (mpi/joining.py): the process ends instead.
                os.kill(offer.pid, signal.SIGKILL)
            self.drop(offer, f"did not connect within {ACCEPT_TIMEOUT_S:g} s of saying it would",
                      tell=not ended)
        return comm

    def next_id(self) -> int:
        """The id the next worker admitted gets: above every rank of the job and every id
        given before."""
        s = self.server
        return max([s.comm.Get_size() - 1, *s.peers, self.last_id]) + 1

    def accept_on_stores(self, offer: Offer):
        """MPI's accept of `offer`'s joiner (bounded by ACCEPT_TIMEOUT_S): rank 0's alone,
        or with --servers K > 1 every store's with it, so that the joiner's communicator
        holds every store (server/store_joins.py). Its communicator, or None."""
        from mpilb.mpi import joining

        slices = self.server.slices
        if not slices.sliced:
            return joining.accept(offer.port, ACCEPT_TIMEOUT_S)
        self.reserved = self.next_id()   # the stores know the joiner by it
        comm = slices.accept_joiner(self.reserved, offer.port, ACCEPT_TIMEOUT_S)
        if comm is None:
            self.reserved = None
        return comm

    def accept(self, offer: Offer) -> None:
        """The joiner waits in MPI_Comm_connect: take it (a blocking call, ~20 ms)."""
        ringback = ringback_of(offer.path + CONNECTING_SUFFIX)
        comm = self.connected(offer)
        if comm is None:
            return
        if self.defer_to_round(Entry(comm, offer, ringback, self.reserved)):
            return
        rank = self.admit(comm, offer, ringback)
        write_atomically(offer.path + ".answer", f"joined as worker {rank}\n")

    # ----------------------------------------------------------------- --mode sync
    def defer_to_round(self, entry: Entry) -> bool:
        """--mode sync with a round open: the joiner is admitted at the round's close
        (round_entry.py). False where it is admitted now."""
        if not self.entering.defer(entry):
            return False
        self.reserved = None
        if entry.reserved is not None:   # (the stores know it by that id)
            self.last_id = max(self.last_id, entry.reserved)
        return True

    def round_closed(self) -> None:
        """A sync round closed and its members were released: the joiners that waited for
        it are admitted now, on the new version as the members are."""
        def admit(entry: Entry) -> None:
            if self.server.stop.reason:   # (the run is stopping: it would get no work)
                return self.stop_accepted(entry.comm, entry.offer.path)
            self.reserved = entry.reserved
            rank = self.admit(entry.comm, entry.offer, entry.ringback)
            write_atomically(entry.offer.path + ".answer", f"joined as worker {rank}\n")

        self.entering.closed(admit)

    def turn_away_entering(self) -> None:
        """The run is over: joiners still waiting for a round's close are told to stop, as
        one accepted in turn_away is."""
        for entry in self.entering.take_all():
            self.stop_accepted(entry.comm, entry.offer.path)

    def stop_accepted(self, comm, path: str) -> None:
        """A joiner accepted as the run ends: STOP at once, the answer, and it ends with the
        job (finish)."""
        from mpilb.mpi import wire

        stop = wire.new_message(0)
        wire.encode_reply(stop.header, wire.Cmd.STOP, version=0, batch=0)
        comm.Send(stop.buf, dest=comm.Get_size() - 1, tag=wire.TAG_REPLY)
        self.joined.append((None, comm))
        write_atomically(path + ".answer", "refused: the run has ended\n")

    def admit(self, comm, offer: Optional[Offer] = None, ringback: Optional[dict] = None,
              event: str = "join", node: Optional[int] = None) -> int:
        """A worker on `comm` (its last rank: 1, or K with --servers K > 1) joins the run
        now; returns its id. Its node in
        `members/` is that of the job's ranks on its host, else -1 (not known: :meth:`node_of`).
        `ringback`: its doorbell's address (local socket name or network address), rung
        with every message as the job's workers are; it rings rank 0 with every push
        (without one it is polled for). A replacement (server/respawn.py) comes with its
        `event` ("respawn") and `node`."""
        s = self.server
        rank, self.reserved = (self.next_id() if self.reserved is None else self.reserved), None
        self.last_id = rank
        s.receiver.bell.add_peer(rank, **(ringback or {}))
        w = Peer(rank=rank, batch=s.cfg.balancing.batch,
                 link=s.slices.new_link(bool(s.cfg.updates.pipeline)))
        w.link.comm, w.link.dest = comm, comm.Get_size() - 1   # (the stores before it: K > 1)
        w.step = self.slowest_step()
        s.peers[rank] = w
        s.ledger.of[rank] = Holding(rank)
        if s.ledger.holders is not None:
            self.relay = hold_node_copies(s, rank, offer.host if offer is not None else "")
        s.balancer.add_worker(rank)
        w.last_seen = time.monotonic()
        s.receiver.add(w)
        w.go_idle()
        self.joined.append((rank, comm))
        self.members.note(rank, event, node=self.node_of(offer) if node is None else node)
        if event == "join":
            where = f" ({offer.who})" if offer is not None and offer.pid else ""
            print(f"mpilb: a worker joined the run at {s.now():.1f} s as worker {rank}{where}",
                  file=sys.stderr, flush=True)
        s.epochs.wake_idle()
        return rank

    def slowest_step(self) -> int:
        """A joiner's first step count: the lowest of the workers in the run. Counted from 0,
        it would have --mode ssp hold every other worker until it caught up; where some are
        busy, its wake raises it to the lowest of theirs (Decisions.wake_idle), and where
        none is (all idle, between epochs) this keeps it from lagging the whole run."""
        return min((p.step for p in self.server.roster.present()), default=0)

    def node_of(self, offer: Optional[Offer]) -> int:
        """The node a joiner runs on: that of the job's ranks on its host (its request names
        the host), -1 where no rank of the job runs there or it named none."""
        hosts, nodes = getattr(self.server, "hostnames", []), self.members.nodes
        if offer is None or not offer.host or offer.host not in hosts:
            return -1
        rank = hosts.index(offer.host)
        return int(nodes[rank]) if rank < len(nodes) else -1

    def poll_reports(self) -> None:
        """A joiner's error report and its signal reports: they come on its own communicator
        (a worker of the job's reach rank 0 on MPI_COMM_WORLD: chores.py, stopsignals.py) and
        are taken as theirs are: an error ends the run (docs/faults.md), a signal counts."""
        from mpilb.mpi import comm as C
        from mpilb.server.liveness import WorkerFailed

        for rank, comm in self.joined:
            if rank is None or self.server.peers[rank].lost or rank in self.farewells.closed:
                continue
            err = C.poll_error(comm)
            if err is not None:
                raise WorkerFailed(rank, err[1], err[2])
            while (notice := C.poll_preempt(comm)) is not None:
                self.server.chores.signals.notice(rank, notice[1])

    def turn_away(self, directory: str) -> None:
        """The run is over: a joiner already in MPI_Comm_connect is accepted (else it would
        wait there until its timeout) and told to stop at once; the others are answered."""
        self.turn_away_entering()
        try:
            names = set(os.listdir(directory))
        except OSError:
            return
        for path, offer in list(self.offers.items()):
            if os.path.basename(path) + CONNECTING_SUFFIX not in names:
                self.offers.pop(path)
                remove(path + PORT_SUFFIX)   # the joiner finds it gone (cli/membership.py)
                if not offer.gone():
                    write_atomically(path + ".answer", "refused: the run has ended\n")
                continue
            comm = self.connected(offer)
            if comm is None:
                continue
            self.last_id, self.reserved = max(self.last_id, self.reserved or 0), None
            self.stop_accepted(comm, path)

    def finish(self) -> None:
        """The job's end (after its own end barrier): each joiner still there meets rank 0
        once more on its communicator, then both disconnect."""
        from mpilb.mpi import joining
        from mpilb.mpi.departure import end_together

        if self.relay is not None:
            self.relay.finish()   # rows under way to joiners (their holders' sends end)
        self.farewells.finish()
        for rank, comm in self.joined:
            if rank is not None and (self.server.peers[rank].lost or self.server.peers[rank].left):
                continue   # (a lost joiner cannot take part in a disconnect; one let go did)
            # (with --servers K > 1 the other stores, ranks 1..K-1 there, disconnect after
            # their own end barrier: store.py, SliceRank.disconnect_joined)
            end_together(comm, 0, skip=range(1, comm.Get_size() - 1), timeout=END_TIMEOUT_S)
            joining.disconnect(comm)
        for port in self.ports:
            joining.close_port(port)


def local_store_facts(server) -> dict:
    """What a joiner of a --store local run is told beside its port: rank 0's manifest
    entries (file, samples, sha256) of every shard, to check its node's copies against
    (worker/node_copies.py); {} with the shared store."""
    if server.ledger.holders is None:
        return {}
    return {"files": [[sh.file, int(sh.samples), sh.sha256] for sh in server.dataset.shards]}
