"""Where the cluster in a box's link time goes: the parameter store's request/reply
pattern over raw TCP, over plain MPI, and through mpilb (issues 27 and 33).

    sudo python benchmarks/request_reply.py [--rounds 5] [--seconds 4] [--params 1000000,250000]
                                            [--link-rate 1gbit] [--out FILE]

On a cluster in a box (3 nodes, ``--link-rate`` links; needs root). A client sends a
message of 4 x P bytes (P: each of ``--params``), the servers answer with as many, and the
client sends again when every answer is in. Two layouts, as ``benchmarks/cluster.py``'s (a)
and (b), each against its wire bound (each link's rate over the bytes an exchange puts on
it, the busiest link's; clients at an even pace):

  one store         one server on n0, 4 clients on n1, n2 (``-hosts n0:1,n1:2,n2:2``)
  a store per node  a server and a client on each node (``-hosts n0:2,n1:2,n2:2
                    --servers per-node``); a client's message is split evenly over the 3
                    servers, and the slice for its own node's server stays off the links

The ways, in turn in each of ``--rounds`` rounds:

  tcp       Python sockets: a thread per connection at each server, the client's slices
            sent at once and every answer awaited (the kernel's TCP alone: what the links and
            the machine allow the pattern)
  mpi       (one store) mpi4py: blocking ``Send``/``Recv`` at the clients (MPI polls while
            it waits), ``Waitany`` and ``Isend`` at the server, UCX's TCP fragment at mpilb's
            1 MB
  bare      (one store) ``mpilb bench ps``'s bare loop (as ``mpi``, the clients' waits
            sleeping between polls as mpilb's do)
  mpilb     ``mpilb bench ps``'s parameter server and null workers

and ``mpilb simulate``'s prediction for the ``mpilb`` way (null workers on the same layout,
links and token buckets, as benchmarks/simulate_network.py predicts ``bench ps``), and the
same without the token buckets (``--link-burst 0``).

Two clients on one node (n2), where the fluid model and the box part ways: raw TCP against
``mpilb simulate``'s prediction for the same exchanges, by message size (``--pair-mb``), with
one server on n0; and the layout of benchmarks/simulate_network.py's `2 stores` case with its
worker on n1 left out (``-hosts n0:1,n1:1,n2:2 --servers 2``: two servers on n0 and n1, each
client's message split over both), raw TCP and ``mpilb bench ps`` side by side.

Beside them, bulk transfers over raw TCP: clients sending messages of the larger size back
to back, each answered with 64 bytes, one flow on a link, two out of one node, both ways
on a link, and every node to every other; the busiest link's bytes over its rate (what the
links give when no client waits for a reply).

Exchanges per second (all clients together), each way's median over the rounds with its
range, against the wire bound and against ``tcp`` of the same round. Writes
benchmarks/results/request_reply.json (or ``--out``); ``python benchmarks/gendocs.py``
renders it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402

NAME = "request_reply"
LAYOUTS = {   # name -> (the servers' nodes, the clients' nodes)
    "one store": ((0,), (1, 1, 2, 2)),
    "a store per node": ((0, 1, 2), (0, 1, 2)),
}
HOSTS = {"one store": "n0:1,n1:2,n2:2", "a store per node": "n0:2,n1:2,n2:2"}
STORES = {"one store": [0], "a store per node": [0, 2, 4]}   # their ranks under HOSTS
PORT = 5107
ACK_BYTES = 64
# bulk transfers sharing the links: (node, to node) for each client
BULK = {
    "one flow (n2 to n0)": [(2, 0)],
    "two flows out of n2 (to n0 and to n1)": [(2, 0), (2, 1)],
    "both ways (n2 to n0, n0 to n2)": [(2, 0), (0, 2)],
    "every node to every other (6 flows, 2 on each link)": [(a, b) for a in range(3)
                                                            for b in range(3) if a != b],
}
WAYS = ("tcp", "mpi", "bare", "mpilb")
PAIR_HOSTS = "n0:1,n1:1,n2:2"   # two stores (n0, n1), both workers on n2


def _recv_all(conn, buf) -> bool:
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = conn.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


def tcp_server(port: int, nbytes: int, answer: int | None = None) -> None:
    """Answer every client's message of `nbytes` with `answer` bytes (as many by default),
    until killed."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(16)

    def serve(conn) -> None:
        buf, out = bytearray(nbytes), bytes(nbytes if answer is None else answer)
        try:
            while _recv_all(conn, buf):
                conn.sendall(out)
        except OSError:
            pass

    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def tcp_client(hosts: str, port: int, nbytes: int, warmup: float, seconds: float,
               answer: int | None = None) -> None:
    """Send `nbytes` to each server of `hosts` at once, wait for every answer (`answer`
    bytes, as many by default), again; print the exchanges per second counted over `seconds`
    after `warmup`, as JSON."""
    conns = [socket.create_connection((h, port)) for h in hosts.split(",")]
    start, done = threading.Barrier(len(conns) + 1), threading.Barrier(len(conns) + 1)
    failed = []

    def leg(conn) -> None:
        buf, out = bytearray(nbytes if answer is None else answer), bytes(nbytes)
        while True:
            start.wait()
            try:
                conn.sendall(out)
                if not _recv_all(conn, buf):
                    raise OSError("the server closed")
            except OSError as e:
                failed.append(e)
            done.wait()

    for c in conns:
        threading.Thread(target=leg, args=(c,), daemon=True).start()
    t_count = time.perf_counter() + warmup
    t_end = t_count + seconds
    n = 0
    while True:
        start.wait()
        done.wait()
        if failed:
            sys.exit(f"client: {failed[0]}")
        now = time.perf_counter()
        if now >= t_end:
            break
        if now >= t_count:
            n += 1
    print(json.dumps({"exchanges_per_s": n / (now - t_count)}), flush=True)
    os._exit(0)   # the legs wait at their barrier


def mpi_loop(floats: int, seconds: float) -> None:
    """Rank 0 answers each rank's message; the others send and wait in blocking calls."""
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    stop_tag = 1
    if rank != 0:
        g, w, st = np.ones(floats, np.float32), np.empty(floats, np.float32), MPI.Status()
        while True:
            comm.Send(g, dest=0)
            comm.Probe(source=0, status=st)
            comm.Recv(w[:st.Get_count(MPI.FLOAT)], source=0, tag=st.Get_tag())
            if st.Get_tag() == stop_tag:
                return
    bufs = [np.empty(floats, np.float32) for _ in range(1, size)]
    w = np.zeros(floats, np.float32)
    reqs = [comm.Irecv(b, source=r) for r, b in enumerate(bufs, 1)]
    sends = [MPI.REQUEST_NULL] * (size - 1)
    n, t0 = 0, None
    while True:
        i = MPI.Request.Waitany(reqs)
        if t0 is None:
            t0 = time.perf_counter()
        else:
            n += 1
        elapsed = time.perf_counter() - t0
        sends[i].Wait()
        if elapsed >= seconds:
            break
        sends[i] = comm.Isend(w, dest=i + 1)
        reqs[i] = comm.Irecv(bufs[i], source=i + 1)
    stop = np.zeros(1, np.float32)
    for j in range(size - 1):
        if j != i:
            reqs[j].Wait()
            sends[j].Wait()
        comm.Send(stop, dest=j + 1, tag=stop_tag)
    print(json.dumps({"exchanges_per_s": n / elapsed}), flush=True)


def _tcp_rates(box, servers: list[int], clients: list[tuple[int, str]], nbytes: int,
               seconds: float, answer: int | None = None) -> list[float]:
    """Each raw TCP client's exchanges/s: a server on each node of `servers` answering
    `nbytes` messages with `answer` bytes (as many by default), and a client per (node,
    its servers' addresses) of `clients`."""
    extra = [] if answer is None else [str(answer)]
    procs = [box.popen(k, [sys.executable, __file__, "_tcp_server", str(PORT), str(nbytes),
                           *extra], stdout=subprocess.PIPE, text=True) for k in servers]
    try:
        for srv in procs:
            if srv.stdout.readline().strip() != "ready":
                sys.exit("a TCP server did not start")
        started = []
        for k, far in clients:   # (each kept as it starts: killed below if a later one fails)
            started.append(box.popen(k, [sys.executable, __file__, "_tcp_client", far, str(PORT),
                                         str(nbytes), "1", str(seconds), *extra],
                                     stdout=subprocess.PIPE, text=True))
            procs.append(started[-1])
        rates = []
        for c in started:
            out, _ = c.communicate(timeout=seconds + 60)
            if c.returncode != 0 or not out.strip():
                sys.exit(f"a TCP client failed (exit {c.returncode})")
            rates.append(json.loads(out.strip().splitlines()[-1])["exchanges_per_s"])
        return rates
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_tcp(box, layout: str, nbytes: int, seconds: float) -> float:
    """Aggregate exchanges/s of raw TCP clients in `layout` (LAYOUTS): a client on node k
    sends its message, split evenly over every server, to the servers on other nodes (the
    slice to its own node's server would not cross a link)."""
    server_nodes, client_nodes = LAYOUTS[layout]
    clients = [(k, ",".join(box.address(j) for j in server_nodes if j != k)) for k in client_nodes]
    return sum(_tcp_rates(box, list(server_nodes), clients, nbytes // len(server_nodes), seconds))


def run_bulk(box, flows: list[tuple[int, int]], nbytes: int, seconds: float,
             rate: float) -> float:
    """The busiest link's bytes/s over its `rate`, with a raw TCP client per (node, to node)
    of `flows` sending `nbytes` messages back to back, each answered with ACK_BYTES."""
    rates = _tcp_rates(box, sorted({dst for _, dst in flows}),
                       [(src, box.address(dst)) for src, dst in flows], nbytes, seconds,
                       answer=ACK_BYTES)
    load: dict = {}   # ("up"|"down", node) -> bytes/s
    for (src, dst), x in zip(flows, rates):
        for link in (("up", src), ("down", dst)):
            load[link] = load.get(link, 0.0) + x * nbytes
    return max(load.values()) / rate


def run_mpi(box, floats: int, seconds: float) -> float:
    res = box.mpiexec(["-hosts", HOSTS["one store"], sys.executable, __file__, "_mpi", str(floats),
                       str(seconds)],
                      timeout=120, env={"UCX_TCP_RX_SEG_SIZE": "1m"})
    if res.returncode != 0:
        sys.exit(f"the MPI loop failed (exit {res.returncode}): {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["exchanges_per_s"]


def run_bench_ps(box, layout: str, params: int, seconds: float) -> tuple[float, float]:
    """(the bare loop's, mpilb's) updates/s of one `mpilb bench ps` run in `layout`."""
    from cluster import bench_ps
    extra = ["--servers", "per-node"] if layout == "a store per node" else []
    out = bench_ps(box, HOSTS[layout], *extra, params=params, seconds=seconds)
    return out["baseline_updates_per_s"], out["updates_per_s"]


def predict(layout: str, params: int, link_rate: str, burst_ms: str | None = None) -> float:
    """`mpilb simulate`'s updates/s for `layout` (LAYOUTS), as :func:`predict_hosts`."""
    servers = "per-node" if layout == "a store per node" else "1"
    return predict_hosts(HOSTS[layout], servers, params, link_rate, burst_ms)


def predict_hosts(hosts: str, servers: str, params: int, link_rate: str,
                  burst_ms: str | None = None) -> float:
    """`mpilb simulate`'s updates/s for null workers (batch 1, compute at 10^9 samples/s)
    with `params` floats, laid out as `mpiexec -hosts HOSTS --servers SERVERS` on the box's
    links and token buckets (or buckets of `burst_ms`)."""
    from simulate_network import box_burst_ms, simulate
    per_node = [h.split(":")[1] for h in hosts.split(",")]
    return simulate(["--nodes", str(len(per_node)), "--ranks-per-node", ",".join(per_node),
                     "--link-rate", link_rate, "--params", str(params), "--rates", "const:1e9",
                     "--batch", "1", "--samples", "2000", "--shards", "60", "--epochs", "1",
                     "--balancer", "load", "--link-burst",
                     box_burst_ms(link_rate) if burst_ms is None else burst_ms, "--servers",
                     servers])[0]["updates_per_s"]


def run_pairs(box, opts, sizes: list[int], floats: int) -> tuple[dict, dict]:
    """Two clients on n2, in rounds: raw TCP exchanges/s by message size (`sizes`, bytes;
    one server on n0), and the two-store layout's through raw TCP and mpilb."""
    from cluster import bench_ps
    tcp: dict = {n: [] for n in sizes}
    two: dict = {"tcp": [], "mpilb": []}
    for rnd in range(opts.rounds):
        for n in sizes:
            tcp[n].append(sum(_tcp_rates(box, [0], [(2, box.address(0))] * 2, n, opts.seconds)))
            print(f"round {rnd + 1}/{opts.rounds}, two clients on n2, {n / 1e6:g} MB: raw TCP "
                  f"{tcp[n][-1]:.1f} exchanges/s", flush=True)
        far = ",".join(box.address(j) for j in (0, 1))
        two["tcp"].append(sum(_tcp_rates(box, [0, 1], [(2, far)] * 2, 2 * floats, opts.seconds)))
        two["mpilb"].append(bench_ps(box, PAIR_HOSTS, "--servers", "2", params=floats,
                                     seconds=opts.seconds)["updates_per_s"])
        print(f"round {rnd + 1}/{opts.rounds}, two stores, clients on n2: raw TCP "
              f"{two['tcp'][-1]:.1f}, mpilb {two['mpilb'][-1]:.1f} exchanges/s", flush=True)
    return tcp, two


def report_pairs(res, opts, tcp: dict, two: dict, floats: int, rate: float) -> None:
    """run_pairs' figures, against the model's predictions (a group each in `res`)."""
    command = (f"sudo python benchmarks/request_reply.py --rounds {opts.rounds} --seconds "
               f"{opts.seconds:g} --pair-mb {opts.pair_mb}")
    g = res.group(f"Two clients on one node (n2), one server on n0, {opts.link_rate} links: "
                  f"exchanges/s ÷ the wire bound (n2's link: its rate ÷ a message), raw TCP "
                  f"and `mpilb simulate`'s prediction, by message size", command)
    for n in tcp:
        bound = rate / n
        pred = predict_hosts("n0:1,n1:2", "1", n // 4, opts.link_rate)   # (2 nodes)
        mb = f"{n / 1e6:g} MB"
        res.figure(g, f"pair.{n}.tcp", f"{mb}: raw TCP", [r / bound for r in tcp[n]], unit="x")
        res.figure(g, f"pair.{n}.simulate", f"{mb}: `mpilb simulate` ({pred:.1f}/s)",
                   [pred / bound], unit="x")
        print(f"two clients, {mb}: raw TCP {statistics.median(tcp[n]) / bound:.2f} of the bound "
              f"({min(tcp[n]) / bound:.2f}-{max(tcp[n]) / bound:.2f}), model {pred / bound:.2f}")
    bound = rate / (4 * floats)   # n2's link carries both clients' whole messages
    g = res.group(f"Two stores on n0 and n1, two clients on n2 (-hosts {PAIR_HOSTS} --servers "
                  f"2), {floats} floats ({4 * floats / 1e6:.1f} MB) a message each way, split "
                  f"over both, {opts.link_rate} links: exchanges/s (wire bound {bound:.1f})",
                  command)
    pred = predict_hosts(PAIR_HOSTS, "2", floats, opts.link_rate)
    res.figure(g, "pair2.tcp", "raw TCP (Python sockets): exchanges/s", two["tcp"], unit="/s", digits=1)
    res.figure(g, "pair2.mpilb", "`mpilb bench ps`: exchanges/s", two["mpilb"], unit="/s", digits=1)
    res.figure(g, "pair2.mpilb_tcp", "`mpilb bench ps` ÷ raw TCP (same round)",
               [m / t for m, t in zip(two["mpilb"], two["tcp"])], unit="x")
    res.figure(g, "pair2.simulate", f"`mpilb simulate`'s prediction ({pred:.1f}/s) ÷ mpilb "
               "measured (each round)", [pred / m for m in two["mpilb"]], unit="x")
    print(f"two stores, clients on n2: raw TCP {statistics.median(two['tcp']):.1f}, mpilb "
          f"{statistics.median(two['mpilb']):.1f}, model {pred:.1f} exchanges/s (bound {bound:.1f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _results.add_output_args(ap, NAME)
    _results.add_box_args(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=4.0, help="each way's timed window")
    ap.add_argument("--params", default="1000000,250000",
                    help="floats each way (a comma list: a group each)")
    ap.add_argument("--link-rate", default="1gbit")
    ap.add_argument("--pair-mb", default="1,2,4,8",
                    help="message sizes of the two clients on one node, MB (a comma list)")
    opts = ap.parse_args()
    if opts.quick:
        opts.rounds, opts.seconds, opts.params, opts.pair_mb = 1, 1.0, "100000", "1"
    try:
        sizes = [int(p) for p in opts.params.split(",")]
    except ValueError:
        ap.error(f"--params {opts.params!r}: expected a comma list of integers")
    if min(sizes) < 10:
        ap.error("--params: each must be >= 10")
    try:
        pair_mb = [float(mb) for mb in opts.pair_mb.split(",")]
    except ValueError:
        ap.error(f"--pair-mb {opts.pair_mb!r}: expected a comma list of numbers")
    if min(pair_mb) <= 0:
        ap.error("--pair-mb: each must be > 0")
    from cluster import wire_bound
    from mpilb.cli.bench import bench_floats
    from mpilb.clusterbox import ClusterBox, missing
    from mpilb.clusterbox.system import rate_bytes
    why = missing()
    if why:
        sys.exit(f"cannot build a cluster in a box here: {why}")
    res = _results.Results(NAME, "Request/reply on the cluster in a box: raw TCP, plain MPI, "
                           "mpilb", opts)
    floats = {p: bench_floats(p) for p in sizes}   # what bench ps moves: the same everywhere
    cases = [(layout, p) for p in sizes for layout in LAYOUTS]
    rates: dict = {(c, w): [] for c in cases for w in WAYS}
    bulk: dict = {name: [] for name in BULK}
    bulk_bytes = 4 * floats[max(sizes)]
    with ClusterBox(nodes=3, link_rate=opts.link_rate, tcp=opts.tcp) as box:
        res.box(box)
        for rnd in range(opts.rounds):
            for name, flows in BULK.items():
                bulk[name].append(run_bulk(box, flows, bulk_bytes, opts.seconds,
                                           rate_bytes(opts.link_rate)))
                print(f"round {rnd + 1}/{opts.rounds}, bulk, {name}: the busiest link at "
                      f"{bulk[name][-1]:.3f} of its rate", flush=True)
            for layout, p in cases:
                c, n = (layout, p), floats[p]
                rates[c, "tcp"].append(run_tcp(box, layout, 4 * n, opts.seconds))
                if layout == "one store":
                    rates[c, "mpi"].append(run_mpi(box, n, opts.seconds))
                bare, real = run_bench_ps(box, layout, p, opts.seconds)
                if layout == "one store":   # the bare loop has one server whatever the layout
                    rates[c, "bare"].append(bare)
                rates[c, "mpilb"].append(real)
                print(f"round {rnd + 1}/{opts.rounds}, {layout}, {n} floats: " + ", ".join(
                    f"{w} {rates[c, w][-1]:.1f}" for w in WAYS if rates[c, w]) + " exchanges/s",
                    flush=True)
        pairs = run_pairs(box, opts, [int(mb * 1e6) for mb in pair_mb], floats[max(sizes)])
    g = res.group(f"Bulk transfers sharing the links: raw TCP clients sending {bulk_bytes / 1e6:.1f} MB "
                  f"messages back to back, each answered with {ACK_BYTES} bytes, "
                  f"{opts.link_rate} links: the busiest link's bytes ÷ its rate",
                  f"sudo python benchmarks/request_reply.py --rounds {opts.rounds} "
                  f"--seconds {opts.seconds:g} --params {opts.params}")
    for i, (name, got) in enumerate(bulk.items()):
        res.figure(g, f"bulk.{i}", name, got, unit="x", digits=3)
        print(f"bulk, {name}: {statistics.median(got):.3f} ({min(got):.3f}-{max(got):.3f}) "
              f"of the busiest link's rate")
    labels = {"tcp": "raw TCP (Python sockets)", "mpi": "plain MPI (mpi4py, blocking waits)",
              "bare": "`mpilb bench ps`: its bare loop", "mpilb": "`mpilb bench ps`: mpilb's server"}
    for layout, p in cases:
        c, n = (layout, p), floats[p]
        bound = wire_bound(HOSTS[layout], STORES[layout], rate_bytes(opts.link_rate), n)
        who = ("1 server on n0, 4 clients on n1, n2" if layout == "one store" else
               "a server and a client on each node, a client's message split over the 3 servers")
        g = res.group(f"{layout} ({who}; -hosts {HOSTS[layout]}), {n} floats ({4 * n / 1e6:.1f} MB) "
                      f"a message each way, {opts.link_rate} links: exchanges/s (wire bound "
                      f"{bound:.1f})",
                      f"sudo python benchmarks/request_reply.py --rounds {opts.rounds} "
                      f"--seconds {opts.seconds:g} --params {opts.params}")
        for w in WAYS:
            got = rates[c, w]
            if not got:
                continue
            fid = f"{'one' if layout == 'one store' else 'per_node'}.{p}.{w}"
            res.figure(g, fid, f"{labels[w]}: exchanges/s", got, unit="/s", digits=1)
            res.figure(g, f"{fid}_bound", f"{labels[w]} ÷ the wire bound",
                       [r / bound for r in got], unit="x")
            if w != "tcp":
                res.figure(g, f"{fid}_tcp", f"{labels[w]} ÷ raw TCP (same round)",
                           [r / t for r, t in zip(got, rates[c, "tcp"])], unit="x")
            print(f"{layout}, {n} floats, {labels[w]}: {statistics.median(got):.1f} "
                  f"({min(got):.1f}-{max(got):.1f}) exchanges/s = "
                  f"{statistics.median(got) / bound:.2f} of the wire bound")
        pred = predict(layout, p, opts.link_rate)
        fid = f"{'one' if layout == 'one store' else 'per_node'}.{p}.simulate"
        res.figure(g, fid, f"`mpilb simulate`'s prediction for mpilb ({pred:.1f}/s) ÷ the wire bound",
                   [pred / bound], unit="x")
        res.figure(g, f"{fid}_mpilb", "`mpilb simulate`'s prediction ÷ mpilb's server measured "
                   "(each round)", [pred / r for r in rates[c, "mpilb"]], unit="x")
        print(f"{layout}, {n} floats, mpilb simulate: {pred:.1f} exchanges/s = "
              f"{pred / bound:.2f} of the wire bound")
        flat = predict(layout, p, opts.link_rate, burst_ms="0")
        res.figure(g, f"{fid}_flat", f"`mpilb simulate` without the token buckets "
                   f"(`--link-burst 0`, {flat:.1f}/s) ÷ the wire bound", [flat / bound], unit="x")
        print(f"{layout}, {n} floats, mpilb simulate --link-burst 0: {flat:.1f} exchanges/s = "
              f"{flat / bound:.2f} of the wire bound")
    report_pairs(res, opts, *pairs, floats[max(sizes)], rate_bytes(opts.link_rate))
    res.write(_results.out_path(opts, NAME))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_tcp_server":
        tcp_server(int(sys.argv[2]), int(sys.argv[3]), *map(int, sys.argv[4:5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_tcp_client":
        tcp_client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]),
                   float(sys.argv[6]), *map(int, sys.argv[7:8]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_mpi":
        mpi_loop(int(sys.argv[2]), float(sys.argv[3]))
    else:
        sys.exit(main())
