"""The ``mpilb simulate`` command: options, the configurations they span, table, JSON, plot.

Several values of ``--workers``, ``--balancer``, ``--mode``, ``--batch-policy`` and
``--servers`` (comma lists) give every combination, each simulated on the same cluster.
"""

from __future__ import annotations

import itertools
import json
import math
import sys

from mpilb.errors import UsageError
from mpilb.mpi.chunks import DEFAULT_KB

COLUMNS = ("epoch_s", "utilization", "imbalance_s", "moves", "updates_per_s", "server_busy")
DEFAULT_BALANCERS = "static,load,predictive"


def add_arguments(p) -> None:
    """The options of ``mpilb simulate`` (cli.py builds the subparser)."""
    p.add_argument("--from", dest="from_log", metavar="RUN.h5",
                   help="replay this run: its measured rates, I/O and settings")
    p.add_argument("--workers", metavar="W[,W...]", help="simulated workers (one or more counts)")
    p.add_argument("--rates", default="const:100", metavar="SPEC",
                   help="const:R | lognormal:mean=R,sigma=S | file:CSV (samples/s per worker)")
    p.add_argument("--inject", action="append", default=[], metavar="SPEC",
                   help="RANKS:KIND[=VALUE][@START[-END]][,p=PROB] as for train (repeatable)")
    p.add_argument("--jitter", type=float, metavar="S", help="each step's compute times a "
                   "lognormal factor of sigma S, mean 1 (default 0: constant steps)")
    p.add_argument("--samples", type=int, help="samples per epoch (default 1000 per shard)")
    p.add_argument("--shards", type=int, help="shards (default 4 per worker)")
    p.add_argument("--epochs", type=int, help="epochs (default 3; --from: the run's)")
    p.add_argument("--batch", type=int, help="batch per worker (default 32; --from: the run's)")
    p.add_argument("--balancer", metavar="A[,B...]",
                   help=f"policies (default {DEFAULT_BALANCERS}; --from: the run's)")
    p.add_argument("--mode", metavar="async|sync[,...]", help="default async (--from: the run's)")
    p.add_argument("--batch-policy", metavar="fixed|proportional[,...]",
                   help="default fixed (--from: the run's)")
    p.add_argument("--servers", metavar="K|per-node[,...]",
                   help="parameter stores (default 1; per-node: one on every node, with --nodes)")
    p.add_argument("--params", type=int, help="model parameters (default 100000; --from: the model's)")
    p.add_argument("--server-gbps", type=float, help="GB/s one store moves and applies (default: bench ps)")
    p.add_argument("--apply-s", type=float, help="fixed seconds per update per store (default: bench ps)")
    p.add_argument("--link-gbps", type=float, default=None, help="a worker's link, GB/s (default 10)")
    net = p.add_argument_group("network (docs/simulate.md: the network model)")
    net.add_argument("--nodes", type=int, metavar="N", help="nodes (a network model: pushes and "
                     "replies as transfers over each node's link)")
    net.add_argument("--ranks-per-node", metavar="R[,R...]",
                     help="MPI ranks per node, stores included: one count, or one per node "
                          "(as mpiexec -hosts n0:1,n1:2: 1,2; default 8)")
    net.add_argument("--link-rate", metavar="RATE[,RATE...]",
                     help="each node's link, each direction, as tc: 100mbit, 1gbit, 10gbit, "
                          "1.5gbit, 125mbps (one, or one per node; default 10gbit)")
    net.add_argument("--shm-rate", metavar="RATE", help="within a node (default 40gbit)")
    net.add_argument("--latency", type=float, metavar="S", help="one way, per transfer (default 5e-5)")
    net.add_argument("--link-burst", type=float, metavar="MS", help="a link's token bucket, in "
                     "ms of its rate, spent at the shm rate (tc tbf's burst: the cluster in a "
                     "box's links bank 5; default 0, a NIC's line rate)")
    net.add_argument("--mtu", type=int, metavar="BYTES", help="a link's packet size: TCP/IP "
                     "headers (52 bytes) and Ethernet's (14) take their share of each (default "
                     "1500: 95.6%% of a link's rate carries data; 9000: 99.3%%)")
    net.add_argument("--link-sharing", choices=("auto", "coupled", "per-link"),
                     help="coupled: a transfer moves at one rate along its links, max-min fair "
                          "(exact, costlier); per-link: each link shares its flows on its own "
                          "(cheap, reads faster when both ends are loaded); auto (default): "
                          "coupled up to 16 nodes")
    net.add_argument("--pipeline", type=int, choices=(0, 1), help="1: a worker computes its "
                     "next batch while its push travels (default: 1, as train's async; --from: "
                     "the run's)")
    net.add_argument("--chunk-kb", type=int, metavar="KB", help="slices between nodes move "
                     "in chunks of about KB, each stepped and answered as it comes, as train's "
                     f"--chunk-kb (default {DEFAULT_KB}, as train's; 0: whole slices; --from: the run's)")
    net.add_argument("--wire", metavar="fp32|bf16|fp16[,...]",
                     help="bytes per float on the wire: 4, 2, 2 (default fp32)")
    p.add_argument("--cores-per-node", type=int, metavar="N", help="usable cores of each node: "
                   "ranks that outnumber them share them (default --from: the log's cpus)")
    p.add_argument("--read-mbps", type=float, default=None, help="shard reads, MB/s (default 1000)")
    p.add_argument("--row-bytes", type=int, default=None, help="bytes per sample (default 1024)")
    p.add_argument("--rebalance-interval", type=float, help="seconds (default 2; --from: the run's)")
    p.add_argument("--worker-timeout", type=float, help="seconds (default 60; --from: the run's)")
    p.add_argument("--min-batch", type=int)
    p.add_argument("--max-batch", type=int)
    p.add_argument("--sit-out", type=int, choices=(0, 1))
    p.add_argument("--seed", type=int)
    p.add_argument("--json", action="store_true", help="print a list of result objects")
    p.add_argument("--plot", metavar="FILE.png", help="epoch time and utilization per configuration")


def _list(text: str | None, default: str, what: str, valid=None, kind=str) -> list:
    items = [s.strip() for s in (text if text is not None else default).split(",") if s.strip()]
    if not items:
        raise UsageError(f"--{what}: no value given")
    out = []
    for item in items:
        try:
            value = kind(item)
        except ValueError:
            raise UsageError(f"--{what}: {item!r} is not a {kind.__name__}") from None
        if valid is not None and value not in valid:
            raise UsageError(f"--{what}: unknown {item!r}; valid: {', '.join(map(str, valid))}")
        out.append(value)
    return out


def _counts(text: str | None, what: str, default: str) -> list[int]:
    values = _list(text, default, what, kind=int)
    for v in values:
        if v < 1:
            raise UsageError(f"--{what} must be at least 1 (got {v})")
    return values


def run_simulate(args) -> int:
    """Simulate every configuration the options span; print the table (or JSON)."""
    from mpilb.core.balancer import BALANCERS, BATCH_POLICIES
    from mpilb.simulate.workers import SimConfig
    from mpilb.simulate.network import WIRE_BYTES, Layout, servers_count
    from mpilb.simulate.run import run

    clusters, base = _clusters(args)
    balancers = _list(args.balancer, base.pop("balancer", DEFAULT_BALANCERS), "balancer", BALANCERS)
    modes = _list(args.mode, base.pop("mode", "async"), "mode", ("async", "sync"))
    policies = _list(args.batch_policy, base.pop("batch_policy", "fixed"), "batch-policy",
                     BATCH_POLICIES)
    spec = base.pop("network", None)
    servers = [servers_count(v, spec.nodes if spec else None)
               for v in _list(args.servers, str(base.pop("servers", 1)), "servers")]
    wires = _list(args.wire, "fp32", "wire", WIRE_BYTES)
    if spec is None and args.wire is not None:
        raise UsageError("--wire needs a network: give --nodes (or --link-rate with --from)")
    if spec is not None and "sync" in modes:
        raise UsageError("--mode sync on a network (--nodes/--link-rate) is not simulated yet: "
                         "drop the network options for sync rounds")
    layouts = ({k: Layout(spec, k, base.get("node_of"), base.get("absent", frozenset()))
                for k in servers} if spec else {})
    base.pop("node_of", None)
    base.pop("absent", None)
    results = []
    if not args.json:   # rows as they come: a large cluster takes a while per configuration
        print("\n".join(table_head(clusters, spec)), flush=True)
    for label, profiles, sizes, replay, extra in clusters:
        for bal, mode, pol, k, wire in itertools.product(balancers, modes, policies, servers,
                                                          wires if spec else ["fp32"]):
            cfg = SimConfig(balancer=bal, mode=mode, batch_policy=pol, servers=k, wire=wire, **base)
            res = run(cfg, profiles, sizes, replay, layouts.get(k))
            res.update(extra)
            results.append(res)
            if not args.json:
                print(table_row(res), flush=True)
    if args.json:
        print(json.dumps(results))
    if args.plot:
        from mpilb.simulate.plot import plot_results

        plot_results(results, args.plot)
        if not args.json:
            print(f"plot: {args.plot}")
    return 0


def _clusters(args):
    """[(label, profiles, shard sizes, replay?, extra result keys)] and the shared settings."""
    from mpilb.core.inject import parse_injects
    from mpilb.simulate import cluster as C

    cfg = {}
    if args.params is not None and args.params < 0:
        raise UsageError(f"--params must be >= 0 (got {args.params})")
    if args.from_log:
        if args.workers or args.inject:
            raise UsageError("--from replays a run: --workers and --inject come from its log")
        from mpilb.simulate.replay import load_run

        run = load_run(args.from_log, args.params, args.cores_per_node,
                       share_cores=not _network_given(args))
        rc = run.config
        if run.params is None and args.params is None:
            raise UsageError(f"--from {args.from_log}: cannot rebuild the model to count its "
                             f"parameters; give --params")
        cfg.update(balancer=rc.get("balancer", "load"), mode=rc.get("mode", "async"),
                   batch_policy=rc.get("batch_policy", "fixed"), servers=run.servers,
                   batch=rc.get("batch", 32), min_batch=rc.get("min_batch", 1),
                   max_batch=rc.get("max_batch", 4096), sit_out=bool(rc.get("sit_out", 1)),
                   rebalance_interval=rc.get("rebalance_interval", 2.0),
                   epochs=len(run.measured_epoch_s), seed=rc.get("seed", 0),
                   worker_timeout=rc.get("worker_timeout", 60.0),
                   params=run.params, row_bytes=run.row_bytes, inject=run.faults,
                   cores=run.cores, members=run.engine_members())
        if cfg["mode"] == "ssp":
            cfg["mode"] = "async"   # not modelled: replayed as async (docs/simulate.md)
        extra = {"from": args.from_log, "members": [list(m) for m in run.members],
                 "measured_epoch_s": sum(run.measured_epoch_s) / len(run.measured_epoch_s),
                 "measured_utilization": sum(run.measured_utilization) / len(run.measured_utilization)}
        clusters = [(args.from_log, run.profiles, run.shard_sizes, True, extra)]
        if _network_given(args):
            spec, node_of = _replay_network(args, run)
            cfg.update(network=spec, node_of=node_of, absent=frozenset(run.never_worked()),
                       inject=run.rank_faults,
                       pipeline=int(rc.get("pipeline") or 0), members=run.members,
                       # (a log without it: a run from before chunks, whole slices)
                       chunk_kb=int(rc.get("chunk_kb", 0)))
            clusters = [(args.from_log, run.rank_profiles(), run.shard_sizes, True, extra)]
    elif args.nodes is not None:
        spec = _network(args, args.nodes)
        clusters = [_net_cluster(args, spec)]
        seed = args.seed if args.seed is not None else 0
        params = args.params if args.params is not None else 100_000
        cfg.update(params=params, seed=seed, network=spec, pipeline=1,
                   inject=parse_injects(args.inject, len(spec.node_of())))
    else:
        if _network_given(args):
            raise UsageError("the network options need --nodes N (or --from a run's log)")
        if args.workers is None and not args.rates.startswith("file:"):
            raise UsageError("give --from RUN.h5, or --workers W with --rates SPEC")
        counts = _counts(args.workers, "workers", "0") if args.workers else [None]
        seed = args.seed if args.seed is not None else 0
        params = args.params if args.params is not None else 100_000
        link = C.link_seconds(params, args.link_gbps or C.LINK_GBPS)
        read_bps = (args.read_mbps or C.READ_MBPS) * 1e6
        clusters = []
        for w in counts:
            rates = C.parse_rates(args.rates, w, seed)
            profiles = [C.constant(r, link, read_bps) for r in rates]
            n = len(profiles)
            shards = args.shards if args.shards is not None else 4 * n
            samples = args.samples if args.samples is not None else 1000 * shards
            if shards < 1 or samples < shards:
                raise UsageError(f"--samples {samples} cannot fill --shards {shards} (need >= 1 each)")
            sizes = [samples // shards + (1 if i < samples % shards else 0) for i in range(shards)]
            clusters.append((f"--rates {args.rates}", profiles, sizes, False, {}))
        rules = parse_injects(args.inject, max(len(c[1]) for c in clusters) + 1)
        cfg.update(params=params, inject=rules, seed=seed)
        if args.cores_per_node is not None:   # the server and every worker on one node
            from mpilb.simulate.cores import NodeCores, node_cores

            most = max(len(c[1]) for c in clusters)
            cfg["cores"] = NodeCores(node_cores([0], None, args.cores_per_node),
                                     {r: 0 for r in range(1, most + 1)})
    if args.cores_per_node is not None and "network" in cfg:
        raise UsageError("--cores-per-node is modelled without a network only: drop --nodes "
                         "and --link-rate, or --cores-per-node")
    for key in ("batch", "min_batch", "max_batch", "rebalance_interval", "worker_timeout",
                "seed", "epochs", "row_bytes"):
        value = getattr(args, key, None)
        if value is not None:
            cfg[key] = value
    if args.jitter is not None:
        if not args.jitter >= 0 or args.jitter > 3:
            raise UsageError(f"--jitter must be between 0 and 3 (a lognormal sigma; got {args.jitter})")
        cfg["jitter"] = args.jitter
    if args.pipeline is not None:
        cfg["pipeline"] = args.pipeline
    if args.chunk_kb is not None:
        if "network" not in cfg:
            raise UsageError("--chunk-kb needs a network: give --nodes (or --from a run's log "
                             "with --link-rate)")
        if args.chunk_kb < 0:
            raise UsageError(f"--chunk-kb must be >= 0 (got {args.chunk_kb})")
        cfg["chunk_kb"] = args.chunk_kb
    if args.sit_out is not None:
        cfg["sit_out"] = bool(args.sit_out)
    if args.server_gbps is not None:
        if not 0 < args.server_gbps < math.inf:
            raise UsageError(f"--server-gbps must be > 0 (got {args.server_gbps})")
        cfg["server_gbps"] = args.server_gbps
    if args.apply_s is not None:
        if not 0 <= args.apply_s < math.inf:
            raise UsageError(f"--apply-s must be >= 0 s (got {args.apply_s})")
        cfg["apply_s"] = args.apply_s
    cfg.setdefault("epochs", 3)
    for key in ("batch", "epochs"):
        if key in cfg and cfg[key] < 1:
            raise UsageError(f"--{key} must be at least 1 (got {cfg[key]})")
    if cfg.get("rebalance_interval", 1.0) <= 0:
        raise UsageError("--rebalance-interval must be > 0")
    if args.servers is not None:
        cfg.pop("servers", None)
    return clusters, cfg


def format_table(results: list[dict], clusters) -> str:
    """One row per configuration, with the measured figures first when replaying."""
    return "\n".join([*table_head(clusters), *map(table_row, results)])


def table_head(clusters, spec=None) -> list[str]:
    """What is simulated (and, replaying, what the run measured), then the column names."""
    lines = []
    for label, profiles, sizes, replay, extra in clusters:
        what = "replay of" if replay else "cluster with"
        who = (f"{len(profiles)} ranks" if spec is not None and not replay
               else f"{len(profiles)} workers")
        lines.append(f"{what} {label}: {who}, {len(sizes)} shards, "
                     f"{sum(sizes)} samples per epoch")
        if replay:
            lines.append(f"measured: epoch_s {extra['measured_epoch_s']:.3f}, "
                         f"utilization {extra['measured_utilization']:.3f}")
            if extra.get("members"):
                lines.append("membership changes replayed: " + ", ".join(
                    f"rank {r} {e} at {t:.1f} s" for t, r, e in extra["members"]))
    if spec is not None:
        rates = sorted({f"{b * 8 / 1e9:g} Gbit/s" for b in spec.link_bps})
        lines.append(f"network: {spec.nodes} nodes, ranks per node {_ranks_text(spec)}, links "
                     f"{', '.join(rates)}, shared memory {spec.shm_bps * 8 / 1e9:g} Gbit/s, "
                     f"latency {spec.latency_s * 1e6:g} us"
                     + f", MTU {spec.mtu}"
                     + (f", links bank {spec.burst_s * 1e3:g} ms (--link-burst)" if spec.burst_s else "")
                     + (", flows coupled along their links" if spec.coupled
                        else ", each link shares on its own (--link-sharing per-link)"))
    lines.append(f"{'workers':>7} {'balancer':<12} {'batch_policy':<12} {'mode':<5} {'servers':>7} "
                 + (f"{'wire':>5} " if spec is not None else "")
                 + " ".join(f"{c:>13}" for c in COLUMNS))
    return lines


def _ranks_text(spec) -> str:
    counts = sorted(set(spec.ranks_per_node))
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def table_row(r: dict) -> str:
    vals = []
    for c in COLUMNS:
        v = r[c]
        vals.append(f"{'-':>13}" if v is None else f"{v:>13d}" if isinstance(v, int)
                    else f"{v:>13.3f}")
    wire = f"{r['network']['wire']:>5} " if "network" in r else ""
    return (f"{r['workers']:>7} {r['balancer']:<12} {r['batch_policy']:<12} "
            f"{r['mode']:<5} {r['servers']:>7} {wire}" + " ".join(vals))


def _network_given(args) -> bool:
    return any(getattr(args, k) is not None for k in ("link_rate", "shm_rate", "latency",
                                                      "link_burst", "ranks_per_node", "nodes",
                                                      "wire", "link_sharing", "mtu"))


def _network(args, nodes: int, ranks_per_node: list[int] | None = None):
    from mpilb.simulate.network import LATENCY_S, SHM_RATE, NetSpec, parse_rate, parse_rates

    if nodes < 1:
        raise UsageError(f"--nodes must be at least 1 (got {nodes})")
    if ranks_per_node is None:
        counts = _list(args.ranks_per_node, "8", "ranks-per-node", kind=int)
        if min(counts) < 1:
            raise UsageError(f"--ranks-per-node must be at least 1 (got {min(counts)})")
        if len(counts) not in (1, nodes):
            raise UsageError(f"--ranks-per-node {args.ranks_per_node}: give one count, or one "
                             f"per node ({nodes})")
        ranks_per_node = counts * nodes if len(counts) == 1 else counts
    return NetSpec(nodes, ranks_per_node, parse_rates(args.link_rate or "10gbit", nodes),
                   parse_rate(args.shm_rate or SHM_RATE, "--shm-rate"),
                   args.latency if args.latency is not None else LATENCY_S,
                   (args.link_burst or 0.0) / 1e3, args.link_sharing or "auto",
                   args.mtu if args.mtu is not None else 1500)


def _net_cluster(args, spec):
    """A synthetic cluster on a network: a profile for every MPI rank (stores' unused)."""
    from mpilb.simulate import cluster as C

    if args.workers is not None:
        raise UsageError("--nodes gives the workers (every rank that is not a store): drop --workers")
    ranks = len(spec.node_of())
    seed = args.seed if args.seed is not None else 0
    read_bps = (args.read_mbps or C.READ_MBPS) * 1e6
    rates = C.parse_rates(args.rates, None if args.rates.startswith("file:") else ranks, seed)
    if len(rates) != ranks:
        raise UsageError(f"--rates {args.rates}: {len(rates)} rates for {ranks} ranks "
                         f"(--nodes x --ranks-per-node)")
    profiles = [C.constant(r, 0.0, read_bps) for r in rates]
    shards = args.shards if args.shards is not None else 4 * ranks
    samples = args.samples if args.samples is not None else 1000 * shards
    if shards < 1 or samples < shards:
        raise UsageError(f"--samples {samples} cannot fill --shards {shards} (need >= 1 each)")
    sizes = [samples // shards + (1 if i < samples % shards else 0) for i in range(shards)]
    return (f"--rates {args.rates}", profiles, sizes, False, {})


def _replay_network(args, run):
    """The run's layout (its nodes from the log's hostnames; a joiner on the node its join
    names, or on a node of its own) with the given links."""
    node_of = run.every_node or run.node_of
    if args.nodes is not None and args.nodes != max(node_of) + 1:
        raise UsageError(f"--from {args.from_log}: the run had {max(node_of) + 1} nodes; "
                         f"--nodes {args.nodes} does not match (drop it)")
    if args.ranks_per_node is not None:
        raise UsageError("--from: the ranks per node come from the run's log; drop --ranks-per-node")
    nodes = max(node_of) + 1
    return _network(args, nodes, [node_of.count(n) for n in range(nodes)]), node_of


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run `mpilb simulate`")
