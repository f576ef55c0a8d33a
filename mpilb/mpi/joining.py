"""Workers that join a running job from another launch (`mpilb join RUN.h5`): an MPI port,
accepted by rank 0 only once the joiner waits in Connect (docs/membership.md).

A thread blocked in Accept would starve rank 0's MPI progress (measured: 16 ping-pongs in
~3 s instead of ~6700/s), so rank 0 opens a port only when a joiner asks, and accepts only
when the joiner says it is connecting: Accept then returns in ~20 ms. Each side merges the
intercommunicator: rank 0 is rank 0 of the result, the joiner rank 1.

Both calls are bounded by MPICH's info key "timeout" (seconds; MPICH's ch4 reads it in
MPI_Comm_accept as in MPI_Comm_connect, whose default is 180 s): a joiner that died before
its Connect costs rank 0 that long once, not the run. What a timed-out call leaves behind
is why a port is used for one joiner only and never closed before the job ends: MPICH (ch4,
UCX) does not cancel the receive of a timed-out Accept, and a connection request that came
to it later would be written into memory that is no longer the receive's; and a port's tag
is given to the next port opened once it is closed.

With --servers K > 1 every store takes part in the accept (:func:`accept_together`): MPI's
accept is collective over a communicator of rank 0 and the other stores (:func:`stores_group`,
made at the first join), rank 0 its root, so that the joiner's communicator holds every
store (rank s there is store s, the joiner rank K) and its pushes and pulls go to each
store as a job's worker's do. The stores call it on rank 0's command (wire.Op.ACCEPT), with
the same timeout: when it runs out, rank 0's accept fails and so does every store's
(measured, MPICH 5.0.2: all of them return the error after the timeout).
"""

from __future__ import annotations

import sys

from mpilb.mpi.comm import MPI


def open_port() -> str:
    return MPI.Open_port()


def close_port(port: str) -> None:
    MPI.Close_port(port)


def _timeout(seconds: float):
    info = MPI.Info.Create()
    info.Set("timeout", str(max(1, int(round(seconds)))))
    return info


def accept(port: str, timeout: float):
    """Rank 0: take the joiner waiting in :func:`connect` (call only then: this blocks, at
    most `timeout` s). None if no one connected in that time."""
    return _merged(lambda info: MPI.COMM_SELF.Accept(port, info), timeout, high=False)


STORES_TAG = 29   # Comm_create_group's tag for the stores' communicator


def stores_group(world, stores):
    """The communicator of the store ranks `stores` of `world` (rank 0 first, in slice order:
    store s is its rank s). Collective over those ranks only (MPI_Comm_create_group)."""
    return world.Create_group(world.Get_group().Incl(list(stores)), STORES_TAG)


def accept_together(group, port: str, timeout: float):
    """Every rank of `group` (the stores: :func:`stores_group`) takes the joiner waiting in
    :func:`connect`; `port` counts at rank 0 only (the root). Bounded by `timeout` as
    :func:`accept` is. The merged communicator (rank 0 first, store s its rank s, the joiner
    last), or None on every rank if no one connected in that time."""
    return _merged(lambda info: group.Accept(port, info, root=0), timeout, high=False)


def connect(port: str, timeout: float):
    """A joiner: connect to the running job's rank 0, waiting at most `timeout` s for its
    accept. None if it did not accept in that time. Each rank of a joiner's launch connects
    on its own (MPI_COMM_SELF): J ranks join as J workers, each on a port of its own."""
    return _merged(lambda info: MPI.COMM_SELF.Connect(port, info), timeout, high=True)


def _merged(open_inter, timeout: float, high: bool):
    """The intracommunicator of the intercommunicator `open_inter(info)` makes within
    `timeout` s (rank 0 of the job first: `high` on the joiner's side), or None."""
    info = _timeout(timeout)
    try:
        inter = open_inter(info)
    except MPI.Exception:
        return None
    finally:
        info.Free()
    return merge(inter, high)


def merge(inter, high: bool):
    """The intracommunicator of the intercommunicator `inter`, which is freed (`high`: this
    side's ranks come after the other's). A joiner's and a replacement's (mpi/spawning.py)."""
    try:
        return inter.Merge(high=high)
    finally:
        inter.Free()


def disconnect(comm) -> None:
    """End the connection of a joiner (both sides, before MPI_Finalize: finalising is
    collective over connected processes). MPICH refuses to free a connection that still
    holds messages nobody will receive (a second store's last reply to a joiner let go,
    once in CI): noted, and the caller finalises alone as it does when rank 0 is gone."""
    try:
        comm.Disconnect()
    except MPI.Exception as exc:
        print(f"mpilb: note: disconnecting from the run: {exc.Get_error_string()}; "
              f"finalising alone", file=sys.stderr, flush=True)
