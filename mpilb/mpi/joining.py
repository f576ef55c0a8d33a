"""Workers that join a running job from another launch (`mpilb join RUN.h5`): an MPI port,
accepted by rank 0 only once the joiner waits in Connect (docs/membership.md).

A thread blocked in Accept would starve rank 0's MPI progress (measured: 16 ping-pongs in
~3 s instead of ~6700/s), so rank 0 opens a port only when a joiner asks, and accepts only
when the joiner says it is connecting: Accept then returns in ~20 ms. Each side merges the
intercommunicator: rank 0 is rank 0 of the result, the joiners come after it.
"""

from __future__ import annotations

from mpilb.mpi.comm import MPI


def open_port() -> str:
    return MPI.Open_port()


def close_port(port: str) -> None:
    MPI.Close_port(port)


def accept(port: str):
    """Rank 0: take the joiner waiting in :func:`connect` (call only then: this blocks)."""
    inter = MPI.COMM_SELF.Accept(port)
    try:
        return inter.Merge(high=False)
    finally:
        inter.Free()


def connect(port: str):
    """A joiner (every rank of its launch): connect to the running job's rank 0."""
    inter = MPI.COMM_WORLD.Connect(port)
    try:
        return inter.Merge(high=True)
    finally:
        inter.Free()


def disconnect(comm) -> None:
    """End the connection of a joiner (both sides, before MPI_Finalize: finalising is
    collective over connected processes)."""
    comm.Disconnect()
