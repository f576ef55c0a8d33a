"""Workers that join a run of --servers K > 1 (docs/membership.md): every store takes part in
rank 0's accept, so that the joiner's communicator holds them all.

A joiner pushes each store its slice and pulls each slice of its reply from its store, as a
job's worker does (store.py); only its communicator differs. So rank 0 does not accept a
joiner alone: it tells every other store to accept with it (wire.Op.ACCEPT, naming the id
the joiner gets and the timeout), and MPI's accept is collective over the stores'
communicator (mpi/joining.accept_together), rank 0 its root. Merged, the joiner's
communicator has rank 0 first, store s as its rank s and the joiner last (rank K); every
store then listens to the joiner there, under its id in the job, which rank 0's commands
name as they name any worker.

Bounded as rank 0's own accept is (server/admission.py): rank 0 commands it only for a joiner
it does not see ended, with its timeout, and when that runs out every store's accept fails
with rank 0's (measured with MPICH 5.0.2), so a joiner that never connects costs each store
the timeout once. The commands before it are carried out first (a store waits for nothing
from rank 0 meanwhile: rank 0 is in the accept), so a store reaches it within a gradient's
transfer.

    RemoteSlices.accept_joiner(rank, port, timeout)     # rank 0 (store.py)
    StoreJoins(world, stores)                         # a store s > 0: its joiners' links
"""

from __future__ import annotations

from typing import Optional


class StoreJoins:
    """A store's joiners (a store rank other than 0): the communicator each is reached on.

    Args:
        world: the job's communicator (where the job's own workers are reached).
        stores: the store ranks in slice order (stores_of).
    """

    def __init__(self, world, stores):
        self.world = world
        self.stores = list(stores)
        self.group = None    # the stores' communicator: made at the first join
        self.links: dict[int, tuple] = {}   # joiner id -> (communicator, its rank there)

    def link(self, worker: int) -> tuple:
        """(communicator, rank there) on which `worker` (an id in the job) is reached."""
        return self.links.get(worker, (self.world, worker))

    def accept(self, worker: int, timeout: float) -> bool:
        """Rank 0's command: take part in its accept of the joiner that gets id `worker`.
        True if it joined (False: no one connected within `timeout` s, on every store)."""
        from mpilb.mpi import joining

        if self.group is None:
            self.group = joining.stores_group(self.world, self.stores)
        comm = joining.accept_together(self.group, "", timeout)
        if comm is None:
            return False
        self.links[worker] = (comm, comm.Get_size() - 1)
        return True

    def disconnect(self, lost: Optional[set] = None) -> None:
        """The job's end (after its end barrier, as rank 0's Admissions.finish): each joiner's
        communicator is disconnected, except a lost one's (it cannot take part)."""
        from mpilb.mpi import joining

        for worker, (comm, _) in list(self.links.items()):
            if lost is None or worker not in lost:
                joining.disconnect(comm)
        self.links.clear()
