"""What the engine simulates: a configuration (:class:`SimConfig`) and its workers
(:class:`SimWorker`), each with the server's view of it in the states of the live server's
peers (:mod:`mpilb.core.worker_state`); the kinds of events on the engine's heap."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from mpilb.core.worker_state import Membership, Waiting, WorkerState
from mpilb.mpi.chunks import DEFAULT_KB
from mpilb.simulate.cluster import Profile

PUSH, REBALANCE, LOST, JOIN, LEAVE = 0, 1, 2, 3, 4   # the engine's events


@dataclass
class SimConfig:
    """One configuration to simulate (the options of `mpilb train` that matter here)."""

    balancer: str = "load"
    mode: str = "async"
    batch_policy: str = "fixed"
    servers: int = 1
    batch: int = 32
    min_batch: int = 1
    max_batch: int = 4096
    sit_out: bool = True
    rebalance_interval: float = 2.0
    epochs: int = 1
    seed: int = 0
    worker_timeout: float = 60.0
    params: int = 100_000
    server_gbps: float = 4.8
    apply_s: float = 0.00019
    row_bytes: int = 1024
    wire: str = "fp32"        # bytes per float on the wire (a network model only)
    pipeline: int = 0         # --pipeline 1: compute the next batch while a push travels
                              # (a network model only)
    chunk_kb: int = DEFAULT_KB   # --chunk-kb: slices between nodes in chunks, each answered as
                              # it comes (0: whole; a network model only)
    jitter: float = 0.0       # sigma of a lognormal factor (mean 1) on each step's compute
    inject: list = field(default_factory=list)   # parsed InjectRule objects
    members: list = field(default_factory=list)  # (t, worker, event) of a replayed run's
                              # joins, respawns, leaves and losses (simulate/members.py)
    cores: object = None      # a cores.NodeCores: ranks that outnumber a node's cores share
                              # them (none where each rank has a core)


class SimPush:
    """What sit-out reads of a worker's last push."""

    __slots__ = ("lo", "hi", "compute_s")

    def __init__(self, lo: int, hi: int, compute_s: float):
        self.lo, self.hi, self.compute_s = lo, hi, compute_s


class SimWorker(WorkerState):
    """A simulated worker, and the server's view of it: ``waiting`` and ``membership`` as a
    live :class:`~mpilb.server.peers.Peer`'s (what :class:`~mpilb.core.sitout.SitOut` and
    :class:`~mpilb.core.decisions.Decisions` read and set: ``benched``, ``bench``,
    ``unbench``, ``probing``, ``batch``, ``lags``, ``last_gap``, ``last_push``, ``step``),
    and ``dead``: it hung or crashed and the server has not declared it lost yet."""

    __slots__ = ("rank", "profile", "rules", "batch", "waiting", "membership", "dead",
                 "reply_t", "n", "comp", "io", "comm", "epoch_busy", "epoch_finish", "busy",
                 "step", "fault_t", "read_free", "ready", "rng", "benched_at", "probing",
                 "samples", "lags", "last_gap", "last_push", "jitter", "noise", "duty",
                 "first_t", "last_t")

    def __init__(self, rank: int, profile: Profile, rules, batch: int, seed: int,
                 jitter: float = 0.0):
        self.rank, self.profile, self.batch = rank, profile, batch
        self.rules = [r for r in rules if r.applies_to(rank) and r.kind not in ("hang", "crash")]
        faults = [r.start for r in rules if r.applies_to(rank) and r.kind in ("hang", "crash")]
        self.fault_t = min(faults) if faults else math.inf
        self.waiting = Waiting.IDLE
        self.membership = Membership.ACTIVE
        self.dead = False
        self.reply_t = 0.0
        self.n = 0
        self.comp = self.io = self.comm = 0.0
        self.duty = 1.0   # the share of its last step it computed (simulate/cores.py)
        self.epoch_busy = 0.0
        self.epoch_finish = None
        self.busy = 0.0
        self.step = self.samples = 0
        self.first_t: Optional[float] = None   # when its first and last pushes arrived
        self.last_t: Optional[float] = None
        self.read_free = 0.0
        self.ready: dict[tuple, float] = {}   # when each task's rows are read, by read_key
        self.rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, rank]) if any(
            r.prob < 1.0 for r in self.rules) else None
        # per-step noise: a stream of its own, so that it changes no injection's draws
        self.jitter = jitter
        self.noise = np.random.default_rng([int(seed) & 0xFFFFFFFF, rank, 1]) if jitter else None
        self.benched_at = 0.0
        self.probing = 0
        self.lags: list = []
        self.last_gap: Optional[float] = None
        self.last_push: Optional[SimPush] = None

    # -- reading (and go_idle, lose: WorkerState) ------------------------------------
    @property
    def present(self) -> bool:
        """In the run as the engine counts it: not lost, and not dead (hung or crashed)."""
        return self.membership in (Membership.ACTIVE, Membership.BENCHED) and not self.dead

    # -- changes -------------------------------------------------------------------------
    def compute(self) -> None:
        """A step starts."""
        self.waiting = Waiting.COMPUTING

    def hold(self) -> None:
        """Sync: its push joined the round; the reply waits for the round."""
        self.waiting = Waiting.HELD

    def die(self) -> None:
        """It hangs or crashes at its next step; to the server it still computes."""
        self.dead, self.waiting = True, Waiting.COMPUTING

    def bench(self, now: float) -> None:
        self.membership, self.waiting = Membership.BENCHED, Waiting.IDLE
        self.probing, self.benched_at, self.batch = 0, now, 0
        self.ready.clear()

    def unbench(self, probe_batch: int) -> None:
        self.membership, self.waiting = Membership.ACTIVE, Waiting.IDLE
        self.probing, self.batch = 2, probe_batch

    # -- the cost of a step --------------------------------------------------------------
    def injected(self, t: float, comp: float, io: float, replay: bool) -> tuple[float, float]:
        """(compute, I/O) seconds of a step at ``t`` under its --inject rules."""
        elapsed = t
        hits = self.rng.random(len(self.rules)) if self.rng is not None else None
        factor, delay = 1.0, 0.0
        for k, rule in enumerate(self.rules):
            if not rule.in_window(elapsed) or (hits is not None and hits[k] >= rule.prob):
                continue
            if rule.kind == "compute":
                factor += rule.value - 1.0
            elif rule.kind == "delay":
                delay += rule.value
            elif rule.kind == "io" and replay:
                io *= rule.value
        return comp * factor + delay, io

    def jittered(self, comp: float) -> float:
        """A step's compute seconds under --jitter: times a lognormal factor of mean 1 (real
        steps vary, and without it workers of equal speed stay in lock-step for ever,
        their transfers always sharing the links at the same moments)."""
        if self.noise is None:
            return comp
        s = self.jitter
        return comp * float(np.exp(s * self.noise.standard_normal() - 0.5 * s * s))

    def read_wait(self, tasks, task, t: float, shard_sizes, row_bytes: int) -> float:
        """Seconds it waits at ``t`` for the rows of ``task`` (synthetic reads, one at a
        time, each started when it knows of the task, behind the previous one; ``tasks``:
        what it holds, current and prefetched)."""
        for tk in tasks:
            key = read_key(tk)
            if key not in self.ready:
                start = max(self.read_free, t)
                self.read_free = start + self.read_seconds(shard_sizes[tk.shard] * row_bytes, start)
                self.ready[key] = self.read_free
        return max(0.0, self.ready[read_key(task)] - t)

    def read_seconds(self, nbytes: int, t: float) -> float:
        """Seconds to read a shard of ``nbytes`` started at ``t`` (synthetic reads)."""
        secs = nbytes / self.profile.read_bps
        for rule in self.rules:
            if rule.in_window(t):
                if rule.kind == "io":
                    secs *= rule.value
                elif rule.kind == "readbw":
                    secs = max(secs, nbytes / (rule.value * 1e6))
        return secs


def read_key(task) -> tuple[int, int, int]:
    """What names a task's read in a worker's ``ready`` times: its epoch, shard and first
    position. Not ``id(task)``: a task cut away or finished is freed, and a later task may
    get its id (its memory address, which differs from run to run), finding a read it never
    had; the same seed then gave different figures (#33)."""
    return task.epoch, task.shard, task.start
