"""mpilb across nodes, on the cluster in a box (3 nodes, links shaped to 1 Gbit/s).

    python benchmarks/cluster.py [--repeats 3] [--link-rate 1gbit]

Needs root (the box: network namespaces, tc). Every case runs in one box, its repeats
alternating, and its ratios are taken within a repeat:

(a) `bench ps --params 1000000`, one store (rank 0 on n0) serving 4 null workers on the
    two other nodes (`-hosts n0:1,n1:2,n2:2`): updates/s against the wire bound (rank 0's
    link carries every push in and every reply out: rate ÷ 4 MB per update).
(b) the same with 2 ranks per node and `--servers per-node` (a store beside each node's
    worker): aggregate updates/s against its wire bound (the busiest link's bytes per
    update, each direction, from the layout), and against (a); also each store taking one
    push at a time in rank 0's order (MPILB_STORE_FIFO=1, as before server/store_streams.py).
(c) `--servers 2` under the block layout `-hosts n0:2,n1:2,n2:2`: where its stores are.
(d) training, 4 workers on 2 nodes (`-hosts n0:1,n1:2,n2:2`), the torch MLP 256-256-256-10
    on 784 features, batch 512: samples/s of mpilb async and sync against PyTorch DDP (gloo)
    on the same module and links (DDP's processes on n1 and n2), and the share of a fast
    worker's time spent communicating; async with the defaults (fp32; the momentum recipe
    does not compute ahead) and as docs/cluster.md advises where the exchange is bound by
    its bytes (`--wire bf16 --pipeline 1`), which the targets are held to. Every rate is
    taken as DDP's is: over the epochs after the first (mpilb's epochs/ rows), the whole
    run's beside it.
(e) slow workers (every worker sleeps 50 ms a step): rank 0's CPU seconds ÷ wall seconds
    with the workers on other nodes, and on rank 0's node.
(f) one slow link: node n2 at 100 Mbit/s (a second box), the mlp 256,256 on 784 features,
    batch 512, 8 epochs, 4 workers on n1, n2: the run's training time against the same run
    without n2's workers (2 workers on n1).
(g) `--wire bf16` against fp32 where the network bounds the rate: `bench ps --params
    1000000`, one store, 4 null workers on the two other nodes (`-hosts n0:1,n1:2,n2:2`),
    updates/s of each wire in the same repeat; and the final test accuracy on the same
    layout of the digits mlp (30 epochs) and of the torch MLP (examples/torch_mlp.py, 128-128)
    on the synthetic 30000x784 set of (d) (5 epochs): in each repeat, for each of
    ACCURACY_SEEDS, an fp32 run, a bf16 run and a second fp32 run. Asynchronous runs of one
    seed differ whatever the wire, so one pair of runs cannot resolve 0.5 points: the figure
    is |the mean over the seeds of bf16 − fp32|, beside the same for the second fp32 run (the
    noise floor). The torch model runs on the synthetic set, whose 6,000 test samples are
    0.017 points each: on digits' 360 (0.28 points each) its two fp32 runs of a seed
    differed by up to 1.95 points, a floor of 0.46 over three seeds, which 0.5 cannot be
    read against.
Writes benchmarks/results/cluster.json; exit 0 when every target is met.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _runs  # noqa: E402

NAME = "cluster"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PY = sys.executable
PARAMS = 1_000_000
ACCURACY_SEEDS = (1, 2, 3)   # (g): paired runs per wire and repeat
TORCH_MODEL = ["--model", os.path.join(REPO, "examples", "torch_mlp.py") + ":MLP",
               "--model-arg", "hidden=256", "--model-arg", "layers=3"]


def wire_bound(hosts: str, stores: list[int], rate_bytes: float, params: int) -> float:
    """Aggregate updates/s that the busiest link allows when every worker pushes at the same
    pace: each push sends every store its slice and each reply brings it back, and a slice
    crosses the worker's link and its store's unless the two share a node."""
    nodes = []
    for k, part in enumerate(hosts.split(",")):
        nodes += [k] * int(part.split(":")[1])
    workers = [r for r in range(len(nodes)) if r not in stores]
    per_store = 4.0 * params / len(stores)
    out = np.zeros(max(nodes) + 1)   # bytes per update leaving each node (in: the same)
    for w in workers:
        for s in stores:
            if nodes[w] != nodes[s]:
                out[nodes[w]] += per_store / len(workers)   # the push's slice
                out[nodes[s]] += per_store / len(workers)   # the reply's slice
    return rate_bytes / out.max()


def bench_ps(box, hosts: str, *extra, params: int = PARAMS, seconds: float = 3,
             spin: bool = False, fifo: bool = False) -> dict:
    """One `mpilb bench ps --json --repeats 1` run on the box's `hosts`; its JSON. `spin`:
    every rank polls before it sleeps (MPILB_SPIN=1), as ranks with a CPU each do; `fifo`:
    every store steps one push at a time (MPILB_STORE_FIFO=1, server/store_streams.py)."""
    env = ["env", *(["MPILB_SPIN=1"] if spin else []), *(["MPILB_STORE_FIFO=1"] if fifo else [])]
    env = env if len(env) > 1 else []
    res = box.mpiexec(["-hosts", hosts, *env, PY, "-m", "mpilb", "bench", "ps", "--json", "--repeats",
                       "1", "--params", str(params), "--seconds", f"{seconds:g}", *extra],
                      timeout=300, cwd=REPO)
    if res.returncode != 0:
        sys.exit(f"bench ps {hosts} {extra}: exit {res.returncode}\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def train(box, d: str, hosts: str, log: str, *args) -> dict:
    from mpilb.runfiles.summary import summarize_log
    from mpilb.runfiles.runlog import read_columns

    res = box.mpiexec(["-hosts", hosts, PY, "-m", "mpilb", "train", "--no-progress", "--log", log,
                       "--overwrite", *args], timeout=600, cwd=d)
    if res.returncode != 0:
        sys.exit(f"train {hosts} {args}: exit {res.returncode}\n{res.stderr[-2000:]}")
    attrs, cols = read_columns(log)
    return {"summary": summarize_log(log), "attrs": attrs, "cols": cols}


def steady_rate(run: dict) -> float:
    """Samples/s over the epochs after the first, as _ddp.py times DDP's (all of them in a
    run of one epoch)."""
    ep = run["cols"]["epochs"]
    first = 1 if len(ep["t_end"]) > 1 else 0
    span = ep["t_end"][first:] - ep["t_start"][first:]
    return float(ep["samples"][first:].sum() / span.sum())


def comm_share(run: dict, ranks) -> float:
    """The least communicating of ``ranks``: comm ÷ (compute + I/O + comm + idle)."""
    wk = run["cols"]["workers"]
    shares = []
    for r in ranks:
        m = wk["worker"] == r
        parts = [float(wk[c][m].sum()) for c in ("compute_s", "io_s", "comm_s", "idle_s")]
        shares.append(parts[2] / sum(parts) if sum(parts) else float("nan"))
    return min(shares)


def ddp(box, data: str, epochs: int) -> dict:
    res = box.mpiexec(["-hosts", "n1:2,n2:2", "-genv", "MASTER_ADDR", "n1", "-genv", "MASTER_PORT",
                       "29511", "-genv", "GLOO_SOCKET_IFNAME", "eth0", PY,
                       os.path.join(HERE, "_ddp.py"), data, str(epochs), "512", "256", "3"],
                      timeout=600, cwd=REPO)
    if res.returncode != 0:
        sys.exit(f"DDP: exit {res.returncode}\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def wire_case(box, work: str, digits: str, synth: str, rows: dict, has_torch: bool) -> None:
    """(g): bf16 against fp32 in one repeat, the rate where the network bounds it and the
    accuracy each reaches."""
    fp32 = bench_ps(box, "n0:1,n1:2,n2:2")
    bf16 = bench_ps(box, "n0:1,n1:2,n2:2", "--wire", "bf16")
    rows["g_fp32"].append(fp32["updates_per_s"])
    rows["g_bf16"].append(bf16["updates_per_s"])
    rows["g_ratio"].append(bf16["updates_per_s"] / fp32["updates_per_s"])
    models = [("g_mlp", ["--data", digits, "--model", "mlp", "--epochs", "30"])]
    if has_torch:
        models.append(("g_torch", ["--data", synth, "--model", os.path.join(REPO, "examples",
                                   "torch_mlp.py") + ":MLP", "--epochs", "5"]))
    for key, model in models:
        gaps = {"bf16": [], "fp32": []}   # paired with the first fp32 run of the same seed
        for seed in ACCURACY_SEEDS:
            acc = {}
            for run in ("fp32", "bf16", "fp32 again"):
                wire = run.split()[0]
                r = train(box, work, "n0:1,n1:2,n2:2", os.path.join(work, f"{key}-{wire}.h5"),
                          *model, "--seed", str(seed), "--wire", wire)
                acc[run] = 100 * r["summary"]["final_test_accuracy"]
            gaps["bf16"].append(acc["bf16"] - acc["fp32"])
            gaps["fp32"].append(acc["fp32 again"] - acc["fp32"])
        rows[key].append(abs(float(np.mean(gaps["bf16"]))))
        rows[f"{key}_noise"].append(abs(float(np.mean(gaps["fp32"]))))
    print(f"  (g) bf16 {rows['g_bf16'][-1]:.1f} updates/s, fp32 {rows['g_fp32'][-1]:.1f}: "
          f"{rows['g_ratio'][-1]:.2f}x; accuracy gap {rows['g_mlp'][-1]:.2f} points (mlp; "
          f"fp32 against fp32 {rows['g_mlp_noise'][-1]:.2f})", flush=True)


def write(res, opts) -> str:
    """Write the result file. A run of some cases (--only) into the default file keeps the
    groups of the cases it did not run from the file there, each saying when, at which
    commit and by what command it was measured, so that a partial rerun never drops the
    other cases' figures from the docs."""
    path = _results.out_path(opts, NAME)
    ran = set(opts.only)
    if not opts.out and not opts.quick and ran != set(ALL_CASES) and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        m = old.get("machine", {})
        when = (f"{m.get('date', '?')} at commit `{m.get('commit', '?')}` by `python "
                f"{' '.join(old.get('argv', []))}`, the box's nodes on "
                + (f"`{m['box_tcp']}`" if m.get("box_tcp") else
                   "the machine's default TCP congestion control"))
        for g in old.get("groups", []):
            if not set(_cases(g["title"])) & ran:
                g = dict(g)
                if not g.get("kept"):
                    g["kept"] = True
                    g["note"] = (g.get("note", "") + f" Measured {when}, before this file's run "
                                 f"(which ran `--only {opts.only}`).").strip()
                res.groups.append(g)
    order = {c: i for i, c in enumerate(ALL_CASES)}
    res.groups.sort(key=lambda g: order.get(_cases(g["title"])[:1], len(order)))
    return res.write(path)


def _cases(title: str) -> str:
    """The case letters a group's title starts with: "(a)-(c) ..." -> "abc", "(f) ..." -> "f"."""
    head = title.split(" ", 1)[0]
    letters = [c for c in head if c.isalpha()]
    if len(letters) == 2 and "-" in head:
        return "".join(chr(c) for c in range(ord(letters[0]), ord(letters[1]) + 1))
    return "".join(letters)


ALL_CASES = "abcdefg"
D_RUNS = (("async", ()), ("bf16", ("--wire", "bf16")), ("tuned", ("--wire", "bf16", "--pipeline", "1")),
          ("sync", ("--mode", "sync")))


def main(argv=None) -> int:
    from mpilb.clusterbox import ClusterBox, missing
    from mpilb.clusterbox.system import rate_bytes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--link-rate", default="1gbit")
    ap.add_argument("--epochs", type=int, default=6, help="of the training case")
    ap.add_argument("--only", default=ALL_CASES, help="the cases to run, e.g. f")
    _results.add_output_args(ap, NAME)
    _results.add_box_args(ap)
    opts = ap.parse_args(argv)
    why = missing()
    if why:
        sys.exit(f"no cluster box here: {why}")
    if opts.quick:
        opts.repeats, opts.epochs = 1, 2
    has_torch = subprocess.run([PY, "-c", "import torch"], capture_output=True).returncode == 0
    work = tempfile.mkdtemp(prefix="mpilb-cluster-")
    data = os.path.join(work, "synth784")
    subprocess.run([PY, "-m", "mpilb", "prepare", "synthetic", data, "--samples", "30000",
                    "--features", "784", "--classes", "10", "--shards", "24", "--seed", "7"],
                   check=True, capture_output=True)
    digits = _runs.digits_dataset(os.path.join(work, "digits"))
    bps = rate_bytes(opts.link_rate)
    res = _results.Results(NAME, f"mpilb on 3 nodes of the cluster in a box, links {opts.link_rate}", opts)
    rows = {k: [] for k in ("a", "a_bound", "b", "b_bound", "b_over_a", "c_nodes", "c", "c_one",
                            "a_chunks", "b_chunks", "b_whole_bound", "b_spin", "b_spin_whole",
                            "b_spin_chunks", "b_fifo_bound", "b_over_fifo",
                            "ddp", *(f"{k}{x}" for k, _ in D_RUNS for x in ("", "_run", "_ddp")),
                            *(f"{k}_{x}" for k in ("async", "bf16", "tuned") for x in ("comm", "staleness")),
                            "cpu_remote", "cpu_local", "slow", "without", "slow_ratio",
                            "g_fp32", "g_bf16", "g_ratio", "g_mlp", "g_torch", "g_mlp_noise",
                            "g_torch_noise")}
    slow_rates = [opts.link_rate, opts.link_rate, "100mbit"]
    with ClusterBox(nodes=3, link_rate=opts.link_rate, tcp=opts.tcp) as box, \
            ClusterBox(nodes=3, link_rate=slow_rates, tcp=opts.tcp) as slow_box:
        res.box(box)
        for rep in range(opts.repeats):
            print(f"repeat {rep + 1} of {opts.repeats}", flush=True)
            if "f" in opts.only:
                args = ["--data", data, "--hidden", "256,256", "--batch", "512", "--epochs", "8"]
                s = train(slow_box, work, "n0:1,n1:2,n2:2", os.path.join(work, "slow.h5"), *args)
                w = train(box, work, "n0:1,n1:2", os.path.join(work, "without.h5"), *args)
                rows["slow"].append(s["summary"]["train_s"])
                rows["without"].append(w["summary"]["train_s"])
                rows["slow_ratio"].append(rows["slow"][-1] / rows["without"][-1])
                print(f"  (f) n2 at 100 Mbit/s: {rows['slow'][-1]:.2f} s; without n2: "
                      f"{rows['without'][-1]:.2f} s ({rows['slow_ratio'][-1]:.2f}x)", flush=True)
            if "g" in opts.only:
                wire_case(box, work, digits, data, rows, has_torch)
            if set("abc") & set(opts.only):
                a = bench_ps(box, "n0:1,n1:2,n2:2")
                b = bench_ps(box, "n0:2,n1:2,n2:2", "--servers", "per-node")
                one = bench_ps(box, "n0:2,n1:2,n2:2")
                c = bench_ps(box, "n0:2,n1:2,n2:2", "--servers", "2")
                # the same, each slice in one message (--chunk-kb 0), and (b) with every rank
                # polling (MPILB_SPIN=1: a CPU each, as on a cluster's nodes) both ways
                whole = "--chunk-kb", "0"
                a0 = bench_ps(box, "n0:1,n1:2,n2:2", *whole)
                b0 = bench_ps(box, "n0:2,n1:2,n2:2", "--servers", "per-node", *whole)
                bs = bench_ps(box, "n0:2,n1:2,n2:2", "--servers", "per-node", spin=True)
                bs0 = bench_ps(box, "n0:2,n1:2,n2:2", "--servers", "per-node", *whole, spin=True)
                bf = bench_ps(box, "n0:2,n1:2,n2:2", "--servers", "per-node", fifo=True)
                for key, num, den in (("a_chunks", a, a0), ("b_chunks", b, b0),
                                      ("b_spin_chunks", bs, bs0)):
                    rows[key].append(num["updates_per_s"] / den["updates_per_s"])
                rows["b_whole_bound"].append(b0["updates_per_s"] / wire_bound(
                    "n0:2,n1:2,n2:2", list(b0.get("stores", [0, 2, 4])), bps, PARAMS))
                rows["b_spin"].append(bs["updates_per_s"])
                rows["b_spin_whole"].append(bs0["updates_per_s"])
                ab = wire_bound("n0:1,n1:2,n2:2", [0], bps, PARAMS)
                bb = wire_bound("n0:2,n1:2,n2:2", list(b.get("stores", [0, 2, 4])), bps, PARAMS)
                rows["a"].append(a["updates_per_s"]); rows["a_bound"].append(a["updates_per_s"] / ab)
                rows["b"].append(b["updates_per_s"]); rows["b_bound"].append(b["updates_per_s"] / bb)
                rows["b_over_a"].append(b["updates_per_s"] / a["updates_per_s"])
                rows["b_fifo_bound"].append(bf["updates_per_s"] / bb)
                rows["b_over_fifo"].append(b["updates_per_s"] / bf["updates_per_s"])
                nodes = c.get("nodes") or []
                rows["c_nodes"].append(len({nodes[s] for s in c.get("stores", [])}) if nodes else 1)
                rows["c"].append(c["updates_per_s"]); rows["c_one"].append(c["updates_per_s"] / one["updates_per_s"])
                print(f"  (a) {a['updates_per_s']:.1f} updates/s = {rows['a_bound'][-1]:.2f} of {ab:.1f}; "
                      f"(b) {b['updates_per_s']:.1f} = {rows['b_bound'][-1]:.2f} of {bb:.1f}, "
                      f"{rows['b_over_a'][-1]:.2f}x (a); (c) stores {c.get('stores')} on "
                      f"{rows['c_nodes'][-1]} nodes, {rows['c_one'][-1]:.2f}x one store; chunks ÷ "
                      f"one message: (a) {rows['a_chunks'][-1]:.2f}x, (b) {rows['b_chunks'][-1]:.2f}x, "
                      f"(b) polling {rows['b_spin_chunks'][-1]:.2f}x; (b) one push at a time per "
                      f"store {rows['b_fifo_bound'][-1]:.2f} of its bound", flush=True)
            if has_torch and "d" in opts.only:
                args = ["--data", data, *TORCH_MODEL, "--batch", "512", "--epochs", str(opts.epochs),
                        "--lr", "0.05", "--optimizer", "momentum"]
                runs = {key: train(box, work, "n0:1,n1:2,n2:2", os.path.join(work, f"{key}.h5"),
                                   *args, *extra) for key, extra in D_RUNS}
                dd = ddp(box, data, opts.epochs)
                rows["ddp"].append(dd["samples_per_s"])
                for key, r in runs.items():
                    rows[key].append(steady_rate(r))
                    rows[f"{key}_run"].append(r["summary"]["samples_per_s"])
                    rows[f"{key}_ddp"].append(rows[key][-1] / dd["samples_per_s"])
                for key in ("async", "bf16", "tuned"):
                    rows[f"{key}_comm"].append(comm_share(runs[key], range(1, 5)))
                    rows[f"{key}_staleness"].append(runs[key]["summary"]["staleness"]["mean"])
                print(f"  (d) DDP {dd['samples_per_s']:.0f} samples/s; async {rows['async'][-1]:.0f} "
                      f"(comm {rows['async_comm'][-1]:.2f}), --wire bf16 {rows['bf16'][-1]:.0f} "
                      f"(comm {rows['bf16_comm'][-1]:.2f}), --wire bf16 --pipeline 1 "
                      f"{rows['tuned'][-1]:.0f} (comm {rows['tuned_comm'][-1]:.2f}), sync "
                      f"{rows['sync'][-1]:.0f}", flush=True)
            if "e" in opts.only:
                slow = ["--data", digits, "--model", "softmax", "--batch", "32", "--epochs", "3",
                        "--inject", "*:delay=0.05"]
                for key, hosts in (("cpu_remote", "n0:1,n1:2,n2:1"), ("cpu_local", "n0:4")):
                    r = train(box, work, hosts, os.path.join(work, f"{key}.h5"), *slow)
                    at = r["attrs"]
                    rows[key].append(float(at["server_cpu_s"]) / float(at["wall_s"]))
                print(f"  (e) rank 0 CPU/wall: workers remote {rows['cpu_remote'][-1]:.3f}, on its node "
                      f"{rows['cpu_local'][-1]:.3f}", flush=True)
    if rows["g_ratio"]:
        g = res.group("(g) `--wire bf16` against fp32, one store, 4 workers on n1, n2",
                      "mpiexec -hosts n0:1,n1:2,n2:2 python -m mpilb bench ps --params 1000000 --seconds 3 --wire bf16")
        res.figure(g, "g_fp32", "fp32: updates/s", rows["g_fp32"], unit="updates/s", digits=1)
        res.figure(g, "g_bf16", "`--wire bf16`: updates/s", rows["g_bf16"], unit="updates/s", digits=1)
        res.figure(g, "g_ratio", "bf16 ÷ fp32 (same repeat)", rows["g_ratio"], unit="x", target=">= 1.8")
        seeds = len(ACCURACY_SEEDS)
        for key, model in (("g_mlp", "digits mlp, 30 epochs"),
                           ("g_torch", "torch MLP 128-128, synthetic 30000x784 (6,000 test samples), 5 epochs")):
            if not rows[key]:
                continue
            res.figure(g, key, f"{model}: |bf16 − fp32| final test accuracy, mean of "
                       f"{seeds} paired seeds, points", rows[key], unit="points", target="<= 0.5")
            res.figure(g, f"{key}_noise", f"{model}: |fp32 − fp32| (a second fp32 run of each "
                       f"seed: the noise floor), points", rows[f"{key}_noise"], unit="points")
    if rows["slow"]:
        g = res.group("(f) one node's link at 100 Mbit/s: mlp 256,256, 784 features, batch 512, 8 epochs",
                      "mpiexec -hosts n0:1,n1:2,n2:2 mpilb train --hidden 256,256 --batch 512 --epochs 8")
        res.figure(g, "slow", "train_s, 4 workers, n2's link at 100 Mbit/s", rows["slow"], unit="s")
        res.figure(g, "without", "train_s, the 2 workers of n1 alone (`-hosts n0:1,n1:2`)",
                   rows["without"], unit="s")
        res.figure(g, "slow_ratio", "with the slow node ÷ without it", rows["slow_ratio"], unit="x",
                   target="<= 1.1")
    if rows["a"]:
        _abc_figures(res, rows)
    if rows["async"]:
        g = res.group("(d) training: torch MLP 256-256-256-10, 784 features, batch 512, 4 workers on n1, n2",
                      f"mpiexec -hosts n0:1,n1:2,n2:2 mpilb train --model examples/torch_mlp.py:MLP --model-arg hidden=256 --model-arg layers=3 --batch 512 --optimizer momentum --lr 0.05 --epochs {opts.epochs}",
                      note="mpilb's runs: async with the defaults (fp32; the momentum recipe does "
                           "not compute ahead), with `--wire bf16`, and with `--wire bf16 --pipeline "
                           "1` (docs/cluster.md's advice where bytes bound the exchange; the "
                           "targets are held to it), and `--mode sync`. Samples/s over the epochs "
                           "after the first, as DDP's are timed; the whole run's (startup and the "
                           "first epoch included) beside them.")
        res.figure(g, "ddp", "PyTorch DDP (gloo), same module, 4 processes on n1, n2: samples/s", rows["ddp"],
                   unit="samples/s", digits=0)
        for key, what, target in (
                ("tuned", "async `--wire bf16 --pipeline 1`", True),
                ("bf16", "async `--wire bf16`", False),
                ("async", "async, the defaults (fp32)", False),
                ("sync", "`--mode sync`", False)):
            res.figure(g, key, f"{what}: samples/s", rows[key], unit="samples/s", digits=0)
            res.figure(g, f"{key}_run", f"{what}: samples/s over the whole run", rows[f"{key}_run"],
                       unit="samples/s", digits=0)
            res.figure(g, f"{key}_ddp", f"{what} ÷ DDP", rows[f"{key}_ddp"], unit="x",
                       target=">= 1.0" if target else None)
            if key != "sync":
                res.figure(g, f"{key}_comm", f"{what}: a fast worker's share of time communicating",
                           rows[f"{key}_comm"], unit="x", target="<= 0.25" if target else None)
                res.figure(g, f"{key}_staleness", f"{what}: mean staleness", rows[f"{key}_staleness"],
                           unit="versions", digits=1)
    if rows["cpu_remote"]:
        g = res.group("(e) slow workers: `--model softmax --batch 32 --epochs 3 --inject '*:delay=0.05'` on digits", "")
        res.figure(g, "cpu_remote", "rank 0 CPU ÷ wall, workers on n1, n2", rows["cpu_remote"], unit="x",
                   digits=3, target="<= 0.05")
        res.figure(g, "cpu_local", "rank 0 CPU ÷ wall, workers on rank 0's node", rows["cpu_local"], unit="x",
                   digits=3)
    _runs.print_targets(res.checks())
    write(res, opts)
    return 0 if res.all_met() else 1


def _abc_figures(res, rows: dict) -> None:
    g = res.group("(a)-(c) `mpilb bench ps --params 1000000`, null workers",
                  "mpilb box run --nodes 3 --link-rate 1gbit -- mpiexec -hosts HOSTS python -m mpilb bench ps --params 1000000 --seconds 3")
    res.figure(g, "a", "(a) one store, 4 remote workers: updates/s", rows["a"], unit="updates/s", digits=1)
    res.figure(g, "a_bound", "(a) ÷ its wire bound", rows["a_bound"], unit="x")
    res.figure(g, "b", "(b) `--servers per-node`, 2 ranks per node: updates/s", rows["b"], unit="updates/s", digits=1)
    res.figure(g, "b_bound", "(b) ÷ its wire bound", rows["b_bound"], unit="x", target=">= 0.8")
    res.figure(g, "b_over_a", "(b) ÷ (a)", rows["b_over_a"], unit="x", target=">= 1.8")
    res.figure(g, "c_nodes", "(c) `--servers 2`, block layout: nodes its stores are on", rows["c_nodes"],
               digits=0, target=">= 2", decide="all")
    res.figure(g, "c_one", "(c) ÷ one store, same layout", rows["c_one"], unit="x")
    if rows["a_chunks"]:   # (result files from before --chunk-kb have none)
        res.figure(g, "a_chunks", "(a) in chunks (the default) ÷ (a) `--chunk-kb 0` (one message), "
                   "same repeat", rows["a_chunks"], unit="x")
        res.figure(g, "b_chunks", "(b) in chunks ÷ (b) `--chunk-kb 0`, same repeat",
                   rows["b_chunks"], unit="x")
        res.figure(g, "b_whole_bound", "(b) `--chunk-kb 0` ÷ its wire bound", rows["b_whole_bound"],
                   unit="x")
        res.figure(g, "b_spin", "(b) with every rank polling first (`MPILB_SPIN=1`): updates/s",
                   rows["b_spin"], unit="updates/s", digits=1)
        res.figure(g, "b_spin_whole", "(b) polling, `--chunk-kb 0`: updates/s", rows["b_spin_whole"],
                   unit="updates/s", digits=1)
        res.figure(g, "b_spin_chunks", "(b) polling: in chunks ÷ one message, same repeat",
                   rows["b_spin_chunks"], unit="x")
    if rows.get("b_fifo_bound"):   # (result files from before store_streams.py have none)
        res.figure(g, "b_fifo_bound", "(b) with every store stepping one push at a time "
                   "(`MPILB_STORE_FIFO=1`) ÷ its wire bound", rows["b_fifo_bound"], unit="x")
        res.figure(g, "b_over_fifo", "(b) ÷ (b) one push at a time, same repeat",
                   rows["b_over_fifo"], unit="x")


if __name__ == "__main__":
    sys.exit(main())
