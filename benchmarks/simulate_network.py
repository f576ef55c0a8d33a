"""Does `mpilb simulate`'s network model predict the cluster in a box? (issue 33)

    sudo python benchmarks/simulate_network.py [--quick] [--rounds 5] [--ps-seconds 8]
                                               [--link-rate 1gbit] [--tcp loss] [--out FILE]

On a cluster in a box (mpilb.clusterbox: 3 nodes joined by ``--link-rate`` links; needs
root; its nodes' TCP congestion control ``--tcp``, loss-based by default), with
``mpiexec -hosts n0:1,n1:2,n2:2`` (rank 0 on n0, two ranks on each of n1, n2):

  ps        ``mpilb bench ps --params 1000000``: one store on n0 serving 4 null workers on
            the other nodes (updates/s: the median of ``--rounds`` rounds, each a run of
            ``--ps-seconds`` of every case in turn, so that a slow spell of the shared
            machine falls on all of them; the range is in the label. 2 s runs read the two
            stores' case lower, by 6% at the medians of three pairs against 10 s runs: its
            two far workers make ~20 updates in 2 s, and the start weighs on them); ``--servers 2`` (a
            second store, rank 1 on n1: 3 workers); ``--servers per-node`` (stores 0, 1, 3:
            workers 2 on n1 and 4 on n2); each with ``--wire fp32`` and ``--wire bf16``
            (a case the engine lacks, read from its ``--help``, is skipped and listed)
  train     ``mpilb train`` (mlp 256,256 on 96000 x 256 samples, batch 128, 2 epochs):
            static and load, each without and with rank 3 4x slow (mean epoch seconds)

Predictions: ``mpilb simulate`` on the same layout and link rate: for ``ps``, null workers
(compute at 10^9 samples/s, batch 1); for ``train``, ``--from`` each run's own log with
``--link-rate`` (its measured compute and I/O, its layout from the log's hostnames, the
network modelled instead of its measured communication). Targets: every prediction within
20% of its measurement, and the ``ps`` store layouts of each wire format ranked as measured
(two measured within 5% of each other are a tie: either order is right; the ranking of all
six cases, across wire formats, is reported beside it without a target). Writes
``benchmarks/results/simulate_network.json`` (or ``--out``); ``python benchmarks/gendocs.py`` renders it
into docs/simulate.md. The box shares the machine's CPUs: on a busy machine the
measurements are slower than the links allow and the model (which knows only links and
the stores' CPU) reads faster.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _runs  # noqa: E402

HOSTS = "n0:1,n1:2,n2:2"
RANKS_PER_NODE = "1,2,2"
TOL = 0.20
TIE = 0.05
TRAIN = ["--model", "mlp", "--hidden", "256,256", "--batch", "128", "--no-progress"]


def shown(argv: list[str]) -> str:
    """A command line as a reader would type it (``mpilb`` for this Python's ``-m mpilb``)."""
    return shlex.join(argv).replace(f"{sys.executable} -m mpilb", "mpilb")


def engine_has(command: list[str], option: str, value: str = "") -> bool:
    """Whether ``mpilb COMMAND --help`` offers ``option`` (and mentions ``value``)."""
    res = subprocess.run([sys.executable, "-m", "mpilb", *command, "--help"],
                         capture_output=True, text=True, timeout=120)
    return option in res.stdout and value in res.stdout


def box_burst_ms(link_rate: str) -> str:
    """The cluster in a box's token bucket (tc tbf) in ms of `link_rate`, for --link-burst."""
    from mpilb.clusterbox.system import burst_bytes, rate_bytes
    return f"{burst_bytes(link_rate) / rate_bytes(link_rate) * 1e3:g}"


def simulate(args: list[str]) -> list[dict]:
    res = subprocess.run([sys.executable, "-m", "mpilb", "simulate", *args, "--json"],
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        sys.exit(f"mpilb simulate {shlex.join(args)} failed: {res.stderr.strip()}")
    return json.loads(res.stdout)


def ps_sim_args(link_rate: str, params: int, sim_opts: list[str]) -> list[str]:
    """``mpilb simulate``'s arguments for a ``bench ps`` case on the box's layout: null workers
    (compute at 10^9 samples/s, batch 1), the box's links and token buckets, and
    ``sim_opts`` (the case's stores and wire)."""
    return ["--nodes", "3", "--ranks-per-node", RANKS_PER_NODE, "--link-rate", link_rate,
            "--params", str(params), "--rates", "const:1e9", "--batch", "1", "--samples", "600",
            "--shards", "60", "--epochs", "1", "--balancer", "load", "--link-burst",
            box_burst_ms(link_rate), *sim_opts]


def ps_cases(per_node: bool, wire: bool) -> list[tuple[str, list[str], list[str], str]]:
    """(label, bench ps options, simulate options, why skipped or '')."""
    cases = []
    for w in ("fp32", "bf16"):
        wire_opts = ["--wire", w] if w != "fp32" else []
        no_wire = "" if wire or w == "fp32" else "the engine has no --wire yet"
        for label, servers in (("1 store", "1"), ("2 stores", "2"), ("a store per node", "per-node")):
            skip = no_wire or ("the engine has no per-node stores yet"
                               if servers == "per-node" and not per_node else "")
            cases.append((f"{label}, {w}", ["--servers", servers, *wire_opts],
                          ["--servers", servers, "--wire", w], skip))
    return cases


def wire_of(label: str) -> str:
    """The wire format of a ``ps`` case's label (``"2 stores, bf16"``: ``"bf16"``)."""
    return label.rsplit(", ", 1)[-1]


def ranked_alike(measured: dict, predicted: dict, across_wires: bool = False
                 ) -> list[tuple[str, str]]:
    """The pairs of cases whose predicted order is not the measured one, leaving out pairs
    measured within TIE of each other (ties: either order is right): the store layouts of
    each wire format, or every pair of cases with ``across_wires``."""
    swapped = []
    names = sorted(measured)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if not across_wires and wire_of(a) != wire_of(b):
                continue
            ma, mb = measured[a], measured[b]
            if abs(ma / mb - 1) <= TIE:
                continue
            if (ma < mb) != (predicted[a] < predicted[b]):
                swapped.append((a, b))
    return swapped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _results.add_output_args(ap, "simulate_network")
    _results.add_box_args(ap)
    _runs.add_dataset_args(ap, os.path.join(tempfile.gettempdir(), "mpilb-simnet"))
    ap.add_argument("--link-rate", default="1gbit")
    ap.add_argument("--params", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of every bench ps case in turn (the median is the figure)")
    ap.add_argument("--ps-seconds", type=float, default=8.0,
                    help="each bench ps run's --seconds")
    opts = ap.parse_args()
    from mpilb.clusterbox import ClusterBox, missing

    # the box's links are token buckets (tc tbf): modelled as such, in ms of the link's rate
    burst_ms = box_burst_ms(opts.link_rate)

    why = missing()
    if why:
        sys.exit(f"cannot build a cluster in a box here: {why}")
    if opts.quick:
        opts.samples, opts.params = 9600, 100_000
    results = _results.Results("simulate_network", "The network model against the cluster "
                               "in a box", opts)
    per_node = engine_has(["bench", "ps"], "--servers", "per-node")
    wire = engine_has(["bench", "ps"], "--wire")
    bench = _runs.Bench(opts, TRAIN)
    bench.prepare()
    seconds, rounds = ("0.5", 1) if opts.quick else (f"{opts.ps_seconds:g}", opts.rounds)
    measured, predicted, skipped = {}, {}, []
    with ClusterBox(nodes=3, link_rate=opts.link_rate, tcp=opts.tcp) as box:
        results.box(box)
        g = results.group(f"bench ps, {opts.params} parameters, -hosts {HOSTS}, "
                          f"{opts.link_rate} links: updates/s", "")
        cases = []
        for label, ps_opts, sim_opts, skip in ps_cases(per_node, wire):
            if skip:
                skipped.append(f"{label}: {skip}")
            else:
                cases.append((label, ps_opts, sim_opts))
        # rounds of every case in turn: a slow spell of the shared machine falls on all
        # of them, not on the one that ran then
        rates: dict = {label: [] for label, _, _ in cases}
        argvs: dict = {}
        for rnd in range(rounds):
            for label, ps_opts, _ in cases:
                argv = argvs[label] = ["-hosts", HOSTS, sys.executable, "-m", "mpilb", "bench",
                                       "ps", "--params", str(opts.params), "--seconds", seconds,
                                       "--repeats", "1", "--json", *ps_opts]
                res = box.mpiexec(argv, timeout=900)
                if res.returncode != 0:
                    sys.exit(f"bench ps {label} failed: {res.stderr[-2000:]}")
                got = json.loads(res.stdout.strip().splitlines()[-1])
                rates[label].append(got["runs"][0]["updates_per_s"])
                print(f"  round {rnd + 1}/{rounds} ps {label}: {rates[label][-1]:.1f} updates/s",
                      flush=True)
        for label, _, sim_opts in cases:
            rate = statistics.median(rates[label])
            sim_args = ps_sim_args(opts.link_rate, opts.params, sim_opts)
            pred = simulate(sim_args)[0]["updates_per_s"]
            measured[label], predicted[label] = rate, pred
            lo, hi = min(rates[label]), max(rates[label])
            print(f"  ps {label}: measured {rate:.1f} ({lo:.1f}-{hi:.1f}) updates/s, "
                  f"predicted {pred:.1f}", flush=True)
            results.figure(g, f"ps.{label}", f"{label}: measured {rate:.1f} ({lo:.1f}-{hi:.1f} "
                           f"over {len(rates[label])} rounds), predicted {pred:.1f} updates/s "
                           f"({pred / rate - 1:+.0%})",
                           [abs(pred / rate - 1)], digits=2, target=f"<= {TOL:g}",
                           command=f"mpiexec {shown(argvs[label])}; mpilb simulate "
                                   f"{shlex.join(sim_args)}")
        order_m = sorted(measured, key=measured.get)
        order_p = sorted(predicted, key=predicted.get)
        swapped = ranked_alike(measured, predicted)
        crossed = ranked_alike(measured, predicted, across_wires=True)

        def verdict(pairs, same):
            return ("the same" if same else
                    f"swapped: {'; '.join(f'{a} / {b}' for a, b in pairs)}" if pairs else
                    f"the same but for pairs measured within {TIE:.0%}: ties")
        same_per_wire = all([c for c in order_m if wire_of(c) == w] ==
                            [c for c in order_p if wire_of(c) == w] for w in map(wire_of, order_m))
        g["note"] = (f"Each figure: |predicted / measured - 1| (target: within {TOL:.0%}). Cases "
                     f"by updates/s, measured: {' < '.join(order_m)}; predicted: "
                     f"{' < '.join(order_p)}. The store layouts of each wire format: "
                     f"{verdict(swapped, same_per_wire)}; all six cases: "
                     f"{verdict(crossed, order_m == order_p)}."
                     + (f" Skipped: {'; '.join(skipped)}." if skipped else ""))
        results.figure(g, "ps.ranking", f"store layouts ranked as measured, in each wire "
                       f"format (pairs measured within {TIE:.0%} are ties; 1 = yes)",
                       [0.0 if swapped else 1.0], digits=0, target=">= 1")
        results.figure(g, "ps.ranking_all", "all six cases ranked as measured, across wire "
                       "formats too (no target; 1 = yes)", [0.0 if crossed else 1.0], digits=0)
        g = results.group(f"train, -hosts {HOSTS}, {opts.link_rate} links: mean epoch seconds, "
                          f"|predicted / measured - 1|", "")
        for label, extra in [("static", ["--balancer", "static"]),
                             ("load", ["--balancer", "load"]),
                             ("static, rank 3 4x slow", ["--balancer", "static", "--inject", "3:compute=4"]),
                             ("load, rank 3 4x slow", ["--balancer", "load", "--inject", "3:compute=4"])]:
            log = os.path.join(bench.logs, f"box-{label.split(',')[0]}-{len(extra)}.h5")
            for old in (log, log[:-3] + ".ckpt.h5"):   # a rerun's: train refuses to overwrite
                if os.path.exists(old):
                    os.remove(old)
            argv = ["-hosts", HOSTS, sys.executable, "-m", "mpilb", "train", "--data", bench.data,
                    *TRAIN, "--epochs", "2", *extra, "--log", log]
            res = box.mpiexec(argv, timeout=opts.run_timeout * 3)
            if res.returncode != 0:
                sys.exit(f"train {label} failed: {res.stderr[-2000:]}")
            from mpilb.simulate.replay import load_run

            run = load_run(log)
            meas = statistics.mean(run.measured_epoch_s)
            sim_args = ["--from", log, "--link-rate", opts.link_rate, "--link-burst", burst_ms]
            pred = simulate(sim_args)[0]["epoch_s"]
            print(f"  train {label}: measured {meas:.2f} s, predicted {pred:.2f} s", flush=True)
            results.figure(g, f"train.{label}", f"{label}: measured {meas:.2f} s, predicted "
                           f"{pred:.2f} s ({pred / meas - 1:+.0%})", [abs(pred / meas - 1)],
                           digits=2, target=f"<= {TOL:g}",
                           command=f"mpiexec {shown(argv)}; mpilb simulate {shlex.join(sim_args)}")
    results.write(_results.out_path(opts, "simulate_network"))
    return 0 if results.all_met() else 1


if __name__ == "__main__":
    sys.exit(main())
