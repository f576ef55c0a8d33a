"""The tasks in the server's replies, into a worker's feed: tasks taken back (drop), tasks
handed out (read from this rank's shards, or received from another rank), a cut, and the
rows this rank must send to others."""

from __future__ import annotations

from typing import Optional

from mpilb.core.batches import ShardFeed
from mpilb.mpi.wire import ReplyMsg
from mpilb.worker.row_exchange import RowExchange


class Assignments:
    """Args:
        feed: this rank's task feed.
        rows: the row exchange (rows from and to other workers).
        held: the shards this rank holds a copy of (--store local), None: all.
    """

    def __init__(self, feed: ShardFeed, rows: RowExchange, held: Optional[list] = None):
        self.feed = feed
        self.rows = rows
        self.held = held

    def take(self, reply: ReplyMsg) -> None:
        if reply.drop:
            self.feed.drop()
        for epoch, shard, start, end, src, tag in reply.assigns:
            remote = None
            if src >= 0:
                remote = self.rows.expect(shard, end - start, src, tag)
            elif self.held is not None and shard not in self.held:
                raise RuntimeError(f"shard {shard} assigned for a local read, but this rank holds no copy")
            self.feed.assign(epoch, shard, start, end, remote)
        if reply.cut is not None:
            # after the assignments: a cut may concern a task handed out in this very reply
            self.feed.truncate(*reply.cut)
        self.rows.serve(reply.orders)
