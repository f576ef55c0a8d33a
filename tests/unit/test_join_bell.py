"""A worker that joins a running job rings rank 0 and is rung by it as the job's own workers
are (mpi/doorbell.py: Doorbell.invitation, join_job, add_peer; server/admission.py), and its
launch limits BLAS to one thread as a multi-rank launch does. Before, a joiner had no
doorbell (rank 0 noticed its pushes only when another worker's ring or its nap woke it, and
its pokes for MPI progress went nowhere) and ran as many BLAS threads as the node has cores
beside the job's ranks."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys

import pytest

from mpilb.mpi import doorbell
from mpilb.mpi.doorbell import LOCAL, NETWORK, Doorbell
from mpilb.server.admission import ringback_of

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="doorbells are Linux only")


def rank0_bell(net: bool = False) -> Doorbell:
    """Rank 0's bell of a one-node job: its local socket (and a UDP one), worker 1 local."""
    prefix = f"\0mpilb-test-{secrets.token_hex(4)}-"
    sock = doorbell._open_local(prefix + "0")
    udp = doorbell._bound(socket.AF_INET, ("127.0.0.1", 0)) if net else None
    bell = Doorbell(sock, 0, prefix, key=secrets.token_bytes(8), net=udp)
    bell.route(1, LOCAL)
    return bell


def test_a_joiner_on_rank_0s_host_rings_locally_both_ways(monkeypatch):
    monkeypatch.delenv("MPILB_DOORBELL", raising=False)
    server = rank0_bell()
    joiner, ringback = doorbell.join_job(server.invitation())
    try:
        assert joiner.via(0) == LOCAL and set(ringback) == {"local"}
        assert server.add_peer(3, **ringback) == LOCAL
        joiner.rank = 3   # (its id, given at its admission)
        joiner.ring(0)
        assert server.wait(5.0) >= 1
        assert server.owed == {3} and server.heard == {3: 1}
        server.ring(3)
        assert joiner.wait(5.0) >= 1 and joiner.heard == {0: 1}
        joiner.poke(0)
        server.wait(5.0)
        assert server.take_poke()
        assert server.report()["3"] == {"via": LOCAL, "rings": 1}
    finally:
        joiner.close()
        server.close()


def test_a_joiner_that_cannot_reach_rank_0s_socket_rings_over_the_network(monkeypatch):
    """Another host (another network namespace): rank 0's local socket is not there; with
    rank 0's UDP socket in the invitation the joiner rings over the network."""
    monkeypatch.delenv("MPILB_DOORBELL", raising=False)
    server = rank0_bell(net=True)
    invitation = dict(server.invitation(), prefix="\0mpilb-elsewhere-")
    joiner, ringback = doorbell.join_job(invitation)
    try:
        assert joiner.via(0) == NETWORK and set(ringback) == {"net"}
        assert server.add_peer(4, local="\0mpilb-nobody", net=ringback["net"]) == NETWORK
        joiner.rank = 4
        joiner.ring(0)
        assert server.wait(5.0) == 1 and server.heard == {4: 1}
    finally:
        joiner.close()
        server.close()


def test_no_bell_where_rank_0_has_none_or_doorbells_are_off(monkeypatch):
    joiner, ringback = doorbell.join_job(None)
    assert not joiner.enabled and ringback == {}
    monkeypatch.setenv("MPILB_DOORBELL", "0")
    server = rank0_bell()
    try:
        joiner, ringback = doorbell.join_job(server.invitation())
        assert not joiner.enabled and ringback == {}
        assert server.add_peer(3) is None and not server.rings_with(3)
    finally:
        server.close()


def test_the_ringback_a_joiner_writes_is_read_back(tmp_path):
    path = tmp_path / "join-1.connecting"
    path.write_text('{"local": "\\u0000mpilb-x-j1"}')
    assert ringback_of(str(path)) == {"local": "\0mpilb-x-j1"}
    path.write_text("")   # (an older joiner's: empty)
    assert ringback_of(str(path)) == {}
    assert ringback_of(str(tmp_path / "absent")) == {}


@pytest.mark.parametrize("command, threads", [("join", "1"), ("report", None)])
def test_a_joiners_launch_has_one_blas_thread(command, threads):
    """`mpiexec -n 1 mpilb join` is a one-rank launch, but its rank is one of the job's:
    one BLAS thread, as every rank of a multi-rank launch has (a one-rank `mpilb report`
    keeps the default)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PMI_SIZE",
                        "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS")}
    code = (f"import sys; sys.argv = ['mpilb', '{command}', 'x.h5']; import mpilb.cli.main, os; "
            f"print(os.environ.get('OPENBLAS_NUM_THREADS'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(threads)


def test_rank_0_waits_for_rings_only_while_every_worker_rings():
    """The server sleeps until a ring only where every worker rings (server/receive.py):
    a joiner that rings keeps it so, one over the network makes rings lossy, one that
    cannot ring makes rank 0 poll. Before, this was decided once at the start: a joiner
    that did not ring was noticed only when another worker's ring or the nap woke rank 0."""
    from types import SimpleNamespace

    from mpilb.server.receive import Receiver

    server = rank0_bell(net=True)
    try:
        receiver = Receiver(None, None, server, None, None, None)
        receiver.order = [SimpleNamespace(rank=1)]
        receiver.rings()
        assert receiver.rung and not receiver.lossy
        server.add_peer(3, local=server.prefix + "0")   # (a socket that is there: its own)
        receiver.order.append(SimpleNamespace(rank=3))
        receiver.rings()
        assert receiver.rung and not receiver.lossy
        server.add_peer(4, net=("127.0.0.1", 9))
        receiver.order.append(SimpleNamespace(rank=4))
        receiver.rings()
        assert receiver.rung and receiver.lossy
        receiver.order.append(SimpleNamespace(rank=5))   # no route: it is polled for
        receiver.rings()
        assert not receiver.rung
    finally:
        server.close()


def test_a_joiner_rings_locally_when_rank_0s_queue_is_full():
    """Rank 0 busy serving: rings it has not read yet fill its socket's queue, and a test
    ring then fails with EAGAIN. That is a socket that is there: the joiner rings locally.
    (Before: EAGAIN read as "not there", the joiner had no doorbell and rank 0 polled for
    it; half the runs of the one-launch join test on a fast 2-core VM.)"""
    bell = rank0_bell()
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    sent = 0
    try:
        while sent < 100000:
            filler.sendto(doorbell.RING.pack(1, 1, bell.key), bell.prefix + "0")
            sent += 1
    except BlockingIOError:
        pass
    assert 0 < sent < 100000   # the queue is full now
    joiner, ringback = doorbell.join_job(bell.invitation())
    try:
        assert joiner.via(0) == LOCAL and "local" in ringback, ringback
        assert not doorbell._reaches(filler, bell.prefix + "nobody", 1, bell.key)
    finally:
        joiner.close()
        filler.close()
        bell.close()
