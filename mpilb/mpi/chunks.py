"""Pushes and replies in chunks between nodes (--chunk-kb), so that a store answers a push
piece by piece.

Across a network a push's slice and its reply travel one after the other: the reply starts
down only once the push's last byte is up, and each direction of the link idles half the
time. Between a worker and a store on different nodes, both go as chunks of about
--chunk-kb KB (benchmarks/chunked_exchange.py measured the pattern: 0.85-0.90 of the wire's
bound against 0.76 in one message), and where the push is applied and answered at once
(async: rank 0 commands Op.STREAM) the store steps each chunk as it comes and sends that
chunk of the new parameters before it waits for the next one. Within a node (shared memory)
pushes and replies stay one message.

Both ends compute the same plan from the configuration alone: the node of every rank
(cfg.rank_nodes, set at start-up), --chunk-kb and the wire format's item size. A worker that
joined the run (it has no place in the job's node layout) sends whole messages.

    chunk_count(nbytes, kb)                -> how many chunks a message of nbytes goes in
    spans(n, itemsize, kb)                 -> [(lo, hi), ...] or None (one message)
    plan(cfg, worker, store, n, itemsize)  -> the pair's spans, or None
"""

from __future__ import annotations

import math
import os
from typing import Optional

DEFAULT_KB = 128
"""--chunk-kb's default: the chunked exchange gained most with chunks of 83-500 KB."""

MAX_CHUNKS = 64
"""At most this many chunks a slice (larger chunks beyond): a message costs its own
matching and a step of its own."""

STALL_S = 2.0
"""How long rank 0 waits for a push's next chunk before it goes on without the rest (they
count as zeros in that step, and the worker's next push waits until they are in): a worker
that stops part-way (SIGSTOP, a frozen node) does not hold the other workers' replies until
--worker-timeout. A --worker-timeout at most this long declares it lost instead."""

LOCAL_ENV = "MPILB_CHUNK_LOCAL"
"""Set to 1, pairs on one node are chunked too: a test hook (the protocol is then exercised
without a network); it gains nothing over shared memory."""

Spans = list[tuple[int, int]]


def chunk_count(nbytes: float, kb: int) -> int:
    """How many chunks of about `kb` KB (`kb` > 0) a message of `nbytes` goes in: 1 (one
    message) to MAX_CHUNKS. The simulator's model of chunks counts them so too."""
    return max(1, min(MAX_CHUNKS, math.ceil(nbytes / (kb * 1024))))


def spans(n: int, itemsize: int, kb: int) -> Optional[Spans]:
    """`n` values of `itemsize` bytes in chunks of about `kb` KB: [(lo, hi), ...] of equal
    length to one value, covering [0, n); None when that is one chunk (or `kb` is 0)."""
    if kb <= 0 or n <= 0:
        return None
    count = min(n, chunk_count(n * itemsize, kb))
    if count <= 1:
        return None
    cuts = [n * i // count for i in range(count + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def apart(cfg, a: int, b: int) -> bool:
    """Ranks `a` and `b` of the job are on different nodes (or the test hook says to act
    as if they were); False where either has no place in the job's layout (a joiner)."""
    nodes = getattr(cfg, "rank_nodes", ()) or ()
    if a >= len(nodes) or b >= len(nodes) or a < 0 or b < 0:
        return False
    return nodes[a] != nodes[b] or os.environ.get(LOCAL_ENV, "") == "1"


def plan(cfg, worker: int, store: int, n: int, itemsize: int) -> Optional[Spans]:
    """The chunks of the pair (`worker`, `store` rank) for a slice of `n` values: spans in
    the slice's own coordinates, or None (one message)."""
    kb = getattr(cfg.updates, "chunk_kb", 0)
    if not kb or not apart(cfg, worker, store):
        return None
    return spans(n, itemsize, kb)


def store_plans(cfg, worker: int, stores, bounds, itemsize: int,
                num_state: int = 0) -> list[Optional[Spans]]:
    """A worker's plan with each store (store s holds [bounds[s], bounds[s+1])): spans in
    the slice's coordinates, or None. Rank 0's slice goes whole when the model's state
    follows it in the push (--servers 1 with a model that has state: BatchNorm)."""
    out = []
    for s, r in enumerate(stores):
        p = plan(cfg, worker, r, bounds[s + 1] - bounds[s], itemsize)
        out.append(None if s == 0 and num_state else p)
    return out


def whole(n: int) -> Spans:
    """One span over the slice: what an unchunked pair sends."""
    return [(0, n)]
