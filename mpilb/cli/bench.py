"""`mpilb bench ps`: the real parameter server against workers that compute nothing.

In the same run, a bare loop gives the baseline: one preposted Irecv per worker, Waitany,
`w -= lr*g`, Isend back. The ratio of the two update rates is the server's overhead:
headers, staleness bookkeeping, coverage counting, the run log, the balancer and the
optimizer's own cost (sgd is the same arithmetic as the bare loop; adam is more).

With --wire bf16 or fp16 both loops move 16-bit values: the real server expands each push
and encodes each version as `mpilb train` does, the bare loop expands each push and encodes
each reply. The null workers neither convert nor expand (they compute nothing), so where
the network bounds the rate, the two wires' updates/s compare the bytes alone.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from mpilb.config.build import build_config
from mpilb.core.topology import PER_NODE, store_ranks
from mpilb.errors import UsageError
from mpilb.mpi import comm as C
from mpilb.mpi import chunks, cores, wire, wire_format
from mpilb.mpi.wire import Cmd
from mpilb.run.components import config_model
from mpilb.server.loop import ParameterServer
from mpilb.server.store import SliceRank, store_bounds
from mpilb.worker.pushes import send_slices

TAG_BARE = 21
TAG_BARE_STOP = 22


@dataclass
class _BenchDataset:
    """Just enough of a Dataset for the server: big shards, a tiny test set."""

    features: int
    shard_sizes: list
    num_classes: int = 10
    root: str = "<bench>"

    @property
    def sample_shape(self):
        return (self.features,)

    def load_test(self):
        return (np.zeros((2, self.features), np.float32), np.zeros(2, np.int64))


def _bare_server(comm, n: int, seconds: float, lr: float,
                 fmt: wire_format.WireFormat = wire_format.Float32()) -> float:
    workers = list(range(1, comm.Get_size()))
    w = np.zeros(n, np.float32)
    bufs = [np.empty(n, fmt.wire_dtype) for _ in workers]
    if not fmt.is_fp32:   # pushes expanded into `grad`, replies sent from `sent`
        grad, scratch = np.empty(n, np.float32), fmt.scratch(n)
        sent = [np.empty(n, fmt.wire_dtype) for _ in workers]
    reqs = [comm.Irecv(b, source=r, tag=TAG_BARE) for b, r in zip(bufs, workers)]
    sends = [None] * len(workers)
    updates = 0
    t0 = time.perf_counter()
    while True:
        i = C.Request.Waitany(reqs)
        if fmt.is_fp32:
            w -= lr * bufs[i]
        else:
            fmt.decode(bufs[i], grad)
            w -= lr * grad
        updates += 1
        if sends[i] is not None:
            sends[i].Wait()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
        if not fmt.is_fp32:   # into the worker's own reply buffer (its last send is done)
            fmt.encode(w, sent[i], np, scratch)
        sends[i] = comm.Isend(w if fmt.is_fp32 else sent[i], dest=workers[i], tag=TAG_BARE)
        reqs[i] = comm.Irecv(bufs[i], source=workers[i], tag=TAG_BARE)
    # Stop: the worker that just pushed and every other one (after its push lands).
    pending = set(range(len(workers))) - {i}
    comm.Send(np.zeros(1, np.float32), dest=workers[i], tag=TAG_BARE_STOP)
    for j in pending:
        reqs[j].Wait()
        if sends[j] is not None:
            sends[j].Wait()
        comm.Send(np.zeros(1, np.float32), dest=workers[j], tag=TAG_BARE_STOP)
    for s in sends:
        if s is not None:
            s.Wait()
    return updates / elapsed


def _bare_worker(comm, n: int, fmt: wire_format.WireFormat = wire_format.Float32()) -> None:
    g = np.empty(n, fmt.wire_dtype)
    fmt.encode(np.full(n, 1e-3, np.float32), g)
    w = np.empty(n, fmt.wire_dtype)
    status = C.MPI.Status()
    backoff = C.Backoff()
    while True:
        # like a real worker, it does not wait for its push to complete before it waits
        # for the reply (the server has received the push when it replies)
        send = comm.Isend(g, dest=0, tag=TAG_BARE)
        backoff.reset()
        while not comm.Iprobe(source=0, tag=C.MPI.ANY_TAG, status=status):
            backoff.sleep()
        if status.Get_tag() == TAG_BARE_STOP:
            comm.Recv(np.empty(1, np.float32), source=0, tag=TAG_BARE_STOP)
            C.complete(send)
            return
        C.recv_when_ready(comm, w, 0, TAG_BARE, backoff)
        C.complete(send)


def _null_worker(comm, n: int, bounds: list, stores: list,
                 fmt: wire_format.WireFormat = wire_format.Float32(), plans=None) -> None:
    """The worker protocol without computing: push zero-cost gradients of the tasks assigned,
    honouring their ends, cuts and drops (so coverage stays exact, as with real workers).
    Slices go to their stores (`bounds`, the store ranks `stores`) as real workers send them,
    in the chunks of `plans` (mpi/chunks.py; None: one message each), in the wire format
    `fmt` (encoded once: the same gradient every push)."""
    plans = plans or [None] * len(stores)
    push = wire_format.new_message(fmt, n)
    fmt.encode(np.full(n, 1e-3, np.float32), push.payload)
    recv = wire_format.new_message(fmt, n)
    if plans[0] is not None:   # the header alone, then the chunks (as Pushes sends them)
        head = wire.HEADER_BYTES
    else:
        head = (wire_format.message_bytes(fmt, n) if len(stores) == 1
                else wire.HEADER_BYTES + fmt.itemsize * bounds[1])
    tasks: list[list[int]] = []   # [epoch, shard, pos, end]
    backoff = C.Backoff()
    step = 0
    pulls = None
    pushes: list = []
    while True:
        if pulls is None:
            pulls = [comm.Irecv(recv.payload[bounds[s] + lo:bounds[s] + hi], source=r,
                                tag=wire.TAG_PARAMS)
                     for s, r in enumerate(stores)
                     for lo, hi in plans[s] or chunks.whole(bounds[s + 1] - bounds[s])]
        C.recv_when_ready(comm, recv.buf[:wire.HEADER_BYTES], 0, wire.TAG_REPLY, backoff)
        reply = wire.decode_reply(recv.header)
        for req in pushes:   # done: the server replied (as a real worker, it did not wait)
            C.complete(req)
        pushes = []
        if reply.cmd == Cmd.STOP:
            if reply.streamed:   # the parameters of the last step come all the same
                for req in pulls:
                    C.wait(req, timeout=5.0)
            for req in pulls:
                req.Cancel()
                C.wait(req, timeout=1.0)
            return
        if reply.cmd == Cmd.PARAMS:
            backoff.reset()
            while not C.Request.Testall(pulls):
                backoff.sleep()
            pulls = None
        if reply.cmd == Cmd.ORDERS:   # rows for another rank: only with --store local
            continue
        if reply.drop:
            tasks.clear()
        tasks.extend([t.epoch, t.shard, t.start, t.end] for t in reply.assigns)
        if reply.cut is not None:   # the task holding the cut (two may share a shard)
            for t in tasks:
                if (t[0], t[1]) == (reply.cut.epoch, reply.cut.shard) and t[2] <= reply.cut.end < t[3]:
                    t[3] = reply.cut.end
                    break
        tasks = [t for t in tasks if t[2] < t[3]]
        if not tasks:
            continue
        epoch, shard, lo, end = tasks[0]
        hi = min(lo + max(1, reply.batch), end)
        tasks[0][2] = hi
        wire.encode_push(push.header, step=step, version=reply.version, epoch=epoch, shard=shard,
                         lo=lo, hi=hi, batch=hi - lo, loss=0.0, compute_s=0.0, io_s=0.0,
                         comm_s=0.0, idle_s=0.0, nonfinite=False, t=0.0)
        pushes = send_slices(comm, push, stores, bounds, plans, head)
        step += 1


_NULL_SHARD = 1_000_000


def _bench_config(n: int, seconds: float, optimizer: str, lr: float, stores: list, log: str,
                  wire_name: str = "fp32", nodes=(), chunk_kb: int = chunks.DEFAULT_KB):
    cfg = build_config({}, {"model": "softmax", "optimizer": optimizer, "lr": lr,
                            "epochs": 1, "max_seconds": seconds, "eval_interval": 1e9,
                            "rebalance_interval": 1.0, "progress": False,
                            "servers": len(stores), "log": log, "data": "<bench>",
                            "wire": wire_name, "chunk_kb": chunk_kb})
    cfg.store_ranks = tuple(stores)
    cfg.rank_nodes = tuple(nodes)
    return cfg


def bench_floats(params: int) -> int:
    """The parameters `bench ps --params P` moves: its softmax server's 10 * (features + 1),
    the nearest such count to P."""
    return (max(1, params // 10 - 1)) * 10 + 10


def _bench_dataset(n: int, workers: int) -> _BenchDataset:
    return _BenchDataset(max(1, n // 10 - 1), [_NULL_SHARD] * (2 * workers + 2))


def _real_run(comm, n: int, seconds: float, optimizer: str, lr: float, stores: list,
              fmt: wire_format.WireFormat = wire_format.Float32(), nodes=(),
              chunk_kb: int = chunks.DEFAULT_KB) -> dict:
    """One timed run of the real server (rank 0), its stores and null workers (every rank).
    Rank 0 returns {updates_per_s, server_cpu_s, train_s, updates, servers: [...]}."""
    rank, size = comm.Get_rank(), comm.Get_size()
    dataset = _bench_dataset(n, size - len(stores))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _bench_config(n, seconds, optimizer, lr, stores, os.path.join(tmp, "bench.h5"),
                            fmt.name, nodes, chunk_kb)
        if rank not in stores:
            bounds = store_bounds(cfg, config_model(cfg, dataset))
            _null_worker(comm, n, bounds, stores, fmt,
                         chunks.store_plans(cfg, rank, stores, bounds, fmt.itemsize))
            return {}
        if rank > 0:
            SliceRank(cfg, dataset, comm, rank).run()
            return {}
        server = ParameterServer(cfg, dataset, comm, {"config": cfg.to_json(), "world_size": size})
        server.run()
        updates, train_s = server.version, server.train_s
        summary = server.finish("finished")
    return {"updates_per_s": updates / train_s, "updates": updates, "train_s": train_s,
            "server_cpu_s": summary["server_cpu_s"], "servers": summary["servers"],
            # each null worker's applied pushes: who a layout favours
            "per_worker": {str(w["rank"]): round(w["samples"] / w["mean_batch"]) if w["mean_batch"]
                           else 0 for w in summary["per_worker"]}}


def bench_ps(params: int = 1_000_000, seconds: float = 2.0, optimizer: str = "sgd",
             as_json: bool = False, repeats: int = 3, servers=1, wire: str = "fp32",
             chunk_kb: int = chunks.DEFAULT_KB) -> int:
    """Run both loops on every rank, alternating `repeats` times; rank 0 prints medians
    (the ratio is the median of the per-pair ratios). With `servers` K > 1 (or "per-node")
    the real server has that many parameter stores, placed by node as `mpilb train` places
    them (topology.store_ranks); the bare loop stays one server, P-1 workers. `wire`: the
    element type of pushes and replies (--wire), in both loops; `chunk_kb`: the real
    server's chunks between nodes (--chunk-kb; the bare loop sends one message)."""
    fmt = wire_format.wire_format(wire)   # an unknown one: UsageError, before any MPI
    comm, rank, size = C.world()
    nodes = C.nodes(comm)
    if size < 2:
        if rank == 0:
            raise UsageError("bench ps needs at least 2 ranks: mpiexec -n 4 mpilb bench ps")
        return 2
    if params < 10 or seconds <= 0 or repeats < 1 or chunk_kb < 0:
        raise UsageError("bench ps: --params must be >= 10, --seconds > 0, --repeats >= 1 "
                         "and --chunk-kb >= 0")
    if servers != PER_NODE:
        try:
            servers = int(servers)
        except ValueError:
            raise UsageError(f"bench ps: --servers {servers!r}: expected an integer or "
                             f"{PER_NODE}") from None
    if servers != PER_NODE and (servers < 1 or servers >= size):
        raise UsageError(f"bench ps: --servers {servers} must be >= 1 and leave a worker "
                         f"(this job has {size} ranks)")
    stores = store_ranks(nodes, servers)
    if len(stores) >= size:
        raise UsageError(f"bench ps: --servers {servers} leaves no worker: each of the job's "
                         f"{len(stores)} nodes has one rank (start more ranks per node)")
    if len(stores) > params:
        raise UsageError(f"bench ps: --servers {servers} exceeds --params {params}")
    cores.start_waits(comm, stores)   # the waits of `mpilb train` here, for both loops
    lr = 1e-6
    # Use the server's actual parameter count (softmax: 10*(features+1)) for both loops.
    n = bench_floats(params)
    baselines, rates, runs = [], [], []
    for _ in range(repeats):   # alternate, so both loops see the same machine load
        C.wait(comm.Ibarrier())
        if rank == 0:
            baselines.append(_bare_server(comm, n, seconds, lr, fmt))
        else:
            _bare_worker(comm, n, fmt)
        C.wait(comm.Ibarrier())
        run = _real_run(comm, n, seconds, optimizer, lr, stores, fmt, nodes, chunk_kb)
        if rank == 0:
            runs.append(run)
            rates.append(run["updates_per_s"])
    C.wait(comm.Ibarrier())
    if rank != 0:
        return 0
    rate, baseline = statistics.median(rates), statistics.median(baselines)
    result = {
        "params": n,
        "workers": size - len(stores),
        "optimizer": optimizer,
        "updates_per_s": rate,
        "wire": fmt.name,
        "gb_per_s": rate * n * fmt.itemsize * 2 / 1e9,
        "baseline_updates_per_s": baseline,
        "ratio": statistics.median(r / b for r, b in zip(rates, baselines)),
        "ratios": [r / b for r, b in zip(rates, baselines)],
        "repeats": repeats,
        "servers": servers,
        "stores": stores,   # their ranks
        "nodes": nodes,     # node index by rank
        "runs": runs,   # per repeat: updates/s, rank 0's CPU seconds, per-store counters
    }
    if as_json:
        print(json.dumps(result))
    else:
        k, where = len(stores), len(set(nodes))
        print(f"parameter server ({k} store{'s' if k > 1 else ''} on {where} node"
              f"{'s' if where > 1 else ''}), {n} params ({fmt.name} on the wire), {size - k} workers, {optimizer}: "
              f"{rate:.0f} updates/s ({result['gb_per_s']:.2f} GB/s in+out); bare loop "
              f"{baseline:.0f} updates/s; ratio {result['ratio']:.2f} (medians of {repeats})")
    sys.stdout.flush()
    return 0
