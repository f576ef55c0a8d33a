"""Is the cluster in a box's ranking of store layouts mpilb's, or MPI's over the box's links?
(issue 33)

    sudo python benchmarks/plain_ps.py [--rounds 5] [--seconds 6] [--params 1000000]
                                       [--link-rate 1gbit] [--out FILE]

On a cluster in a box (3 nodes, ``--link-rate`` links; needs root), with the layouts of
benchmarks/simulate_network.py (``mpiexec -hosts n0:1,n1:2,n2:2``; one store on n0, two
stores (ranks 0 and 1), a store per node (ranks 0, 1 and 3); 4 and 2 bytes a float), three
ways of the same exchange, in turn in each of ``--rounds`` rounds:

  spin     plain mpi4py: a worker sends every store its slice of 4 x P bytes (``Isend``)
           and waits for every store's slice back (``Waitall``, which polls the whole time);
           a store answers each slice as it comes (``Waitany``, ``Isend``), and does
           nothing else: no step, no balancer, no order between stores
  sleep    the same, every wait a ``Test`` and a 0.2 ms sleep between polls (ranks that
           leave the machine's 2 cores to the others, as mpilb's waits do)
  mpilb    ``mpilb bench ps --params P``: mpilb's stores and null workers

and ``mpilb simulate``'s prediction for the layout (as benchmarks/simulate_network.py
makes it). Figures: exchanges (updates) a second, summed over the workers; the median of
the rounds. Writes ``benchmarks/results/plain_ps.json`` (or ``--out``); ``python
benchmarks/gendocs.py`` renders it into docs/simulate.md.

Run as a worker of the exchange (inside mpiexec) with ``--exchange``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LAYOUTS = [("1 store", [0], "1"), ("2 stores", [0, 1], "2"), ("a store per node", [0, 1, 3], "per-node")]
WIRES = [("fp32", 4), ("bf16", 2)]
SLEEP_S = 0.0002
TAG_UP, TAG_DOWN = 7, 8


def exchange(params: int, seconds: float, stores: list[int], wire_bytes: int, sleep: float) -> None:
    """One rank of the plain exchange; rank 0 prints the workers' updates/s as JSON."""
    import numpy as np

    import mpilb.mpi.comm  # noqa: F401  (UCX's TCP fragment as mpilb sets it)
    from mpi4py import MPI

    def wait_all(reqs):
        if not sleep:
            return MPI.Request.Waitall(reqs)
        while not MPI.Request.Testall(reqs):
            time.sleep(sleep)

    def wait_any(reqs):
        if not sleep:
            return MPI.Request.Waitany(reqs)
        while True:
            i, done = MPI.Request.Testany(reqs)
            if done:
                return i
            time.sleep(sleep)

    comm = MPI.COMM_WORLD
    rank = comm.rank
    workers = [r for r in range(comm.size) if r not in stores]
    size = params * wire_bytes // len(stores)
    comm.Barrier()
    t0 = time.perf_counter()
    if rank in stores:
        slices = {w: np.empty(size, np.uint8) for w in workers}
        answer = np.ones(size, np.uint8)
        reqs = [comm.Irecv(slices[w], w, TAG_UP) for w in workers]
        live, sent = len(workers), []
        while live:
            i = wait_any(reqs)
            w = workers[i]
            if slices[w][0] == 0:      # the worker's last message: it has stopped
                live -= 1
                reqs[i] = MPI.REQUEST_NULL
                continue
            sent.append(comm.Isend(answer, w, TAG_DOWN))
            reqs[i] = comm.Irecv(slices[w], w, TAG_UP)
        wait_all(sent)
        mine = None
    else:
        grad = np.ones(size, np.uint8)
        back = {s: np.empty(size, np.uint8) for s in stores}
        n = 0
        while time.perf_counter() - t0 < seconds:
            reqs = [comm.Irecv(back[s], s, TAG_DOWN) for s in stores]
            wait_all(reqs + [comm.Isend(grad, s, TAG_UP) for s in stores])
            n += 1
        mine = n / (time.perf_counter() - t0)
        grad[0] = 0
        wait_all([comm.Isend(grad, s, TAG_UP) for s in stores])
    rates = comm.gather(mine, root=0)
    if rank == 0:
        per = {str(r): v for r, v in enumerate(rates) if v is not None}
        print(json.dumps({"updates_per_s": sum(per.values()), "per_worker": per}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exchange", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stores", default="0", help=argparse.SUPPRESS)
    ap.add_argument("--wire-bytes", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--params", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=6.0, help="each run's seconds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--link-rate", default="1gbit")
    import _results

    _results.add_output_args(ap, "plain_ps")
    _results.add_box_args(ap)
    opts = ap.parse_args()
    if opts.exchange:
        exchange(opts.params, opts.seconds, [int(s) for s in opts.stores.split(",")],
                 opts.wire_bytes, opts.sleep)
        return 0
    from mpilb.clusterbox import ClusterBox, missing
    from simulate_network import HOSTS, ps_sim_args, simulate

    why = missing()
    if why:
        sys.exit(f"cannot build a cluster in a box here: {why}")
    if opts.quick:
        opts.params, opts.seconds, opts.rounds = 100_000, 0.5, 1
    results = _results.Results("plain_ps", "Store layouts on the cluster in a box: plain MPI "
                               "against mpilb", opts)
    me = os.path.abspath(__file__)
    ways = {
        "spin": lambda stores, wire, wb, ps: [sys.executable, me, "--exchange", "--stores",
                                              ",".join(map(str, stores)), "--wire-bytes", str(wb),
                                              "--params", str(opts.params), "--seconds",
                                              f"{opts.seconds:g}"],
        "sleep": lambda *case: [*ways["spin"](*case), "--sleep", f"{SLEEP_S:g}"],
        "mpilb": lambda stores, wire, wb, ps: [sys.executable, "-m", "mpilb", "bench", "ps",
                                               "--params", str(opts.params), "--seconds",
                                               f"{opts.seconds:g}", "--repeats", "1", "--json",
                                               "--servers", ps, "--wire", wire],
    }
    # (label, (store ranks, wire, bytes a float, --servers))
    cases = [(f"{name}, {wire}", (stores, wire, wb, ps))
             for name, stores, ps in LAYOUTS for wire, wb in WIRES]
    rates: dict = {(c[0], way): [] for c in cases for way in ways}
    with ClusterBox(nodes=3, link_rate=opts.link_rate, tcp=opts.tcp) as box:
        results.box(box)
        for rnd in range(opts.rounds):
            for label, case in cases:
                for way, argv in ways.items():
                    res = box.mpiexec(["-hosts", HOSTS, *argv(*case)], timeout=600)
                    if res.returncode != 0:
                        sys.exit(f"{way} {label} failed: {res.stderr[-2000:]}")
                    got = json.loads(res.stdout.strip().splitlines()[-1])
                    rate = got["runs"][0]["updates_per_s"] if "runs" in got else got["updates_per_s"]
                    rates[(label, way)].append(rate)
                    print(f"  round {rnd + 1}/{opts.rounds} {label}, {way}: {rate:.1f} updates/s",
                          flush=True)
    g = results.group(f"exchanges of {opts.params} floats, -hosts {HOSTS}, {opts.link_rate} "
                      f"links: updates/s (all workers)",
                      f"sudo python benchmarks/plain_ps.py --rounds {opts.rounds} "
                      f"--seconds {opts.seconds:g}")
    medians: dict = {way: {} for way in ways}
    for label, (_, wire, _, ps) in cases:
        for way in ways:
            values = rates[(label, way)]
            medians[way][label] = statistics.median(values)
            results.figure(g, f"{label}.{way}", f"{label}: {way}", values, digits=1)
        sim = simulate(ps_sim_args(opts.link_rate, opts.params,
                                   ["--servers", ps, "--wire", wire]))[0]["updates_per_s"]
        medians.setdefault("mpilb simulate", {})[label] = sim
        results.figure(g, f"{label}.simulate", f"{label}: `mpilb simulate`'s prediction", [sim],
                       digits=1)
    g["note"] = "Layouts by updates/s (medians): " + "; ".join(
        f"{way}: {' < '.join(sorted(m, key=m.get))}" for way, m in medians.items()) + "."
    results.write(_results.out_path(opts, "plain_ps"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
