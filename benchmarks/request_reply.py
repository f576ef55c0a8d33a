"""Where the cluster in a box's link time goes: one store's request/reply pattern over raw
TCP, over plain MPI, and through mpilb (issues 27 and 33).

    sudo python benchmarks/request_reply.py [--rounds 5] [--seconds 4] [--params 1000000,250000]
                                            [--link-rate 1gbit] [--out FILE]

On a cluster in a box (3 nodes, ``--link-rate`` links; needs root), one server on n0 and 4
clients, two on n1 and two on n2 (``-hosts n0:1,n1:2,n2:2``). Each exchange: a client
sends 4 x P bytes (P: each of ``--params``, a group each), the server answers with as many, and the client sends again
when the answer is in; every exchange crosses n0's link both ways, so the wire bound is the
link's rate over 4 x P bytes. Four ways, in turn in each of ``--rounds`` rounds:

  tcp       Python sockets: a thread per client at the server, ``sendall`` and ``recv_into``
            (the kernel's TCP alone: what the links and the machine allow this pattern)
  mpi       mpi4py: blocking ``Send``/``Recv`` at the clients (MPI polls while it waits),
            ``Waitany`` and ``Isend`` at the server, UCX's TCP fragment at mpilb's 1 MB
  bare      ``mpilb bench ps``'s bare loop (as ``mpi``, the clients' waits sleeping between
            polls as mpilb's do)
  mpilb     ``mpilb bench ps``'s parameter server and null workers (the same run as bare)

Exchanges per second, each way's median over the rounds with its range, against the wire
bound and against ``tcp`` of the same round. Writes benchmarks/results/request_reply.json
(or ``--out``); ``python benchmarks/gendocs.py`` renders it into docs/benchmarks.md.
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
HOSTS = "n0:1,n1:2,n2:2"
CLIENT_NODES = (1, 1, 2, 2)
PORT = 5107
WAYS = ("tcp", "mpi", "bare", "mpilb")


def _recv_all(conn, buf) -> bool:
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = conn.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


def tcp_server(port: int, clients: int, nbytes: int, seconds: float) -> None:
    """Answer every client's message with as many bytes; print exchanges/s over `seconds`
    from the first exchange on, as JSON."""
    count, lock = [0], threading.Lock()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(clients)

    def serve(conn) -> None:
        buf, out = bytearray(nbytes), bytes(nbytes)
        try:
            while _recv_all(conn, buf):
                with lock:
                    count[0] += 1
                conn.sendall(out)
        except OSError:
            pass

    print("ready", flush=True)
    for _ in range(clients):
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
    while count[0] == 0:
        time.sleep(0.001)
    c0, t0 = count[0], time.perf_counter()
    time.sleep(seconds)
    c1, t1 = count[0], time.perf_counter()
    print(json.dumps({"exchanges_per_s": (c1 - c0) / (t1 - t0)}), flush=True)
    os._exit(0)   # the serving threads are blocked in recv


def tcp_client(host: str, port: int, nbytes: int, seconds: float) -> None:
    buf, out = bytearray(nbytes), bytes(nbytes)
    end = time.monotonic() + seconds
    try:
        conn = socket.create_connection((host, port))
        while time.monotonic() < end:
            conn.sendall(out)
            if not _recv_all(conn, buf):
                break
    except OSError:
        pass   # the server has its figure and left


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


def run_tcp(box, nbytes: int, seconds: float) -> float:
    server = box.popen(0, [sys.executable, __file__, "_tcp_server", str(PORT), str(len(CLIENT_NODES)),
                           str(nbytes), str(seconds)], stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            sys.exit("the TCP server did not start")
        clients = [box.popen(k, [sys.executable, __file__, "_tcp_client", box.address(0), str(PORT),
                                 str(nbytes), str(seconds + 3)]) for k in CLIENT_NODES]
        line = server.stdout.readline()
        server.wait(timeout=30)
        for c in clients:
            c.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
    if not line.strip():
        sys.exit(f"the TCP server gave no figure (exit {server.returncode})")
    return json.loads(line)["exchanges_per_s"]


def run_mpi(box, floats: int, seconds: float) -> float:
    res = box.mpiexec(["-hosts", HOSTS, sys.executable, __file__, "_mpi", str(floats), str(seconds)],
                      timeout=120, env={"UCX_TCP_RX_SEG_SIZE": "1m"})
    if res.returncode != 0:
        sys.exit(f"the MPI loop failed (exit {res.returncode}): {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["exchanges_per_s"]


def run_bench_ps(box, params: int, seconds: float) -> tuple[float, float]:
    res = box.mpiexec(["-hosts", HOSTS, sys.executable, "-m", "mpilb", "bench", "ps", "--json",
                       "--repeats", "1", "--params", str(params), "--seconds", f"{seconds:g}"],
                      timeout=300)
    if res.returncode != 0:
        sys.exit(f"bench ps failed (exit {res.returncode}): {res.stderr[-2000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return out["baseline_updates_per_s"], out["updates_per_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _results.add_output_args(ap, NAME)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=4.0, help="each way's timed window")
    ap.add_argument("--params", default="1000000,250000",
                    help="floats each way (a comma list: a group each)")
    ap.add_argument("--link-rate", default="1gbit")
    opts = ap.parse_args()
    if opts.quick:
        opts.rounds, opts.seconds, opts.params = 1, 1.0, "100000"
    from mpilb.clusterbox import ClusterBox, missing
    from mpilb.clusterbox.system import rate_bytes
    why = missing()
    if why:
        sys.exit(f"cannot build a cluster in a box here: {why}")
    try:
        sizes = [int(p) for p in opts.params.split(",")]
    except ValueError:
        ap.error(f"--params {opts.params!r}: expected a comma list of integers")
    if min(sizes) < 10:
        ap.error("--params: each must be >= 10")
    res = _results.Results(NAME, "One store's request/reply pattern on the cluster in a box: "
                           "raw TCP, plain MPI, mpilb", opts)
    rates: dict = {(p, w): [] for p in sizes for w in WAYS}
    with ClusterBox(nodes=3, link_rate=opts.link_rate) as box:
        for rnd in range(opts.rounds):
            for p in sizes:
                # bench ps's softmax server holds p // 10 * 10 floats: the same count everywhere
                floats = (max(1, p // 10 - 1)) * 10 + 10
                rates[p, "tcp"].append(run_tcp(box, 4 * floats, opts.seconds))
                rates[p, "mpi"].append(run_mpi(box, floats, opts.seconds))
                bare, real = run_bench_ps(box, p, opts.seconds)
                rates[p, "bare"].append(bare)
                rates[p, "mpilb"].append(real)
                print(f"round {rnd + 1}/{opts.rounds}, {floats} floats: " + ", ".join(
                    f"{w} {rates[p, w][-1]:.1f}" for w in WAYS) + " exchanges/s", flush=True)
    labels = {"tcp": "raw TCP (Python sockets)", "mpi": "plain MPI (mpi4py, blocking waits)",
              "bare": "`mpilb bench ps`: its bare loop", "mpilb": "`mpilb bench ps`: mpilb's server"}
    for p in sizes:
        floats = (max(1, p // 10 - 1)) * 10 + 10
        bound = rate_bytes(opts.link_rate) / (4 * floats)
        g = res.group(f"1 server on n0, 4 clients on n1, n2 (-hosts {HOSTS}), {floats} floats "
                      f"({4 * floats / 1e6:.1f} MB) each way, {opts.link_rate} links: exchanges/s "
                      f"(wire bound {bound:.1f})",
                      f"sudo python benchmarks/request_reply.py --rounds {opts.rounds} "
                      f"--seconds {opts.seconds:g} --params {opts.params}")
        for w in WAYS:
            got = rates[p, w]
            res.figure(g, f"{p}.{w}", f"{labels[w]}: exchanges/s", got, unit="/s", digits=1)
            res.figure(g, f"{p}.{w}_bound", f"{labels[w]} ÷ the wire bound",
                       [r / bound for r in got], unit="x")
            if w != "tcp":
                res.figure(g, f"{p}.{w}_tcp", f"{labels[w]} ÷ raw TCP (same round)",
                           [r / t for r, t in zip(got, rates[p, "tcp"])], unit="x")
            print(f"{floats} floats, {labels[w]}: {statistics.median(got):.1f} ({min(got):.1f}-"
                  f"{max(got):.1f}) exchanges/s = {statistics.median(got) / bound:.2f} of the "
                  f"wire bound")
    res.write(_results.out_path(opts, NAME))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_tcp_server":
        tcp_server(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_tcp_client":
        tcp_client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_mpi":
        mpi_loop(int(sys.argv[2]), float(sys.argv[3]))
    else:
        sys.exit(main())
