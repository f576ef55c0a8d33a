"""Shared machinery of the test shims `sbatch`, `srun` and `scontrol`.

The shims let the job templates in jobs/slurm run on one machine without Slurm: `sbatch`
runs the script in the foreground (like `sbatch --wait`) with the variables Slurm would
export, `srun` launches its tasks with MPICH's `mpiexec` (one MPMD segment per heterogeneous
component) and gives every task its SLURM_* variables, and `scontrol requeue` records the
request so that `sbatch` runs the script again, as Slurm does after a requeue.

A "node" here is only a number: tasks are laid out over simulated nodes (block
distribution), which sets SLURM_NODEID and SLURM_LOCALID; every process runs on this host.

State (job counter, per-job spool, requeue log) lives in $SLURM_SHIM_STATE, by default
/tmp/slurm-shim-$UID.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent
STASH = "SHIM"   # SLURM_X travels through mpiexec as SHIMSLURM_X (see srun)


class ShimError(Exception):
    """A usage error of a shim (unknown option, impossible layout): exit 1 with a message."""


def fail(prog: str, exc: Exception) -> int:
    print(f"{prog} (test shim): error: {exc}", file=sys.stderr, flush=True)
    return 1


# ---------------------------------------------------------------- state

def state_dir() -> Path:
    path = Path(os.environ.get("SLURM_SHIM_STATE") or f"/tmp/slurm-shim-{os.getuid()}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def job_dir(job_id: str) -> Path:
    path = state_dir() / f"job-{job_id}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _next_number(counter: Path, first: int) -> int:
    with open(counter, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        text = fh.read().strip()
        value = int(text) + 1 if text else first
        fh.seek(0)
        fh.truncate()
        fh.write(str(value))
    return value


def new_job_id() -> str:
    return str(_next_number(state_dir() / "last-job-id", 1000))


def new_step_id(job_id: str) -> str:
    return str(_next_number(job_dir(job_id) / "last-step-id", 0))


# ---------------------------------------------------------------- options

@dataclass(frozen=True)
class Spec:
    """How one command-line option is spelt and stored."""

    dest: str
    value: bool = True   # takes a value
    optional: bool = False   # value only as --opt=VALUE (e.g. --kill-on-bad-exit[=N])


def parse_options(args: list[str], specs: dict[str, Spec], stop_at_command: bool):
    """Parse Slurm-style options (`--opt=v`, `--opt v`, `-n4`, `-n 4`).

    Returns (options dict, remaining args). With stop_at_command the first word that is not
    an option ends the options (srun, sbatch); otherwise every word must be an option
    (#SBATCH lines). An option that is not in `specs` is an error, so a template cannot
    silently rely on something the shim ignores.
    """
    opts: dict = {}
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("-") or word == "-":
            if stop_at_command:
                break
            raise ShimError(f"unexpected word {word!r}")
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            spec = specs.get("--" + name)
            if spec is None:
                raise ShimError(f"unknown option --{name} (the shim knows: "
                                f"{', '.join(sorted(k for k in specs if k.startswith('--')))})")
            if spec.value and not eq and not spec.optional:
                i += 1
                if i >= len(args):
                    raise ShimError(f"option --{name} needs a value")
                value = args[i]
            elif not spec.value and eq:
                raise ShimError(f"option --{name} takes no value")
            opts[spec.dest] = value if (spec.value and (eq or not spec.optional)) else True
        else:
            flag, rest = word[:2], word[2:]
            spec = specs.get(flag)
            if spec is None:
                raise ShimError(f"unknown option {flag}")
            if spec.value:
                if not rest:
                    i += 1
                    if i >= len(args):
                        raise ShimError(f"option {flag} needs a value")
                    rest = args[i]
                opts[spec.dest] = rest
            else:
                opts[spec.dest] = True
        i += 1
    return opts, args[i:]


def positive_int(opts: dict, key: str):
    value = opts.get(key)
    if value is None:
        return None
    if not str(value).isdigit() or int(value) < 1:
        raise ShimError(f"{key}={value!r}: expected a positive integer")
    return int(value)


# ---------------------------------------------------------------- layout

def node_name(index: int) -> str:
    return f"node{index:02d}"


def node_list(first: int, count: int) -> str:
    """Slurm's compressed host list: node00, node[00-03]."""
    if count == 1:
        return node_name(first)
    return f"node[{first:02d}-{first + count - 1:02d}]"


def expand_hostlist(text: str) -> list[str]:
    """node[00-02,05],other -> node00 node01 node02 node05 other (what `scontrol show hostnames` does)."""
    hosts = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text):
        m = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges = m.groups()
        for rng in ranges.split(","):
            lo, _, hi = rng.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}")
    return hosts


def block_layout(ntasks: int, nodes: int, per_node: int | None = None) -> list[int]:
    """Tasks on each node: as even as possible, consecutive ranks on the same node (block
    distribution); `per_node` (--ntasks-per-node) is then a maximum, as with --ntasks."""
    if ntasks < nodes:
        raise ShimError(f"{ntasks} task(s) cannot cover {nodes} node(s)")
    base, extra = divmod(ntasks, nodes)
    counts = [base + (1 if i < extra else 0) for i in range(nodes)]
    if per_node and counts[0] > per_node:
        raise ShimError(f"{ntasks} tasks do not fit on {nodes} node(s) with {per_node} per node")
    return counts


def tasks_per_node_text(counts: list[int]) -> str:
    """SLURM_TASKS_PER_NODE spelling: [2, 2, 2, 1] -> '2(x3),1'."""
    parts, i = [], 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        parts.append(f"{counts[i]}(x{j - i})" if j - i > 1 else str(counts[i]))
        i = j
    return ",".join(parts)


@dataclass
class Allocation:
    """One (component of a) job allocation: what sbatch asked for."""

    nodes: int
    ntasks: int
    layout: list[int]
    first_node: int = 0
    cpus_per_task: int | None = None
    ntasks_per_node: int | None = None
    gpus_per_node: str | None = None
    gpus_per_task: str | None = None
    gpus: str | None = None
    partition: str = "shim"

    @classmethod
    def from_options(cls, opts: dict, first_node: int = 0) -> "Allocation":
        nodes = positive_int(opts, "nodes")
        ntasks = positive_int(opts, "ntasks")
        per_node = positive_int(opts, "ntasks_per_node")
        if nodes is None:
            nodes = -(-ntasks // per_node) if (ntasks and per_node) else 1
        if ntasks is None:
            ntasks = nodes * (per_node or 1)
        return cls(nodes=nodes, ntasks=ntasks, layout=block_layout(ntasks, nodes, per_node),
                   first_node=first_node, cpus_per_task=positive_int(opts, "cpus_per_task"),
                   ntasks_per_node=per_node, gpus_per_node=opts.get("gpus_per_node"),
                   gpus_per_task=opts.get("gpus_per_task"), gpus=opts.get("gpus"),
                   partition=opts.get("partition", "shim"))

    def env(self, suffix: str = "") -> dict:
        """The allocation's variables (suffix `_HET_GROUP_g` for a heterogeneous component)."""
        e = {
            "SLURM_JOB_NUM_NODES": self.nodes,
            "SLURM_NNODES": self.nodes,
            "SLURM_JOB_NODELIST": node_list(self.first_node, self.nodes),
            "SLURM_NODELIST": node_list(self.first_node, self.nodes),
            "SLURM_NTASKS": self.ntasks,
            "SLURM_NPROCS": self.ntasks,
            "SLURM_TASKS_PER_NODE": tasks_per_node_text(self.layout),
            "SLURM_JOB_CPUS_PER_NODE": tasks_per_node_text(
                [c * (self.cpus_per_task or 1) for c in self.layout]),
            "SLURM_JOB_PARTITION": self.partition,
        }
        if self.ntasks_per_node:
            e["SLURM_NTASKS_PER_NODE"] = self.ntasks_per_node
        if self.cpus_per_task:
            e["SLURM_CPUS_PER_TASK"] = self.cpus_per_task
        if self.gpus_per_node:
            e["SLURM_GPUS_PER_NODE"] = self.gpus_per_node
        if self.gpus_per_task:
            e["SLURM_GPUS_PER_TASK"] = self.gpus_per_task
        if self.gpus:
            e["SLURM_GPUS"] = self.gpus
        return {k + suffix: str(v) for k, v in e.items()}


def which_mpiexec() -> str:
    path = shutil.which("mpiexec")
    if path is None:
        raise ShimError("mpiexec not found on PATH (pip install mpich)")
    return path
