"""Workers that join a running job (`mpilb join RUN.h5`, cli/membership.py), on rank 0.

The handshake goes through files in the requests directory beside the run log
(server/roster.py), so that rank 0 never blocks in MPI_Comm_accept while it serves:

    joiner: join-PID                 "I want to join"
    rank 0: join-PID.port            the port's name (opened at the first request), or
            join-PID.answer          "refused: ..."
    joiner: join-PID.connecting      "I am in MPI_Comm_connect now"
    rank 0: accepts (~20 ms), then join-PID.answer "joined as worker N"

The joiner becomes a worker like the others: a :class:`~mpilb.server.peers.Peer` whose link
addresses it on its own communicator (rank 1 there; rank 0 is rank 0), a place in the task
ledger and the balancer, its receives among the ones tested; it is woken with work at once
(a steal, or the queues the balancer gives it). Its id in the logs is above every rank of
the job. What is not supported yet (refused with one line): `--servers K > 1`, `--store
local`, `--mode sync|ssp`, and a joined worker leaving (docs/membership.md).
"""

from __future__ import annotations

import os
import sys
import time

from mpilb.core.holdings import Holding
from mpilb.core.topology import stores_of
from mpilb.runfiles.requests import JOIN_PREFIX, write_atomically
from mpilb.server.peers import Peer

PORT_SUFFIX = ".port"
CONNECTING_SUFFIX = ".connecting"
END_TIMEOUT_S = 30.0


class Admissions:
    """Joins of a run (rank 0): the handshake, then the joiner served as a worker.

    Args:
        server: the :class:`~mpilb.server.loop.ParameterServer`.
        members: its :class:`~mpilb.server.roster.Members` (the `members/` rows).
    """

    def __init__(self, server, members):
        self.server = server
        self.members = members
        self.port = None
        self.joined: list = []   # (worker id, communicator)

    def poll(self, directory: str, names: list[str]) -> None:
        for name in sorted(names):
            if not name.startswith(JOIN_PREFIX):
                continue
            base, _, suffix = name.partition(".")
            path = os.path.join(directory, base)
            try:
                if suffix == "":
                    self.offer(path)
                elif "." + suffix == CONNECTING_SUFFIX:
                    self.accept(path)
            except OSError:
                pass

    def refusal(self) -> str:
        s = self.server
        cfg = s.cfg
        if s.stop.reason:
            return f"the run is stopping ({s.stop.reason})"
        if len(stores_of(cfg)) > 1:
            return "a run with --servers K > 1 takes no joins yet"
        if cfg.inputs.store == "local":
            return "a run with --store local takes no joins yet"
        if cfg.updates.mode != "async":
            return f"a run with --mode {cfg.updates.mode} takes no joins yet (async only)"
        return ""

    def offer(self, path: str) -> None:
        """A joiner asks: the port's name, or why not."""
        why = self.refusal()
        if why:
            write_atomically(path + ".answer", f"refused: {why}\n")
        else:
            if self.port is None:
                from mpilb.mpi import joining

                self.port = joining.open_port()
            write_atomically(path + PORT_SUFFIX, self.port)
        os.unlink(path)

    def accept(self, path: str) -> None:
        """The joiner waits in MPI_Comm_connect: take it (a blocking call, ~20 ms)."""
        os.unlink(path + CONNECTING_SUFFIX)
        os.unlink(path + PORT_SUFFIX)
        from mpilb.mpi import joining

        comm = joining.accept(self.port)
        rank = self.admit(comm)
        write_atomically(path + ".answer", f"joined as worker {rank}\n")

    def admit(self, comm) -> int:
        """A worker on `comm` (its rank 1) joins the run now; returns its id."""
        s = self.server
        rank = max([s.comm.Get_size() - 1, *s.peers]) + 1
        w = Peer(rank=rank, batch=s.cfg.balancing.batch,
                 link=s.slices.new_link(bool(s.cfg.updates.pipeline)))
        w.link.comm, w.link.dest = comm, 1
        s.peers[rank] = w
        s.ledger.of[rank] = Holding(rank)
        s.balancer.add_worker(rank)
        w.last_seen = time.monotonic()
        s.receiver.add(w)
        w.go_idle()
        self.joined.append((rank, comm))
        self.members.note(rank, "join")
        print(f"mpilb: a worker joined the run at {s.now():.1f} s as worker {rank}",
              file=sys.stderr, flush=True)
        s.epochs.wake_idle()
        return rank

    def turn_away(self, directory: str) -> None:
        """The run is over: a joiner already in MPI_Comm_connect is accepted (else it would
        wait there for ever) and told to stop at once; ports offered and not taken go."""
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            return
        for name in names:
            path = os.path.join(directory, name)
            if name.startswith(JOIN_PREFIX) and name.endswith(CONNECTING_SUFFIX):
                base = path[:-len(CONNECTING_SUFFIX)]
                for stale in (path, base + PORT_SUFFIX):
                    if os.path.exists(stale):
                        os.unlink(stale)
                from mpilb.mpi import joining
                from mpilb.mpi import wire

                comm = joining.accept(self.port)
                stop = wire.new_message(0)
                wire.encode_reply(stop.header, wire.Cmd.STOP, version=0, batch=0)
                comm.Send(stop.buf, dest=1, tag=wire.TAG_REPLY)
                self.joined.append((None, comm))
                write_atomically(base + ".answer", "refused: the run has ended\n")
            elif name.startswith(JOIN_PREFIX) and name.endswith(PORT_SUFFIX):
                os.unlink(path)   # offered, not taken: the joiner finds it gone (cli/membership.py)

    def finish(self) -> None:
        """The job's end (after its own end barrier): each joiner still there meets rank 0
        once more on its communicator, then both disconnect."""
        from mpilb.mpi import joining
        from mpilb.mpi.departure import end_together

        for rank, comm in self.joined:
            if rank is not None and self.server.peers[rank].lost:
                continue   # (a lost joiner cannot take part in a disconnect)
            end_together(comm, 0, timeout=END_TIMEOUT_S)
            joining.disconnect(comm)
        if self.port is not None:
            joining.close_port(self.port)
