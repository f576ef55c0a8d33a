"""Replacements for lost workers (--respawn), on rank 0 (docs/membership.md).

When a worker is declared lost (liveness.py), rank 0 starts one new process for it with
MPI_Comm_spawn (mpi/spawning.py), on the lost worker's host where the run knows it. The
spawn blocks rank 0 until the new process's MPI is up (rank 0's MPI thread level does not
allow a thread of its own), so it is one of the chores between pushes, one call per lost
worker. The new process then prepares its data and model while rank 0 serves the others,
and says when it is ready; only then is it admitted, as a joiner is (admission.py): an id
above every rank of the job, a place in the ledger and the balancer, work at once, and a
`respawn` row in `members/` (its `node` the lost worker's where it was started on the lost
worker's host, else -1).

How many: one replacement per worker of the job that is lost; a replacement (or a joiner)
that is lost in turn is not replaced, so a process that cannot run on its host is not
started again and again. A spawn that fails turns --respawn off for the rest of the run,
with one line (it would fail again, and each try stops rank 0 for its duration).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Optional

READY_TIMEOUT_S = 60.0   # from the spawn to "ready": the replacement's data and model


@dataclass
class Spawned:
    """A replacement started for worker `lost`, preparing (not yet admitted)."""

    lost: int
    comm: object
    ready: object    # the request that completes with its "ready"
    since: float
    node: int        # the run's node index it was started on, -1 where not known


class Respawns:
    """The replacements of a run's lost workers (rank 0).

    Args:
        server: the :class:`~mpilb.server.loop.ParameterServer` (its configuration, stop
            rule, peers, clock).
        members: its :class:`~mpilb.server.roster.Members` (the admission, `members/` rows).
        hosts: every rank's host name (the run log's `hostnames`), where a replacement goes.
    """

    def __init__(self, server, members, hosts: list[str]):
        from mpilb.mpi.spawning import unsupported

        self.server = server
        self.members = members
        self.hosts = hosts
        self.on = bool(server.cfg.faults.respawn)
        self.wanted: list[int] = []          # lost workers to replace, in order of loss
        self.spawned: list[Spawned] = []     # started, not yet ready
        self.replaced: dict[int, int] = {}   # lost worker -> its replacement's id
        self.gone: set[int] = set()          # every worker declared lost
        why = unsupported() if self.on else ""
        if why:
            self.turn_off(f"{why}; a lost worker is not replaced")

    def turn_off(self, why: str) -> None:
        """No more replacements this run (one line; the run goes on as without --respawn)."""
        self.on = False
        self.wanted.clear()
        print(f"mpilb: --respawn: {why} (the run goes on without it, as without --respawn)",
              file=sys.stderr, flush=True)

    def lost(self, rank: int) -> None:
        """Worker `rank` was declared lost: replace it at the next chores, if it is one of
        the job's own workers."""
        self.gone.add(rank)
        if not self.on:
            return
        if rank not in self.server.ranks:
            print(f"mpilb: --respawn: worker {rank} was not one of the job's own workers (it "
                  f"joined or replaced one): it is not replaced", file=sys.stderr, flush=True)
            return
        self.wanted.append(rank)

    def poll(self) -> None:
        """Among the chores: replacements that are ready are admitted; one lost worker waiting
        for its replacement gets it started (the spawn blocks, see the module's text)."""
        mono = time.monotonic()
        for spawned in list(self.spawned):
            self.check(spawned, mono)
        if self.wanted and not self.server.stop.reason:
            self.start(self.wanted.pop(0))

    def start(self, lost: int) -> None:
        from mpilb.mpi import spawning

        where = self.host_for(lost)
        host = self.hosts[where] if where is not None else ""
        invitation = self.server.receiver.bell.invitation()   # its doorbell, a joiner's
        args = ["-m", spawning.CHILD_MODULE, str(lost), spawning.arg(dict(self.server.cfg.values)),
                spawning.arg(invitation or {})]
        try:
            comm = spawning.spawn(args, host)
        except spawning.SpawnRefused as exc:
            self.turn_off(f"the replacement of rank {lost} could not be started: MPI_Comm_spawn "
                          f"failed ({exc}); no lost worker is replaced")
            return
        nodes = self.members.nodes
        node = nodes[where] if host and where < len(nodes) else -1
        self.spawned.append(Spawned(lost, comm, spawning.await_ready(comm), time.monotonic(), node))
        print(f"mpilb: --respawn: a replacement for rank {lost} started at "
              f"{self.server.now():.1f} s{f' on {host}' if host else ''}",
              file=sys.stderr, flush=True)

    def host_for(self, lost: int) -> Optional[int]:
        """The rank whose host the replacement of `lost` is started on: `lost` itself where
        another rank of the job on its host is still there (the host answers), else rank 0
        (every rank of that host lost: the node may be down, and a spawn towards it could
        stop rank 0 until the launcher gives up); None where the run knows no hosts."""
        if lost >= len(self.hosts):
            return None
        host = self.hosts[lost]
        alive = [r for r, h in enumerate(self.hosts) if h == host and r not in self.gone]
        return lost if alive else 0

    def check(self, spawned: Spawned, mono: float) -> None:
        """A started replacement: ready (admit it), failed, or too late (drop it, one line)."""
        from mpilb.mpi import comm as C

        err = C.poll_error(spawned.comm)
        if err is not None:
            return self.drop(spawned, f"failed before it was ready: {err[1]}")
        done, ringback = spawned.ready.test()
        if done:
            self.spawned.remove(spawned)
            if self.server.stop.reason:
                return   # (the job's end ends it: MPI_Abort, as for the lost worker itself)
            self.admit(spawned, ringback if isinstance(ringback, dict) else None)
        elif mono - spawned.since > READY_TIMEOUT_S:
            self.drop(spawned, f"was not ready within {READY_TIMEOUT_S:g} s of its start")

    def admit(self, spawned: Spawned, ringback: Optional[dict] = None) -> None:
        """Admit a ready replacement as a joiner is, rung at its `ringback` (its doorbell),
        and tell it its id (the sender its rings name)."""
        from mpilb.mpi import spawning

        admissions = self.members.admissions
        rank = admissions.admit(spawned.comm, ringback=ringback, event="respawn", node=spawned.node)
        spawning.tell_id(spawned.comm, rank)
        self.replaced[spawned.lost] = rank
        print(f"mpilb: worker {rank} replaces rank {spawned.lost} from {self.server.now():.1f} s",
              file=sys.stderr, flush=True)

    def drop(self, spawned: Spawned, why: str) -> None:
        """The replacement of `spawned` will not work: the run goes on without it (the job's
        end ends its process: MPI_Abort, as for the lost worker)."""
        self.spawned.remove(spawned)
        print(f"mpilb: --respawn: the replacement for rank {spawned.lost} {why}; the run goes on "
              f"without it", file=sys.stderr, flush=True)

