"""The commands a cluster box is built with (iproute2, util-linux), run as lists with their
return codes checked, and the check that they and root are there."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess

from mpilb.errors import MpilbError, UsageError

TOOLS = ("ip", "tc", "unshare", "nsenter", "mount")


class BoxError(MpilbError):
    """A command building, using or tearing down a box failed (exit code 1)."""


@functools.lru_cache(maxsize=None)
def missing() -> str | None:
    """Why a box cannot be built here (one line), or None when it can: tools, root, and a
    trial in a throwaway network namespace (a container without CAP_SYS_ADMIN, a kernel
    without veth, bridge or tbf fail it)."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "a cluster box needs Linux namespaces (/proc/self/ns)"
    absent = [t for t in TOOLS if shutil.which(t) is None]
    if absent:
        return (f"a cluster box needs {', '.join(absent)} on PATH "
                "(apt-get install iproute2 util-linux)")
    if os.geteuid() != 0:
        return "a cluster box needs root (network and mount namespaces): run it with sudo"
    trial = ("ip link add bxa type veth peer name bxb && ip link add bxbr type bridge && "
             "tc qdisc add dev bxa root tbf rate 1mbit burst 32k latency 50ms")
    try:
        res = subprocess.run(["unshare", "--net", "--uts", "--mount", "sh", "-c", trial],
                             capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "a cluster box needs namespaces: a trial `unshare --net ...` did not finish"
    if res.returncode != 0:
        err = (res.stderr.strip().splitlines() or ["no message"])[-1]
        return f"this machine cannot build a cluster box (namespaces, veth, bridge, tbf): {err}"
    return None


def require() -> None:
    """Raise UsageError (exit code 2) naming what is missing."""
    why = missing()
    if why:
        raise UsageError(why)


def sh(*cmd: str, check: bool = True, timeout: float = 30, input: str | None = None) -> str:
    """Run one command (a list, no shell); its stdout, or BoxError with its stderr."""
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                             input=input, stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BoxError(f"`{' '.join(cmd)}` did not finish within {timeout:g} s") from None
    except FileNotFoundError:
        raise UsageError(f"`{cmd[0]}` not found: apt-get install iproute2 util-linux") from None
    if check and res.returncode != 0:
        err = (res.stderr or res.stdout).strip().splitlines()
        raise BoxError(f"`{' '.join(cmd)}` failed (exit {res.returncode}): "
                       f"{err[-1] if err else 'no message'}")
    return res.stdout


# ---------------------------------------------------------------- namespaces

def netns_list() -> list[str]:
    """Names of the network namespaces `ip netns` knows (ids stripped)."""
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


def netns_pids(ns: str) -> list[int]:
    return [int(p) for p in sh("ip", "netns", "pids", ns, check=False).split() if p.isdigit()]


def link_counters(ns: str, dev: str) -> dict:
    """{"tx": bytes, "rx": bytes} that interface `dev` in namespace `ns` has sent/received."""
    (link,) = json.loads(sh("ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev))
    stats = link["stats64"]
    return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}


# ---------------------------------------------------------------- link rates

# tc's rate units (tc(8) "RATES"); bytes per second per unit
_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
          "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(" + "|".join(_UNITS) + r")$")


def rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate such as "1gbit" or "100mbit" (UsageError if not one)."""
    m = _RATE.match(str(rate).strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"link rate {rate!r}: give a tc rate such as 100mbit, 1gbit or "
                         f"10mbps (units {', '.join(_UNITS)})")
    return float(m.group(1)) * _UNITS[m.group(2)]


def burst_bytes(rate: str) -> int:
    """The token bucket of a link shaped to `rate`: 5 ms of it, at least 128 KB (so that a
    64 KB GSO packet fits). A link idle (or below its rate) banks up to this many bytes and
    then sends them at the veth's own speed (`mpilb simulate --link-burst` models it)."""
    return max(int(rate_bytes(rate) * 0.005), 128 * 1024)


def shape(ns: str, dev: str, rate: str) -> None:
    """A token bucket on `dev`'s egress: `rate`, a burst of :func:`burst_bytes` and 50 ms of
    queue."""
    burst = burst_bytes(rate)
    sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
       "rate", rate.strip().lower(), "burst", str(burst), "latency", "50ms")


# ---------------------------------------------------------------- TCP congestion control

LOSS_BASED = ("cubic", "reno")   # in order of preference: Linux's default, then the built-in
_PROC = "/proc/sys/net/ipv4/"


def _proc_words(name: str) -> list[str]:
    try:
        with open(_PROC + name) as f:
            return f.read().split()
    except OSError:
        return []


def tcp_choice(want: str) -> str | None:
    """The congestion control a box's nodes are set to for ``want``: ``loss`` (cubic where
    the kernel lets a network namespace take it, else reno: both loss-based, like most
    clusters' Linux), ``host`` (None: the nodes keep what a new namespace inherits, the
    machine's own default) or a name the kernel allows in a namespace. UsageError names
    what is allowed otherwise."""
    want = (want or "").strip().lower()
    if want == "host":
        return None
    allowed = _proc_words("tcp_allowed_congestion_control")
    if want == "loss":
        return next((cc for cc in LOSS_BASED if cc in allowed), "reno")
    if want not in allowed:
        raise UsageError(
            f"--tcp {want!r}: a box's nodes can take loss (cubic where allowed, else reno), "
            f"host (the machine's {' '.join(_proc_words('tcp_congestion_control')) or '?'}) "
            f"or one of net.ipv4.tcp_allowed_congestion_control: {', '.join(allowed) or 'none'}")
    return want


def set_tcp(ns: str, cc: str | None) -> str:
    """Set namespace ``ns``'s TCP congestion control to ``cc`` (None: leave it); the one in
    effect there afterwards."""
    if cc is not None:
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={cc}")
    return sh("ip", "netns", "exec", ns, "sysctl", "-n", "net.ipv4.tcp_congestion_control").strip()

