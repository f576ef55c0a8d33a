"""ClusterBox: N emulated nodes on one Linux machine.

Each node is a network namespace holding one long-lived process (the holder) that
`unshare --uts --mount` gave its own hostname (`n<K>`), /dev/shm, /etc/hosts and node-local
directory; everything run on a node enters the holder's namespaces with `nsenter`. The
nodes' veths meet at a bridge in a namespace of its own, so the root namespace's network is
never touched; each veth is shaped in both directions with tc's token bucket (tbf). The
nodes' TCP uses a loss-based congestion control (cubic, else reno) unless told otherwise:
what most clusters run, whatever this machine's own default is.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import subprocess
import sys
import threading
from typing import Sequence

from mpilb.errors import UsageError
import mpilb.clusterbox.registry as registry
from mpilb.clusterbox.launcher import NODE_DEV, mpi_env, mpiexec_path, write_ssh
from mpilb.clusterbox.system import (BoxError, link_counters, netns_pids, rate_bytes, require,
                                     set_tcp, sh, shape, tcp_choice)

SUBNET = "10.77.0"   # inside the box's own namespaces only
MAX_NODES = 250


class ClusterBox:
    """A box of `nodes` emulated nodes `n0` ... `n<N-1>` joined by `link_rate` links.

    Args:
        nodes: how many nodes (1-250).
        link_rate: a tc rate ("1gbit", "100mbit") for every link, a list of one per node,
            or None for unshaped links.
        name: the box's name (default: `b<pid><random>`, unique per run).
        tcp: the nodes' TCP congestion control: "loss" (cubic where the kernel lets a
            namespace take it, else reno), "host" (the machine's default, which a new
            namespace inherits) or a name the kernel allows; ``.tcp`` is the one in effect.
        keep: leave the box up when this process exits (`up` from the command line).

    Use it as a context manager: the box is torn down on leaving the block, at exit, and on
    SIGTERM/SIGHUP.
    """

    def __init__(self, nodes: int = 2, link_rate: str | Sequence[str] | None = None,
                 name: str | None = None, keep: bool = False, tcp: str = "loss"):
        if not 1 <= int(nodes) <= MAX_NODES:
            raise UsageError(f"nodes {nodes}: a box has 1-{MAX_NODES} nodes")
        self.nodes = int(nodes)
        rates = [link_rate] * self.nodes if link_rate is None or isinstance(link_rate, str) \
            else list(link_rate)
        if len(rates) != self.nodes:
            raise UsageError(f"link rates {rates}: give one rate, or one per node ({self.nodes})")
        for rate in rates:
            if rate is not None:
                rate_bytes(rate)
        self.rates = rates
        self._tcp = tcp_choice(tcp)
        self.tcp: str | None = None   # the congestion control in effect, once up
        self.name = registry.check_name(name or f"b{os.getpid()}{secrets.token_hex(2)}")
        self.keep = keep
        self.dir = registry.box_dir(self.name)
        self.holders: list[int] = []
        self.owner_pid = os.getpid()
        self._up = False

    # ------------------------------------------------------------ names

    def host(self, k: int) -> str:
        return f"n{k}"

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def netns(self, k: int | None) -> str:
        """Node k's network namespace, or the bridge's (k=None)."""
        return f"{registry.PREFIX}{self.name}-" + ("br" if k is None else f"n{k}")

    @property
    def hosts(self) -> list[str]:
        return [self.host(k) for k in range(self.nodes)]

    @property
    def local_dir(self) -> str:
        """The node-local directory's path, the same on every node ($MPILB_NODE_LOCAL)."""
        return str(self.dir / "local")

    @property
    def ssh(self) -> str:
        """The ssh stand-in: `SSH HOST COMMAND...` runs COMMAND on node HOST."""
        return str(self.dir / "ssh")

    @classmethod
    def attach(cls, name: str) -> "ClusterBox":
        """The box `name` that is up already (made by `up` from the command line, or by
        another process); leaving this process does not tear it down."""
        state = registry.read_state(registry.check_name(name))
        if state is None or not state.get("holders"):
            raise UsageError(f"no box {name} is up (`python -m mpilb.clusterbox status` lists them)")
        box = cls(state["nodes"], state["rates"], name, keep=True)
        box.holders = list(state["holders"])
        box.tcp = state.get("tcp")
        for k, pid in enumerate(box.holders):
            if pid not in netns_pids(box.netns(k)):
                raise BoxError(f"box {name}: node {box.host(k)} has lost its holder process; "
                               f"`python -m mpilb.clusterbox down {name}` removes the box")
        box._up = True
        return box

    # ------------------------------------------------------------ life cycle

    def __enter__(self) -> "ClusterBox":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "ClusterBox":
        """Build the box; on any failure tear down what was built and raise."""
        require()
        if registry.namespaces(self.name) or registry.read_state(self.name):
            raise UsageError(f"box {self.name} exists already: `python -m mpilb.clusterbox "
                             f"down {self.name}` removes it")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.owner_pid = os.getpid()
        owner = None if self.keep else {"pid": os.getpid(), "start": registry.start_time(os.getpid())}
        registry.write_state(self.name, {"name": self.name, "nodes": self.nodes,
                                         "rates": self.rates, "owner": owner, "holders": []})
        if not self.keep:
            _track(self)
        self._up = True
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Tear the box down: its processes, namespaces, links and directory."""
        if not self._up:
            return
        self._up = False
        _untrack(self)
        registry.teardown(self.name)

    def _build(self) -> None:
        hosts = "127.0.0.1\tlocalhost\n" + "".join(
            f"{self.address(k)}\t{self.host(k)}\n" for k in range(self.nodes))
        os.makedirs(self.local_dir, exist_ok=True)
        bridge = self.netns(None)
        sh("ip", "netns", "add", bridge)
        _quiet_ipv6(bridge)
        sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", bridge, "link", "set", "br0", "up")
        for k in range(self.nodes):
            ns = self.netns(k)
            sh("ip", "netns", "add", ns)
            _quiet_ipv6(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            self.tcp = set_tcp(ns, self._tcp)
            sh("ip", "-n", ns, "link", "add", NODE_DEV, "type", "veth",
               "peer", "name", f"v{k}", "netns", bridge)
            sh("ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", NODE_DEV)
            sh("ip", "-n", ns, "link", "set", NODE_DEV, "up")
            sh("ip", "-n", bridge, "link", "set", f"v{k}", "master", "br0", "up")
            if self.rates[k] is not None:
                shape(ns, NODE_DEV, self.rates[k])        # node -> bridge
                shape(bridge, f"v{k}", self.rates[k])     # bridge -> node
            os.makedirs(self.dir / f"node{k}" / "local", exist_ok=True)
            (self.dir / f"node{k}" / "hosts").write_text(hosts)
            self.holders.append(self._hold(k))
        state = registry.read_state(self.name) or {}
        state["holders"] = self.holders
        state["tcp"] = self.tcp
        registry.write_state(self.name, state)
        write_ssh(self)

    def _hold(self, k: int) -> int:
        """Start node k's holder; its pid once the node's mounts and hostname are in place."""
        setup = (
            'set -e; echo "$1" > /proc/sys/kernel/hostname; mount --bind "$2" /etc/hosts; '
            "mount -t tmpfs -o mode=1777 shm /dev/shm; "
            'mount --bind "$3" "$4"; echo ready; exec sleep infinity </dev/null >/dev/null 2>&1')
        cmd = ["ip", "netns", "exec", self.netns(k), "unshare", "--uts", "--mount",
               "--propagation", "private", "--", "sh", "-c", setup, "holder", self.host(k),
               str(self.dir / f"node{k}" / "hosts"), str(self.dir / f"node{k}" / "local"),
               self.local_dir]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        timer = threading.Timer(20, proc.kill)
        timer.start()
        line = proc.stdout.readline()
        timer.cancel()
        if line.strip() != "ready":
            err = proc.stderr.read().strip().splitlines() if proc.poll() is not None else []
            proc.kill()
            raise BoxError(f"node {self.host(k)} of box {self.name} did not start: "
                           f"{err[-1] if err else 'no message'}")
        proc.stdout.close()
        proc.stderr.close()
        return proc.pid

    # ------------------------------------------------------------ running

    def command(self, k: int, cmd: Sequence[str], cwd: str | None = None) -> list[str]:
        """The command line that runs `cmd` on node k (in the current directory by default)."""
        if not self._up:
            raise BoxError(f"box {self.name} is not up")
        wd = os.path.abspath(cwd or os.getcwd())
        return ["nsenter", "-t", str(self.holders[k]), "-u", "-m", "-n", f"--wd={wd}", "--",
                *map(str, cmd)]

    def env(self, extra: dict | None = None) -> dict:
        """The environment for a command in the box: this one, plus the MPI settings that
        keep inter-node traffic on the box's links, plus `extra`."""
        env = dict(os.environ)
        env.update(mpi_env(self))
        env.update({k: str(v) for k, v in (extra or {}).items()})
        return env

    def run(self, k: int, cmd: Sequence[str], timeout: float = 60, env: dict | None = None,
            cwd: str | None = None, **kwargs) -> subprocess.CompletedProcess:
        """Run `cmd` on node k and wait (raises subprocess.TimeoutExpired after `timeout`)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(k, cmd, cwd), env=self.env(env), timeout=timeout,
                              **kwargs)

    def popen(self, k: int, cmd: Sequence[str], env: dict | None = None,
              cwd: str | None = None, **kwargs) -> subprocess.Popen:
        """Start `cmd` on node k without waiting."""
        return subprocess.Popen(self.command(k, cmd, cwd), env=self.env(env), **kwargs)

    def mpiexec_cmd(self, args: Sequence[str]) -> list[str]:
        """`mpiexec ARGS` with hydra told to reach the nodes through the ssh stand-in, and
        SIGPIPE ignored (inherited across exec): hydra writes to a proxy's pipe that may
        have closed already when the job ends at once, and by default dies of it. Under
        load, `mpiexec -hosts n0:1,n1:1 hostname` in a box ended by SIGPIPE in 3 of 12 runs
        (2026-12-06; hydra's fork launcher outside a box: 0 of 15), and in 0 of 12 so."""
        return ["sh", "-c", 'trap "" PIPE; exec "$0" "$@"', mpiexec_path(), "-launcher", "ssh",
                "-launcher-exec", self.ssh, *map(str, args)]

    def mpiexec(self, args: Sequence[str], timeout: float = 120, env: dict | None = None,
                cwd: str | None = None, **kwargs) -> subprocess.CompletedProcess:
        """Run `mpiexec ARGS` from node n0, e.g. `["-hosts", "n0:1,n1:2", "python", ...]`."""
        return self.run(0, self.mpiexec_cmd(args), timeout=timeout, env=env, cwd=cwd, **kwargs)

    # ------------------------------------------------------------ measuring

    def link_bytes(self) -> dict[str, dict]:
        """Bytes each node has sent ("tx") and received ("rx") over its link to the bridge:
        {"n0": {"tx": ..., "rx": ...}, ...}. Subtract two readings to see a run's traffic."""
        return {self.host(k): link_counters(self.netns(k), NODE_DEV) for k in range(self.nodes)}

    def qdisc_stats(self, k: int) -> str:
        """`tc -s qdisc` of node k's end of its link (what the shaping did)."""
        return sh("tc", "-n", self.netns(k), "-s", "qdisc", "show", "dev", NODE_DEV)

    def __repr__(self) -> str:
        return f"ClusterBox(name={self.name!r}, nodes={self.nodes}, up={self._up})"


def _quiet_ipv6(ns: str) -> None:
    """No IPv6 in the box: its neighbour and router solicitations would add to the links'
    byte counters (a kernel without IPv6 has no such sysctl: nothing to do)."""
    sh("ip", "netns", "exec", ns, "sh", "-c", "for c in all default; do "
       "echo 1 > /proc/sys/net/ipv6/conf/$c/disable_ipv6; done 2>/dev/null", check=False)


# ---------------------------------------------------------------- teardown at exit/signals

_LIVE: list[ClusterBox] = []
_PREVIOUS: dict = {}   # the signal handlers ours replaced
_HOOKED = []
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _down_all() -> None:
    for box in list(_LIVE):
        if box.owner_pid != os.getpid():
            continue   # a forked child exiting: the box is its parent's
        try:
            box.down()
        except Exception as exc:   # at exit: say what is left, keep tearing down the rest
            print(f"mpilb.clusterbox: tearing down {box.name}: {exc}", file=sys.stderr)


def _on_signal(signum, frame):
    _down_all()
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _track(box: ClusterBox) -> None:
    if not _HOOKED:
        _HOOKED.append(atexit.register(_down_all))
    if not _PREVIOUS and threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:   # signal handlers can only be set from the main thread
            _PREVIOUS[sig] = signal.signal(sig, _on_signal)
    _LIVE.append(box)


def _untrack(box: ClusterBox) -> None:
    if box in _LIVE:
        _LIVE.remove(box)
