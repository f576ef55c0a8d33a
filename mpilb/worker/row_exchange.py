"""Shard rows that workers send each other (`--store local`, and part-way moves of a task).

With the node-local store a worker reads only the shards it holds; a task on another shard
comes with the holder's rank and a tag, and the holder is ordered (ORDERS, or the orders a
reply carries) to send those rows. This module is the worker's side of that exchange: which
shards this rank holds, the rows it sends without waiting for the transfer, and the rows it
receives, posted when the task is assigned and waited for when the task is reached.

A worker that joined the run (`mpilb join`, docs/membership.md) reaches rank 0 only, on a
communicator of its own: it reads the shards its node holds (:func:`node_shards`), sends
no rows, and receives the others' rows from rank 0, which relays what their holder sends it
(server/relay.py). So a holder ordered to send rows to a joiner (an id above every rank of
the job) sends them to rank 0, and the joiner receives every row from rank 0 (`relayed`).
The messages are the same two buffers (x, y) with the same tags, without pickling.
"""

from __future__ import annotations

import time

import numpy as np

from mpilb.mpi import comm as C
from mpilb.data.shards import holders_of, placement
from mpilb.core.topology import workers_of
from mpilb.mpi.wire import resource_tag


def held_shards(num_shards: int, rank: int, workers: list[int], replicas: int,
                hosts=None) -> set[int]:
    """The shards `rank` holds a copy of with `--store local` (`workers`: the worker ranks;
    `hosts`: every rank's hostname, for copies on different nodes)."""
    return {s for s, hs in placement(num_shards, workers, replicas, hosts).items() if rank in hs}


def node_shards(num_shards: int, host: str, workers: list[int], replicas: int,
                hosts) -> set[int]:
    """The shards a worker that joins on `host` reads itself with `--store local`: those
    placed on the job's workers on that host (its node's disk holds them); none on a host
    where no worker of the job runs (every row then comes over MPI, through rank 0)."""
    here = {r for r in workers if hosts and r < len(hosts) and hosts[r] == host}
    return {s for s, hs in placement(num_shards, workers, replicas, hosts).items()
            if here.intersection(hs)}


class RemoteRows:
    """Rows of a shard arriving from a rank that holds them (posted at assignment time).

    `sources`: (rank, tag) pairs, the ordered sender first. With --replicas 2 or more the
    other holders of the shard are listed too (with the re-source tag): if the sender is
    lost before the rows arrive, the server orders another holder to send them, and the
    first complete copy is used; receives still posted for the others are cancelled (kept
    in `leftover` until MPI has let go of their buffers).
    """

    def __init__(self, comm, sources: list[tuple[int, int]], rows: int, sample_shape, backoff,
                 on_poll=None, y_dtype="int64", target_shape=()):
        self.copies = []
        for src, tag in sources:
            x = np.empty((rows, *sample_shape), dtype=np.float32)
            y = np.empty((rows, *target_shape), dtype=y_dtype)   # labels or float targets
            self.copies.append(([comm.Irecv(x, source=src, tag=tag),
                                 comm.Irecv(y, source=src, tag=tag + 1)], x, y))
        self.backoff = backoff
        self.on_poll = on_poll    # between polls: rows other ranks wait for from this one
        self.leftover: list = []

    def wait(self):
        t0 = time.perf_counter()
        self.backoff.reset()
        while True:
            for i, (reqs, x, y) in enumerate(self.copies):
                if C.Request.Testall(reqs):
                    for other in self.copies[:i] + self.copies[i + 1:]:
                        for req in other[0]:
                            req.Cancel()
                        self.leftover.append(other)
                    self.copies = []
                    return x, y, time.perf_counter() - t0
            if self.on_poll is not None:
                self.on_poll()
            self.backoff.sleep()


class RowExchange:
    """One worker's rows in flight: sends it was ordered to make, receives of its tasks' rows.

    Args:
        comm: the world communicator.
        rank: this worker's rank.
        cfg: the run's configuration (`servers`, `replicas`).
        dataset: the dataset (shard sizes, sample and target shapes, label dtype).
        feed: the worker's ShardFeed; rows sent to others are read through it.
        backoff: the worker's backoff, used while waiting for rows.
        on_poll: called between polls while waiting for rows (the worker serves the orders
            rank 0 sends meanwhile, and checks for faults).
        relayed: this worker joined the run (its `comm` reaches rank 0 only): every row
            comes from rank 0 (see the module's text).
    """

    def __init__(self, comm, rank: int, cfg, dataset, feed, backoff, on_poll, hosts=None,
                 relayed: bool = False):
        self.comm = comm
        self.rank = rank
        self.relayed = relayed
        self.size = comm.Get_size()   # ranks above: joiners, reached through rank 0
        self.workers, self.replicas = workers_of(cfg, comm.Get_size()), cfg.inputs.replicas
        self.hosts = hosts   # every rank's hostname: copies are placed by node (shards.py)
        self.feed = feed
        self.backoff = backoff
        self.on_poll = on_poll
        self.num_shards = len(dataset.shard_sizes)
        self.sample_shape = tuple(dataset.sample_shape)
        self.y_dtype, self.target_shape = dataset.label_dtype, tuple(dataset.target_shape)
        self.outgoing: list = []               # (requests, x, y) of sends not yet complete
        self.remotes: list[RemoteRows] = []   # receives of rows not yet complete or let go

    def expect(self, shard: int, rows: int, src: int, tag: int) -> RemoteRows:
        """Post the receives of `rows` rows of `shard` that rank `src` was ordered to send."""
        remote = RemoteRows(self.comm, self._sources(shard, src, tag), rows, self.sample_shape,
                            self.backoff, self.on_poll, self.y_dtype, self.target_shape)
        self.remotes.append(remote)
        return remote

    def serve(self, orders) -> None:
        """Send the rows each order names, without waiting for the transfers."""
        for epoch, shard, start, end, dst, tag in orders:
            self._send_rows(epoch, shard, start, end, dst, tag)

    def _send_rows(self, epoch, shard, start, end, dst, tag) -> None:
        """Send positions [start, end) of a shard to `dst` without waiting for the transfer."""
        x, y = self.feed.rows(epoch, shard, start, end)
        dst = self._via(dst)
        reqs = [self.comm.Isend(x, dest=dst, tag=tag), self.comm.Isend(y, dest=dst, tag=tag + 1)]
        self.outgoing.append((reqs, x, y))   # the arrays live until the sends complete

    def _via(self, rank: int) -> int:
        """The rank on `comm` that rows to or from worker `rank` travel through: rank 0 for
        a joiner (an id above the job's ranks) and, on a joiner, for everyone."""
        return 0 if self.relayed or rank >= self.size else rank

    def _sources(self, shard: int, src: int, tag: int) -> list[tuple[int, int]]:
        """Who may send a shard's rows: `src`, then (replicas) the other holders; on a
        joiner, rank 0 with either tag (it relays whichever holder rank 0 ordered)."""
        if self.relayed:
            return [(0, tag)] + ([(0, resource_tag(tag))] if self.replicas > 1 else [])
        sources = [(src, tag)]
        if self.replicas > 1:
            alt = resource_tag(tag)
            sources += [(h, alt) for h in holders_of(shard, self.num_shards, self.workers,
                                                     self.replicas, self.hosts)
                        if h not in (src, self.rank)]
        return sources

    def progress(self) -> None:
        """Let go of the sends and cancelled receives that MPI has finished with."""
        if self.outgoing:
            self.outgoing = [o for o in self.outgoing if not C.Request.Testall(o[0])]
        if self.remotes:
            for r in self.remotes:
                r.leftover = [c for c in r.leftover if not C.Request.Testall(c[0])]
            self.remotes = [r for r in self.remotes if r.copies or r.leftover]

    def finish(self, timeout: float = 30.0) -> None:
        """At the end of the run: complete the sends other ranks still need."""
        for reqs, _, _ in self.outgoing:
            for req in reqs:
                C.wait(req, timeout=timeout)

    def settle_receives(self, timeout: float = 10.0) -> None:
        """A joiner let go: the rows still on their way to it are taken (rank 0 relays
        every row it was ordered to, and waits for these sends before it disconnects), so
        that nothing is pending on the connection; the other copies posted (replicas) are
        cancelled, and a transfer that does not come within `timeout` (its holder lost)."""
        deadline = time.monotonic() + timeout
        for remote in self.remotes:
            while remote.copies and time.monotonic() < deadline:
                if any(C.Request.Testall(reqs) for reqs, _, _ in remote.copies):
                    break
                self.backoff.sleep()
            for reqs, _, _ in remote.copies + remote.leftover:
                for req in reqs:
                    if not req.Test():
                        req.Cancel()
                C.wait(reqs, timeout=1.0)
        self.remotes = []
