"""`--store local` on several nodes: every node's copies are checked at start-up.

Rank 0 verifies the dataset it sees (its own node's copy). Each other node reads its own
copy of the shards placed on its ranks, and a copy that differs (another seed, a stale
or damaged copy) would train silently on other data, the coverage still "exact". So the
first rank of every other node checks the shards placed on that node's ranks against the
checksums of rank 0's manifest (not the node's own manifest, which may be just as
different), with the same checks and the same record of files already verified as rank 0
(:func:`mpilb.data.verified.verify_files`): a start after the first costs a `stat` per file.
A worker that joins the run on another node than rank 0's checks the shards it will read
there the same way, before it connects (:func:`verify_joiner_copies`).
"""

from __future__ import annotations

from typing import Sequence

from mpilb.data.dataset import open_dataset
from mpilb.data.shards import placement
from mpilb.data.verified import verify_files
from mpilb.errors import DataError


def shards_to_verify(hosts: Sequence[str], rank: int, workers: Sequence[int], replicas: int,
                     num_shards: int) -> list[int]:
    """The shards `rank` checks: those placed on its node's workers, if it is the first rank
    of a node other than rank 0's; else none (rank 0 checked its node's files)."""
    if not hosts:
        return []
    host = hosts[rank]
    if host == hosts[0] or hosts.index(host) != rank:
        return []
    here = {r for r in workers if hosts[r] == host}
    return sorted(s for s, copies in placement(num_shards, list(workers), replicas, hosts).items()
                  if here.intersection(copies))


def verify_node_copies(data_dir: str, files: Sequence[tuple[str, int, str]],
                       shards: Sequence[int], hosts: Sequence[str], rank: int) -> None:
    """Check this node's copies of `shards` against rank 0's (file, samples, sha256) per shard.

    Raises:
        DataError: one line naming the rank, its node, the file and what differs.
    """
    if not shards:
        return
    _verify(data_dir, files, shards, f"rank {rank} on node {hosts[rank]}", hosts[0])


def verify_joiner_copies(data_dir: str, files: Sequence[tuple[str, int, str]],
                         shards: Sequence[int], host: str, rank0_host: str) -> None:
    """A joiner's check of its node's copies of `shards` (those it will read itself: its
    node's, row_exchange.node_shards) against rank 0's entries `files`; none on rank 0's
    own node (rank 0 checked those files).

    Raises:
        DataError: one line naming the joiner's node, the file and what differs.
    """
    if shards and host != rank0_host:
        _verify(data_dir, files, shards, f"the joiner on node {host}", rank0_host)


def _verify(data_dir, files, shards, where: str, rank0_host: str) -> None:
    try:
        ds = open_dataset(data_dir, check_files=False)
        verify_files(ds, [files[s] for s in shards], cached=True,
                     fix=f"this node's copy is not the file rank 0 checked on node {rank0_host}: "
                         f"copy the dataset to the node again")
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None
