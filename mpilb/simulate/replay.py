"""``mpilb simulate --from RUN.h5``: a run's measured workers and settings, to replay.

From the run log (docs/logs.md):

- per worker, a piecewise-constant trace from its ``workers/`` rows (one per rebalance
  interval): compute seconds per sample (``compute_s / samples``, injected slowdowns
  included, as they stand for slower hardware), I/O seconds per sample (``io_s / samples``:
  the wait for reads that prefetch did not hide, ``readbw`` included), and the per-step cost of its
  link (``comm_s`` over its steps in the interval, counted from ``updates/``, less the
  modelled store time, which the engine adds back). An interval without samples keeps
  the previous piece; past the log's end the last piece holds;
- shard sizes (the dataset's manifest when it is still there, else the samples applied per
  shard in the first epoch), batch, batch policy, mode, rebalance interval, seed, epochs
  completed, worker timeout, and the injected faults (``hang``/``crash``; slowdowns are in
  the traces already);
- the model's parameter count (built from the config and the dataset), for the stores;
- its membership changes (``members/``: joins, respawns, leaves, losses), replayed at their
  times (:mod:`mpilb.simulate.members`); a worker that joined has its own trace from its
  rows, and runs on its node where the row names one, else on a node of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from mpilb.errors import UsageError
from mpilb.core.inject import parse_injects
from mpilb.core.topology import default_stores
from mpilb.simulate.cluster import Profile, Slices
from mpilb.simulate.cores import NodeCores, log_cores, node_cores, uncontended


@dataclass
class Replay:
    """What ``--from`` hands the engine, and what the run measured (for comparisons)."""

    path: str
    config: dict
    profiles: list[Profile]
    shard_sizes: list[int]
    params: int | None
    row_bytes: int
    faults: list = field(default_factory=list)
    measured_epoch_s: list[float] = field(default_factory=list)
    measured_utilization: list[float] = field(default_factory=list)
    servers: int = 1   # the run's parameter stores (its `stores`, or --servers K)
    ranks: list[int] = field(default_factory=list)      # the MPI rank of each profile
    node_of: list[int] = field(default_factory=list)    # every rank's node (from hostnames)
    rank_faults: list = field(default_factory=list)     # ``faults`` by MPI rank
    cores: NodeCores | None = None    # the nodes' cores, where ranks outnumber them
    members: list = field(default_factory=list)   # (t, MPI rank, event) of members/
    every_node: list[int] = field(default_factory=list)   # node_of and the joiners' ids'

    def never_worked(self) -> set[int]:
        """Joiners' ids (past the job's ranks) without a row of their own in workers/: a
        joiner that never started work is no worker in a replay on the run's network."""
        return set(range(len(self.node_of), len(self.every_node))) - set(self.ranks)

    def engine_members(self) -> list:
        """``members`` with the workers numbered as the engine without a network numbers
        them (1..W, in the order of ``ranks``)."""
        number = {r: i + 1 for i, r in enumerate(self.ranks)}
        return [(t, number[r], e) for t, r, e in self.members if r in number]

    def rank_profiles(self) -> list:
        """A profile for every MPI rank and joiner's id (``every_node``): the run's own for
        its workers; a rank that was a store gets the profile of a worker on its node (else
        of the first worker)."""
        own = dict(zip(self.ranks, self.profiles))
        out = []
        for rank, node in enumerate(self.every_node or self.node_of):
            mate = next((own[r] for r in self.ranks if r < len(self.node_of)
                         and self.node_of[r] == node), self.profiles[0])
            out.append(own.get(rank, mate))
        return out


def load_run(path: str, params: int | None = None, cores_per_node: int | None = None,
             share_cores: bool = True) -> Replay:
    """Read a finished run's log. UsageError (one line, naming the file) when it cannot be
    read, is not a run log, or did not finish an epoch.

    With ``share_cores`` (the engine without a network), where a node's ranks outnumber its
    cores (``cores_per_node``, else the log's ``cpus``), the workers' compute per sample is
    taken back to what it would be on a core of their own (:mod:`mpilb.simulate.cores`)."""
    from mpilb.runfiles.runlog import file_kind, read_columns

    try:
        attrs, cols = read_columns(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--from {path}: cannot read the run log ({_reason(exc)})") from None
    if file_kind(attrs) == "checkpoint":
        try:
            log = json.loads(attrs["config"])["log"] or "RUN.h5"
        except (KeyError, TypeError, ValueError):
            log = "RUN.h5"
        raise UsageError(f"--from {path}: an mpilb checkpoint, not a run log; give the run's log "
                         f"({log}): the replay reads its measured rates")
    if "config" not in attrs:
        raise UsageError(f"--from {path}: not an mpilb run log (no config attribute)")
    try:
        config = json.loads(attrs["config"])
    except ValueError:
        raise UsageError(f"--from {path}: its config attribute is not JSON") from None
    status = attrs.get("status", "?")
    if status in ("running", "failed") or len(cols["epochs"]["epoch"]) == 0:
        raise UsageError(f"--from {path}: the run is unfinished (status {status}, "
                         f"{len(cols['epochs']['epoch'])} epochs logged); replay a run that "
                         f"completed at least one epoch")
    world = int(attrs.get("world_size", 0))
    # the stores' ranks (root attribute `stores`), else --servers K on one node
    stores = attrs.get("stores")
    servers = (len(json.loads(stores)) if isinstance(stores, str) and stores.startswith("[")
               else len(default_stores(config.get("servers", 1) or 1)))
    ranks = sorted({int(r) for r in cols["workers"]["worker"]})
    if not ranks or world < 2:
        raise UsageError(f"--from {path}: no worker rows (a serial run has nothing to balance)")
    members = _members(attrs, cols)
    dataset = _dataset(config)
    row_bytes = dataset.row_nbytes if dataset is not None else 1024
    if params is None:
        params = _params(config, dataset)
    shard_sizes = (list(dataset.shard_sizes) if dataset is not None
                   else _shard_sizes(cols["updates"], path))
    link_model = Slices(params or 0, servers)
    ep = cols["epochs"]
    last = (float(ep["t_start"][-1]), float(ep["t_end"][-1]))
    node_of = _nodes(attrs, world)
    every_node = _joiner_nodes(node_of, ranks, cols)
    cores = _cores(attrs, ranks, node_of, every_node, cores_per_node) if share_cores else None
    slow = (uncontended(cols, ranks, every_node, cores.cores, cores.shared(), cores.server_share)
            if cores is not None else None)
    profiles = [_profile(cols, r, link_model.update_s, last, slow) for r in ranks]
    # the engine numbers workers 1..W: map the run's ranks onto them
    faults = [rule for rule in parse_injects(config.get("inject") or [], world)
              if rule.kind in ("hang", "crash")]
    rank_faults = list(faults)    # by MPI rank, for a replay on the run's network
    renumber = {r: i + 1 for i, r in enumerate(ranks)}
    faults = [type(f)(frozenset(renumber[r] for r in f.ranks if r in renumber)
                      if f.ranks is not None else None, f.kind, f.value, f.start, f.end,
                      f.prob, f.text) for f in faults]
    return Replay(path, config, profiles, shard_sizes, params, row_bytes, faults,
                  [float(e - s) for s, e in zip(ep["t_start"], ep["t_end"])],
                  [float(u) for u in ep["utilization"]], servers, ranks, node_of,
                  rank_faults, cores, members, every_node)


def _members(attrs: dict, cols: dict) -> list:
    """The run's membership changes: (t, rank, event), in time order; at each --resume
    (``resumed_at``) a worker that had joined and not gone is out (a ``resume`` row, replayed
    as a leave: the resumed launch has the job's ranks only)."""
    m = cols.get("members") or {}
    rows = sorted(((float(t), int(w), str(e)) for t, w, e in zip(
        m.get("t", ()), m.get("worker", ()), m.get("event", ()))), key=lambda r: r[0])
    try:
        resumes = [float(t) for t in json.loads(attrs.get("resumed_at", "[]"))]
    except (TypeError, ValueError):
        resumes = []
    for resumed in resumes:
        inside: set = set()
        for t, w, e in rows:
            if t > resumed:
                break
            if e in ("join", "respawn"):
                inside.add(w)
            else:
                inside.discard(w)
        rows = sorted(rows + [(resumed, w, "resume") for w in sorted(inside)], key=lambda r: r[0])
    return rows


def _joiner_nodes(node_of: list[int], ranks: list[int], cols: dict) -> list[int]:
    """``node_of`` extended to every worker's id: a worker that joined (an id above the
    job's ranks) is on the node its ``join``/``respawn`` row names, else on a node of its
    own (-1 there: no rank of the job runs on its host)."""
    m = cols.get("members") or {}
    named = {int(w): int(n) for w, n, e in zip(m.get("worker", ()), m.get("node", ()),
                                               m.get("event", ())) if str(e) in ("join", "respawn")}
    out = list(node_of)
    spare = max(node_of) + 1 if node_of else 1
    for r in range(len(node_of), max(ranks, default=0) + 1):
        node = named.get(r, -1)
        if node < 0 or node >= spare:
            node, spare = spare, spare + 1
        out.append(node)
    return out


def _cores(attrs, ranks, node_of, every_node, per_node) -> NodeCores | None:
    """The model of the nodes' cores, or None where every rank has a core (or none is
    known); a node only joiners run on (``every_node`` past ``node_of``'s) has a core each."""
    cores = node_cores(node_of, log_cores(attrs, len(node_of)), per_node)
    if cores is None:
        return None
    extra = max(every_node) + 1 - len(cores)
    cores = tuple(cores) + (len(every_node),) * max(0, extra)
    model = NodeCores(cores, {i + 1: every_node[r] for i, r in enumerate(ranks)}, node_of[0],
                      _server_share(attrs))
    return model if model.shared() else None


def _server_share(attrs: dict) -> float:
    """The share of a core rank 0 used over the run: its CPU seconds over the training's."""
    cpu = float(attrs.get("server_cpu_s", 0.0) or 0.0)
    train = float(attrs.get("train_s", 0.0) or 0.0)
    return min(1.0, cpu / train) if train > 0 else 0.0


def _nodes(attrs: dict, world: int) -> list[int]:
    """Every rank's node: the log's ``nodes`` (a node per rank) or ``hostnames`` attribute,
    nodes numbered in the order of their first rank; one node when neither says."""
    for key in ("nodes", "hostnames"):
        try:
            names = json.loads(attrs.get(key, "null"))
        except (TypeError, ValueError):
            continue
        if isinstance(names, list) and len(names) == world:
            order: dict = {}
            return [order.setdefault(str(n), len(order)) for n in names]
    return [0] * world


def _reason(exc: Exception) -> str:
    text = str(exc).split("(")[0].strip().rstrip(",")
    return text or type(exc).__name__


def _dataset(config: dict):
    from mpilb.data.dataset import open_dataset

    data = config.get("data")
    if not data:
        return None
    try:
        return open_dataset(data, check_files=False)
    except Exception:   # noqa: BLE001 - gone or moved: fall back on the log's own figures
        return None


def _params(config: dict, dataset) -> int | None:
    if dataset is None:
        return None
    from mpilb.models import is_user_spec

    if is_user_spec(config.get("model")):
        return None    # never import code a run log names: ask for --params instead
    try:
        from mpilb.config.build import parse_hidden
        from mpilb.models import build_model

        model = build_model(config["model"], tuple(dataset.sample_shape), dataset.num_classes,
                            parse_hidden(config.get("hidden", "256,128")))
        return int(model.num_params)
    except Exception:   # noqa: BLE001 - a user model we cannot build here: ask for --params
        return None


def _shard_sizes(updates: dict, path: str) -> list[int]:
    first = updates["epoch"] == 0
    shards, batches = updates["shard"][first], updates["batch"][first]
    if len(shards) == 0:
        raise UsageError(f"--from {path}: no updates in its first epoch")
    sizes = np.bincount(shards.astype(np.int64), weights=batches.astype(np.float64))
    if np.any(sizes <= 0):
        raise UsageError(f"--from {path}: the dataset is gone and the log does not show "
                         f"every shard's size")
    return [int(s) for s in sizes]


def _profile(cols: dict, rank: int, store_s: float, last: tuple, slow=None) -> Profile:
    """The worker's trace: one piece per ``workers/`` row up to the end of the last epoch
    (``last``: its start and end), then the totals over that epoch for all later times.

    A row after the last epoch's end is the run's shutdown (its final steps and the wait
    for the stop, counted as communication over a few steps): it is left out, and past the
    log's end (a what-if whose epochs take longer than the run's) the worker keeps its
    last epoch's mean speeds rather than that row's. ``slow``: the sharing of the node's
    cores each row was measured under (:func:`mpilb.simulate.cores.uncontended`), which
    its compute is divided by.
    """
    w = cols["workers"]
    rows = np.flatnonzero(w["worker"] == rank)
    rows = rows[np.argsort(w["t"][rows], kind="stable")]
    ups = np.sort(cols["updates"]["t"][cols["updates"]["worker"] == rank])
    edges, comp, io, link = [], [], [], []
    tail = np.zeros(4)          # samples, compute_s, io_s, comm_s over the last epoch
    t_prev = 0.0
    start, end = last
    for i in rows:
        t, n = float(w["t"][i]), float(w["samples"][i])
        if t > end and edges:
            break
        steps = int(np.searchsorted(ups, t, "right") - np.searchsorted(ups, t_prev, "right"))
        compute_s = float(w["compute_s"][i]) / (slow[i] if slow is not None else 1.0)
        if n > 0 and compute_s > 0:
            edges.append(t_prev)
            comp.append(compute_s / n)
            io.append(float(w["io_s"][i]) / n)
            link.append(max(0.0, float(w["comm_s"][i]) / max(1, steps) - store_s))
            if t_prev >= start:
                tail += (n, compute_s, w["io_s"][i], w["comm_s"][i])
        t_prev = t
    if not edges:
        raise UsageError(f"rank {rank} reported no work in the run log")
    edges[0] = 0.0
    if tail[0] > 0 and end > edges[-1]:
        steps = int(np.searchsorted(ups, end, "right") - np.searchsorted(ups, start, "right"))
        edges.append(end)
        comp.append(tail[1] / tail[0])
        io.append(tail[2] / tail[0])
        link.append(max(0.0, tail[3] / max(1, steps) - store_s))
    return Profile(edges, comp, io, link)
