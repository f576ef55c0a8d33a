"""Request/reply in chunks on the cluster in a box: does answering a large message piece by
piece bring the parameter-store pattern closer to its wire bound (issues 27 (b) and 33)?

    sudo python benchmarks/chunked_exchange.py [--rounds 5] [--seconds 5] [--params 1000000]
                                               [--chunks 1,2,4,8,16] [--link-rate 1gbit] [--out FILE]

Plain MPI (mpi4py), no mpilb in between, on a cluster in a box (3 nodes, ``--link-rate``
links; needs root), in the two layouts of ``benchmarks/cluster.py``'s (a) and (b):

  one store         one server on n0, 4 clients on n1, n2 (``-hosts n0:1,n1:2,n2:2``)
  a store per node  a server and a client on each node (``-hosts n0:2,n1:2,n2:2``); a
                    client's message is split evenly over the 3 servers

A client's message of ``--params`` floats (4 bytes each, as an fp32 push) is split over the
servers and each server's slice into C chunks, all sent at once (nonblocking, every answer's
receive posted first). Two ways of answering:

  each      a server answers a chunk (with as many floats) as soon as it has it, so the
            answer to the first chunk travels while the last ones still arrive
  serial    as each, but a server takes one client's message at a time: once its first
            chunk is in, it waits for the others in turn, answering each, before it looks
            at another client's (what a store that handles one push at a time could do)
  whole     a server answers a client's chunks once all of them are in (what a store does
            today: a slice is applied and sent back whole); C chunks on the wire, nothing
            else changed

A client sends its next message when every answer is in; it counts its exchanges over
``--seconds`` after its first, then tells each server it is done. Exchanges per second (all
clients together), each (C, way)'s median over the rounds with its range, against the
layout's wire bound (each link's rate over the bytes an exchange puts on it, the busiest
link's; ``cluster.wire_bound``) and against C = 1 of the same round. Every configuration
runs once in each round, in turn. Writes benchmarks/results/chunked_exchange.json (or
``--out``); ``python benchmarks/gendocs.py`` renders it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402

NAME = "chunked_exchange"
HOSTS = {"one store": "n0:1,n1:2,n2:2", "a store per node": "n0:2,n1:2,n2:2"}
SERVERS = {"one store": [0], "a store per node": [0, 2, 4]}   # their ranks under HOSTS
TAG_DONE = 30000   # client -> each server: no more messages (chunk tags are below it)


def exchange_loop(floats: int, chunks: int, seconds: float, servers: list[int], way: str) -> None:
    """One rank of the loop (started by mpiexec): a server of `servers`, or a client."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    clients = [r for r in range(size) if r not in servers]
    edges = np.linspace(0, floats, len(servers) + 1).astype(int)
    pieces = []   # (server, lo, hi, tag): every chunk of a message
    for s, srv in enumerate(servers):
        cuts = np.linspace(edges[s], edges[s + 1], chunks + 1).astype(int)
        pieces += [(srv, int(cuts[j]), int(cuts[j + 1]), j) for j in range(chunks)]
    if rank in clients:
        grad, params = np.ones(floats, np.float32), np.empty(floats, np.float32)
        n, t0 = 0, None
        while True:
            answers = [comm.Irecv(params[lo:hi], source=srv, tag=tag) for srv, lo, hi, tag in pieces]
            sends = [comm.Isend(grad[lo:hi], dest=srv, tag=tag) for srv, lo, hi, tag in pieces]
            MPI.Request.Waitall(answers + sends)
            now = time.perf_counter()
            if t0 is None:
                t0 = now   # the first exchange is the warm-up
            else:
                n += 1
            if now - t0 >= seconds:
                break
        MPI.Request.Waitall([comm.Isend(np.zeros(1, np.float32), dest=srv, tag=TAG_DONE)
                             for srv in servers])
        rate = n / (now - t0)
    else:
        mine = [(lo, hi, tag) for srv, lo, hi, tag in pieces if srv == rank]
        params = np.zeros(floats, np.float32)
        bufs = {(c, tag): np.empty(hi - lo, np.float32) for c in clients for lo, hi, tag in mine}
        where, reqs = [], []
        for c in clients:
            for lo, hi, tag in mine:
                where.append((c, lo, hi, tag))
                reqs.append(comm.Irecv(bufs[c, tag], source=c, tag=tag))
        done_bufs = [np.empty(1, np.float32) for _ in clients]
        dones = [comm.Irecv(b, source=c, tag=TAG_DONE) for b, c in zip(done_bufs, clients)]
        answering: dict = {}    # (client, tag) -> its answer in flight

        def answer(c: int, lo: int, hi: int, tag: int) -> None:
            old = answering.pop((c, tag), None)
            if old is not None:
                old.Wait()
            answering[c, tag] = comm.Isend(params[lo:hi], dest=c, tag=tag)

        arrived = {c: 0 for c in clients}   # chunks of the current message in
        left = len(clients)
        while left:
            k = MPI.Request.Waitany(reqs + dones)
            if k >= len(reqs):   # a client is done: it had every answer, so no chunk is due
                left -= 1
                gone = clients[k - len(reqs)]
                for j, (owner, *_rest) in enumerate(where):
                    if owner == gone:
                        reqs[j].Cancel()
                        reqs[j].Wait()
                        reqs[j] = MPI.REQUEST_NULL
                continue
            c, lo, hi, tag = where[k]
            if way == "serial":   # this client's chunks in turn (one is in), answering each
                for lo, hi, tag in mine:
                    kk = where.index((c, lo, hi, tag))
                    if kk != k:
                        reqs[kk].Wait()
                    float(bufs[c, tag].sum())   # a pass over the chunk, as an update would take
                    answer(c, lo, hi, tag)
                    reqs[kk] = comm.Irecv(bufs[c, tag], source=c, tag=tag)
                continue
            float(bufs[c, tag].sum())
            arrived[c] += 1
            ready = [(lo, hi, tag)] if way == "each" else (mine if arrived[c] == len(mine) else [])
            if arrived[c] == len(mine):
                arrived[c] = 0
            for a_lo, a_hi, a_tag in ready:
                answer(c, a_lo, a_hi, a_tag)
            reqs[k] = comm.Irecv(bufs[c, tag], source=c, tag=tag)
        MPI.Request.Waitall(list(answering.values()))
        rate = None
    rates = comm.gather(rate, root=0)
    if rank == 0:
        print(json.dumps({"exchanges_per_s": sum(r for r in rates if r is not None)}), flush=True)


def run(box, layout: str, floats: int, chunks: int, way: str, seconds: float) -> float:
    servers = ",".join(map(str, SERVERS[layout]))
    res = box.mpiexec(["-hosts", HOSTS[layout], sys.executable, os.path.abspath(__file__), "_loop",
                       str(floats), str(chunks), f"{seconds:g}", servers, way],
                      timeout=seconds + 120, env={"UCX_TCP_RX_SEG_SIZE": "1m"})
    if res.returncode != 0:
        sys.exit(f"the exchange loop ({layout}, {chunks} chunks) failed (exit {res.returncode}): "
                 f"{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["exchanges_per_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _results.add_output_args(ap, NAME)
    _results.add_box_args(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=5.0, help="each run's timed window")
    ap.add_argument("--params", type=int, default=1_000_000, help="floats a message")
    ap.add_argument("--chunks", default="1,2,4,8,16", help="chunks of each server's slice (a comma list)")
    ap.add_argument("--link-rate", default="1gbit")
    opts = ap.parse_args()
    if opts.quick:
        opts.rounds, opts.seconds, opts.params, opts.chunks = 1, 1.0, 100_000, "1,4"
    try:
        counts = sorted({int(c) for c in opts.chunks.split(",")})
    except ValueError:
        ap.error(f"--chunks {opts.chunks!r}: expected a comma list of integers")
    if counts[0] < 1 or opts.params < 3 * counts[-1]:
        ap.error("--chunks: each at least 1, and at most a third of --params")
    if 1 not in counts:
        counts = [1, *counts]   # the reference of every ratio
    from cluster import wire_bound
    from mpilb.clusterbox import ClusterBox, missing
    from mpilb.clusterbox.system import rate_bytes
    why = missing()
    if why:
        sys.exit(f"cannot build a cluster in a box here: {why}")
    # beside answering each chunk: one client's message at a time, and (the control) the
    # chunks answered whole, the two larger counts
    big = [c for c in counts if c > 1][-2:]
    configs = ([(1, "each")] + [(c, "each") for c in counts if c > 1]
               + [(c, "serial") for c in big] + [(c, "whole") for c in big])
    rates: dict = {(layout, c, way): [] for layout in HOSTS for c, way in configs}
    res = _results.Results(NAME, "Request/reply in chunks on the cluster in a box (plain MPI)", opts)
    with ClusterBox(nodes=3, link_rate=opts.link_rate, tcp=opts.tcp) as box:
        res.box(box)
        for rnd in range(opts.rounds):
            for layout in HOSTS:
                for c, way in configs:
                    rates[layout, c, way].append(run(box, layout, opts.params, c, way, opts.seconds))
                print(f"round {rnd + 1}/{opts.rounds}, {layout}: " + ", ".join(
                    f"{c}{'' if way == 'each' else ' ' + way} {rates[layout, c, way][-1]:.1f}"
                    for c, way in configs) + " exchanges/s", flush=True)
    mb = 4 * opts.params / 1e6
    ways = {"each": "answered each", "serial": "answered each, one message at a time",
            "whole": "answered whole"}
    for layout in HOSTS:
        servers = SERVERS[layout]
        bound = wire_bound(HOSTS[layout], servers, rate_bytes(opts.link_rate), opts.params)
        g = res.group(f"{layout} (-hosts {HOSTS[layout]}), {mb:.1f} MB a message each way, "
                      f"{opts.link_rate} links: exchanges/s (wire bound {bound:.1f})",
                      f"sudo python benchmarks/chunked_exchange.py --rounds {opts.rounds} "
                      f"--seconds {opts.seconds:g} --params {opts.params} --chunks {opts.chunks}")
        ref = rates[layout, 1, "each"]
        for c, way in configs:
            got = rates[layout, c, way]
            kb = 4 * opts.params / len(servers) / c / 1e3
            what = (f"{c} chunks of {kb:,.0f} KB a slice, {ways[way]}" if c > 1
                    else f"1 message of {kb:,.0f} KB a slice")
            fid = f"{'one' if layout == 'one store' else 'per_node'}.{c}.{way}"
            if c == 1:
                res.figure(g, fid, f"{what}: exchanges/s", got, unit="/s", digits=1)
            res.figure(g, f"{fid}_bound", f"{what}: ÷ the wire bound", [r / bound for r in got], unit="x")
            if c > 1:
                res.figure(g, f"{fid}_one", f"{what}: ÷ 1 chunk (same round)",
                           [r / o for r, o in zip(got, ref)], unit="x")
            print(f"{layout}, {what}: {statistics.median(got):.1f} ({min(got):.1f}-{max(got):.1f}) "
                  f"exchanges/s = {statistics.median(got) / bound:.2f} of the wire bound")
    res.write(_results.out_path(opts, NAME))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_loop":
        exchange_loop(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]),
                      [int(s) for s in sys.argv[5].split(",")], sys.argv[6])
    else:
        sys.exit(main())
