"""How MPI reaches a box's nodes: hydra's ssh launcher pointed at a stand-in script that
enters the node instead of logging in, and the settings that keep MPICH's inter-node bytes
on the box's links."""

from __future__ import annotations

import os
import shlex
import shutil
import sysconfig

from mpilb.errors import UsageError

NODE_DEV = "eth0"    # a node's end of its link (bridge end: v<K>)

# What ssh options hydra (or a user) may pass before the host and that take a value.
_SSH_VALUE_OPTIONS = "bcDEeFIiJLlmOopQRSWw"

_SSH = """#!/bin/sh
# ssh stand-in for mpilb cluster box {name} (written by mpilb.clusterbox):
# `ssh [OPTIONS] HOST COMMAND...` runs COMMAND with sh inside node HOST, like ssh would.
while [ $# -gt 0 ]; do
    case "$1" in
        -[{value_options}]) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
if [ $# -lt 2 ]; then
    echo "box {name} ssh: usage: ssh HOST COMMAND..." >&2
    exit 255
fi
host=$1
shift
case "$host" in
{cases}
    *) echo "box {name} ssh: no node $host (nodes: {hosts})" >&2; exit 255 ;;
esac
export {exports}
exec nsenter -t "$pid" -u -m -n -- sh -c 'cd "$1" 2>/dev/null || cd /; shift; eval "$*"' sh "$PWD" "$@"
"""


def write_ssh(box) -> None:
    """Write the box's ssh stand-in (it names each node's holder pid)."""
    cases = "\n".join(
        f"    {box.host(k)}|{box.address(k)}) pid={pid} ;;" for k, pid in enumerate(box.holders))
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in box_vars(box).items())
    text = _SSH.format(name=box.name, value_options=_SSH_VALUE_OPTIONS, cases=cases,
                       hosts=" ".join(box.hosts), exports=exports)
    path = box.ssh
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
    os.chmod(path + ".tmp", 0o755)
    os.replace(path + ".tmp", path)


def box_vars(box) -> dict:
    """What every process in the box sees: the box's name and the node-local directory."""
    return {"MPILB_BOX": box.name, "MPILB_NODE_LOCAL": box.local_dir}


def mpi_env(box) -> dict:
    """MPICH's settings for the box. UCX would otherwise move bytes between two nodes through
    shared memory (it sees one machine), and each library is pointed at the node's veth."""
    return {**box_vars(box),
            "UCX_TLS": "tcp,self",
            "UCX_NET_DEVICES": NODE_DEV,
            "FI_PROVIDER": "tcp",
            "FI_TCP_IFACE": NODE_DEV,
            "HYDRA_IFACE": NODE_DEV}


def mpiexec_path() -> str:
    """MPICH's mpiexec: the one next to this Python (the `mpich` wheel), else on PATH."""
    scripts = sysconfig.get_path("scripts")
    path = shutil.which("mpiexec", path=scripts + os.pathsep + os.environ.get("PATH", ""))
    if path is None:
        raise UsageError("mpiexec not found: pip install mpich (the [mpi] extra)")
    return path
