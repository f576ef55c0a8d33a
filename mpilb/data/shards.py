"""Reading shards during training: cached HDF5 handles, per-epoch permutations, prefetch.

A worker asks for ``(epoch, shard)``; :class:`ShardReader` reads the shard contiguously
(chunk-aligned, the fast way to read HDF5), permutes its rows in memory with a
permutation that depends only on ``(seed, epoch, shard)``, and hands back a
:class:`ShardData`. Positions in that permuted order define batches: a batch is a range
``[lo, hi)`` of positions, which the server counts for coverage, so any rank can
reproduce exactly which samples a batch held.

One background thread prefetches the next shard while the worker computes on the
current one; :meth:`ShardReader.get` reports only the time the caller actually waited,
because read time hidden behind compute costs nothing.

With ``cache_mb`` (``--cache-mb``), when every shard the rank may read fits in that many
MB, each shard's rows are kept in memory after their first read, and later epochs permute
them without touching storage. Injected slow storage (``io=F``, ``readbw=MBPS``) slows
reads from storage, as it says; a shard served from the cache is not read, so it costs
no injected time either: with the cache, a slow reader is slow in the first epoch only.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import h5py
import numpy as np

from mpilb.data.dataset import Dataset, check_h5_layout, check_values, open_h5
from mpilb.errors import DataError

IoDelay = Callable[[int, float], float]


@dataclass
class ShardData:
    """One shard's samples for one epoch, rows in permuted order (position p = row p)."""

    epoch: int
    shard: int
    x: np.ndarray
    y: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.x.nbytes + self.y.nbytes)

    def __len__(self) -> int:
        return len(self.y)


class ShardReader:
    """Reads a dataset's shards with cached file handles, prefetch and a small LRU cache.

    Args:
        dataset: the opened :class:`~mpilb.data.dataset.Dataset`.
        seed: seeds every epoch's per-shard permutation.
        io_delay: optional ``callable(nbytes, elapsed_s) -> seconds`` of extra sleep after
            each read; the fault injector simulates slow storage through it.
        cache_size: how many :class:`ShardData` to keep, so a repeated ``get`` is free.
        cache_mb: keep every shard's rows in memory after the first read when the shards
            this rank may read (``shards``, default all) fit in this many MB (0: never).
        shards: the shards this rank may read (a node-local store's copies).
    """

    def __init__(self, dataset: Dataset, seed: int = 0, io_delay: Optional[IoDelay] = None,
                 cache_size: int = 2, cache_mb: float = 0.0, shards=None):
        self.dataset = dataset
        mine = range(len(dataset.shards)) if shards is None else shards
        need = sum(dataset.shard_nbytes(s) for s in mine)
        # shard -> (x, y) in file order, or None: no room for all of them (an LRU of shards
        # that do not all fit would evict each one before its next epoch comes round)
        self._rows: Optional[dict] = {} if cache_mb > 0 and need <= cache_mb * 2**20 else None
        self.seed = int(seed)
        self.io_delay = io_delay
        self.cache_size = max(1, int(cache_size))
        self._files: dict[int, h5py.File] = {}
        self._handles: dict[int, tuple] = {}   # shard -> (x, y) h5py datasets
        self._cache: OrderedDict[tuple[int, int], ShardData] = OrderedDict()
        self._pending: dict[tuple[int, int], Future] = {}
        # Guards the file-handle dict, the cache and the read-time counter: the prefetch
        # thread and the caller may both read.
        self._lock = threading.Lock()
        # One thread: h5py serialises HDF5 calls anyway, and one reader keeps HDF5 safe.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpilb-prefetch")
        self._read_s = 0.0
        self._loads = 0
        self._closed = False

    # ------------------------------------------------------------------ raw reads

    @property
    def read_seconds_total(self) -> float:
        """Cumulative raw read time, including injected delay, over both threads."""
        return self._read_s

    @property
    def loads_done(self) -> int:
        """Number of completed :meth:`load` calls (in either thread)."""
        return self._loads

    def _file(self, shard: int) -> h5py.File:
        with self._lock:
            f = self._files.get(shard)
            if f is None:
                if not 0 <= shard < len(self.dataset.shards):
                    raise IndexError(f"shard {shard} out of range (dataset has {len(self.dataset.shards)})")
                path = self.dataset.shard_path(shard)
                f = open_h5(path, chunk_cache=False)   # whole shards: each chunk read once
                try:
                    check_h5_layout(f, path, self.dataset.shards[shard].samples, self.dataset.sample_shape,
                                    self.dataset.label_dtype, self.dataset.target_shape)
                except DataError:
                    f.close()
                    raise
                self._files[shard] = f
            return f

    def _datasets(self, shard: int):
        """The shard's x and y datasets, looked up once: h5py's name lookup costs
        milliseconds, twenty times the read of a 2 MB shard from the page cache."""
        handles = self._handles.get(shard)
        if handles is None:
            f = self._file(shard)
            handles = self._handles[shard] = (f["x"], f["y"])
        return handles

    def read(self, shard: int, lo: int = 0, hi: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
        """Read rows ``[lo, hi)`` of a shard in file order, as one contiguous slice.

        Returns:
            ``(x, y)``, validated: labels in range and features finite.

        Raises:
            DataError: naming the shard file, if it is missing, unreadable or holds bad values.
        """
        n = self.dataset.shards[shard].samples
        hi = n if hi is None else hi
        if not 0 <= lo <= hi <= n:
            raise IndexError(f"rows [{lo}, {hi}) out of range for shard {shard} with {n} samples")
        whole = self._rows is not None and lo == 0 and hi == n
        if whole:
            with self._lock:
                rows = self._rows.get(shard)
            if rows is not None:
                return rows   # read before, validated then; callers do not write into it
        dx, dy = self._datasets(shard)
        path = self.dataset.shard_path(shard)
        t0 = time.perf_counter()
        try:
            x = dx[lo:hi]
            y = dy[lo:hi]
        except (OSError, RuntimeError) as exc:
            raise DataError(f"{path}: cannot read rows {lo}-{hi} ({exc}); the file may be truncated") from exc
        elapsed = time.perf_counter() - t0
        if self.io_delay is not None:
            extra = float(self.io_delay(int(x.nbytes + y.nbytes), elapsed))
            if extra > 0:
                time.sleep(extra)
                elapsed += extra
        with self._lock:
            self._read_s += elapsed
        check_values(path, x, y, self.dataset.num_classes, first_row=lo)
        if whole:
            with self._lock:
                self._rows[shard] = (x, y)
        return x, y

    @property
    def caching(self) -> bool:
        """True when shards stay in memory after their first read (see ``cache_mb``)."""
        return self._rows is not None

    # ------------------------------------------------------------------ epochs and positions

    def permutation(self, epoch: int, shard: int) -> np.ndarray:
        """The order of a shard's rows in an epoch; reproducible anywhere from (seed, epoch, shard)."""
        n = self.dataset.shards[shard].samples
        return np.random.default_rng([self.seed, int(epoch), int(shard)]).permutation(n)

    def load(self, epoch: int, shard: int) -> ShardData:
        """Read a whole shard contiguously and permute its rows for ``epoch`` in memory."""
        x, y = self.read(shard)
        perm = self.permutation(epoch, shard)
        data = ShardData(int(epoch), int(shard), x[perm], y[perm])
        with self._lock:
            self._loads += 1
        return data

    # ------------------------------------------------------------------ cache and prefetch

    def _cached(self, key: tuple[int, int]) -> Optional[ShardData]:
        with self._lock:
            data = self._cache.get(key)
            if data is not None:
                self._cache.move_to_end(key)
            return data

    def put(self, data: ShardData) -> None:
        """Insert shard data obtained elsewhere (e.g. received over MPI) into the cache."""
        with self._lock:
            self._cache[(data.epoch, data.shard)] = data
            self._cache.move_to_end((data.epoch, data.shard))
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def prefetch(self, epoch: int, shard: int) -> None:
        """Start loading ``(epoch, shard)`` in the background thread (no-op if cached or pending)."""
        key = (int(epoch), int(shard))
        if self._closed:
            raise RuntimeError("ShardReader is closed")
        if self._cached(key) is not None:
            return
        with self._lock:
            if key in self._pending:
                return
            self._pending[key] = self._pool.submit(self.load, *key)

    def get(self, epoch: int, shard: int) -> tuple[ShardData, float]:
        """Return ``(data, waited_s)``: the shard's data and the seconds this call waited.

        ``waited_s`` is 0 when a prefetch had already finished (its read was hidden behind
        compute), the remaining read time when it was still running, and the full read time
        when the shard was not prefetched. An exception raised by the prefetch is re-raised.
        """
        key = (int(epoch), int(shard))
        data = self._cached(key)
        if data is not None:
            return data, 0.0
        with self._lock:
            future = self._pending.pop(key, None)
        t0 = time.perf_counter()
        if future is not None:
            done = future.done()
            data = future.result()  # re-raises the prefetch thread's exception
            waited = 0.0 if done else time.perf_counter() - t0
        else:
            data = self.load(*key)
            waited = time.perf_counter() - t0
        self.put(data)
        return data, waited

    def close(self) -> None:
        """Stop the prefetch thread and close every file; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._handles.clear()
            for f in self._files.values():
                try:
                    f.close()
                except Exception:  # closing a broken handle must not mask the real error
                    pass
            self._files.clear()
            self._pending.clear()
            self._cache.clear()
            if self._rows is not None:
                self._rows.clear()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def placement(num_shards: int, workers: list[int], replicas: int = 1,
              hosts: Optional[Sequence[str]] = None) -> dict[int, list[int]]:
    """Which ranks hold a copy of each shard with `--store local` (R copies on R ranks).

    Shard s lives on order[s % W], order[(s+1) % W], ...: every rank holds about the same
    number of shards, and every rank can compute the same map without talking to the others.
    `order` is `workers` itself on one node. With `hosts` (each rank's hostname, indexed by
    rank) naming several nodes, `order` takes one rank of each node in turn, and each further
    copy goes to the next rank in `order` on a node that has no copy of the shard yet (the
    next rank at all once every node has one): losing a whole node loses no shard with
    R >= 2. Nodes with unequal rank counts then give the smaller nodes' ranks more copies.
    """
    order = node_interleaved(workers, hosts)
    return {s: _copies(s, order, replicas, hosts) for s in range(num_shards)}


def holders_of(shard: int, num_shards: int, workers: list[int], replicas: int,
               hosts: Optional[Sequence[str]] = None) -> list[int]:
    """The ranks holding `shard` (the same map as :func:`placement`, for one shard)."""
    return _copies(shard, node_interleaved(workers, hosts), replicas, hosts)


def _copies(s: int, order: list[int], replicas: int, hosts) -> list[int]:
    w = len(order)
    node = (lambda rank: hosts[rank]) if hosts else (lambda rank: rank)
    copies = [order[s % w]]
    while len(copies) < min(max(1, replicas), w):
        copies.append(_next_copy(order, s, copies, node))
    return copies


def _next_copy(order: list[int], s: int, copies: list[int], node: Callable) -> int:
    """The first rank after order[s] on a node without a copy yet, else the first without one."""
    used = {node(x) for x in copies}
    first_free = None
    for k in range(1, len(order)):
        x = order[(s + k) % len(order)]
        if x in copies:
            continue
        if node(x) not in used:
            return x
        if first_free is None:
            first_free = x
    return first_free


def node_interleaved(workers: list[int], hosts: Optional[Sequence[str]] = None) -> list[int]:
    """`workers` reordered to take one rank of each node in turn (nodes in the order of
    their first rank, ranks in their order); unchanged without `hosts` or on one node."""
    if not hosts:
        return list(workers)
    nodes: dict[str, list[int]] = {}
    for rank in workers:
        nodes.setdefault(hosts[rank], []).append(rank)
    if len(nodes) < 2:
        return list(workers)
    columns = list(nodes.values())
    return [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]
