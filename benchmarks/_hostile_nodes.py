"""Issue 32's cases that need nodes (2, 5, 7, 8, 12: on the cluster in a box) and its case 6
(a worker killed by SIGKILL), as cases of benchmarks/hostile.py.

The box needs root, `ip` and `tc` (`mpilb.clusterbox.missing()` says what is absent): without
it, these cases print "skipped" and count as passed, so that the rest of the script still
judges a user's machine. Each box case builds its own 3-node box and tears it down.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import time

NODE_HOSTS = "n0:1,n1:2,n2:2"          # rank 0 on n0; workers 1, 2 on n1 and 3, 4 on n2
RANK_HOSTS = ["n0", "n1", "n1", "n2", "n2"]
PAIRS = 5                              # case 7: runs with and without the slow node (3 gave 1.04-1.15)


def add_cases(h) -> None:
    """Register the cases on the hostile module `h` (its `case`, `Case`, `mpilb`, ...)."""
    from mpilb.clusterbox import ClusterBox, missing
    from mpilb.clusterbox.launcher import mpi_env
    from mpilb.mpi.watchdog import limit
    from _runs import alive

    case, Case, train, one_line, exact, summary = h.case, h.Case, h.train, h.one_line, h.exact, h.summary
    why = missing()

    def skipped():
        return {"code": "-", "s": 0.0, "lines": [], "left": 0}, True, f"skipped: no cluster box ({why})"

    def small(d):
        """A small dataset of 8 shards (made once per folder)."""
        from mpilb.data.dataset import prepare_synthetic

        root = d.parent / "nodes-synth"
        if not root.exists():
            prepare_synthetic(root, samples=6000, features=16, classes=4, shards=8, seed=0)
        return root

    def stage(box, ref) -> None:
        for k in range(box.nodes):
            dest = box.dir / f"node{k}" / "local" / ref.name
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(ref, dest)

    def start(box, d, *args, hosts=NODE_HOSTS, flags=("-disable-auto-cleanup",)):
        cmd = box.command(0, box.mpiexec_cmd([*flags, "-hosts", hosts, h.PY, "-m", "mpilb",
                                              *map(str, args)]), cwd=str(d))
        return Case(cmd, d, env=mpi_env(box))

    def local_train(box, ref, d, *extra):
        return train(os.path.join(box.local_dir, ref.name), d, "--store", "local", *extra)

    def ranks_of(c, ranks, timeout=60):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout and c.proc.poll() is None:
            found = [p for p, e in c.processes().items()
                     if e.get(b"PMI_RANK", b"-1").isdigit() and int(e[b"PMI_RANK"]) in ranks]
            if len(found) == len(ranks):
                return found
            time.sleep(0.2)
        raise RuntimeError(f"ranks {sorted(ranks)} did not start")

    def supervised_rank(c, rank):
        """The pid of rank `rank` itself: the child of its --survive-signals supervisor,
        which has the same environment."""
        mine = {p for p, e in c.processes().items() if e.get(b"PMI_RANK") == str(rank).encode()}
        for pid in mine:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                if int(fh.read().rsplit(b")", 1)[1].split()[1]) in mine:
                    return pid
        raise RuntimeError(f"rank {rank} and its supervisor not found")

    @case("kill -9 of a worker, -disable-auto-cleanup --survive-signals")
    def _(d, data):
        c = Case(h.mpilb(4, *train(data, d, "--epochs", 60, "--worker-timeout", 3,
                                   "--survive-signals", "--inject", "*:delay=0.001"),
                         flags=("-disable-auto-cleanup",)), d)
        c.wait_log_rows(d / "run.h5")
        os.kill(supervised_rank(c, 2), signal.SIGKILL)
        r = c.end(180)
        text, ok = exact(d / "run.h5", data)
        s = summary(d / "run.h5")
        return r, ok and r["code"] == 3 and s["lost_workers"] == [2], text

    @case("a node's copy of a shard differs (box, --store local)")
    def _(d, data):
        if why:
            return skipped()
        from mpilb.data.dataset import prepare_synthetic
        from mpilb.data.shards import placement

        ref = small(d)
        other = prepare_synthetic(d / "other", samples=6000, features=16, classes=4, shards=8,
                                  seed=1)
        p = placement(8, [1, 2, 3, 4], 2, RANK_HOSTS)
        name = other.shards[next(s for s, c in p.items() if 3 in c or 4 in c)].file
        with ClusterBox(nodes=3) as box:
            stage(box, ref)
            shutil.copy(d / "other" / name, box.dir / "node2" / "local" / ref.name / name)
            r = start(box, d, *local_train(box, ref, d, "--replicas", 2, "--epochs", 1),
                      flags=()).end(180)
        named = bool(r["lines"]) and r["lines"][0].startswith("mpilb: error: rank 3 on node n2:")
        return r, one_line(r, 2) and named and not (d / "run.h5").exists(), None

    @case("--replicas 2, a whole node stopped (box)")
    def _(d, data):
        if why:
            return skipped()
        ref = small(d)
        with ClusterBox(nodes=3) as box:
            stage(box, ref)
            c = start(box, d, *local_train(box, ref, d, "--replicas", 2, "--epochs", 40,
                                           "--worker-timeout", 3, "--inject", "*:delay=0.004"))
            node2 = ranks_of(c, {3, 4})
            c.wait_log_rows(d / "run.h5")
            for pid in node2:
                os.kill(pid, signal.SIGSTOP)
            r = c.end(240)
        text, ok = exact(d / "run.h5", ref)
        s = summary(d / "run.h5")
        return r, ok and r["code"] == 3 and sorted(s["lost_workers"]) == [3, 4], text

    @case("a node partitioned for good (box, link down)")
    def _(d, data):
        if why:
            return skipped()
        ref, timeout = small(d), 3
        with ClusterBox(nodes=3) as box:
            stage(box, ref)
            c = start(box, d, *local_train(box, ref, d, "--replicas", 2, "--epochs", 90,
                                           "--worker-timeout", timeout, "--inject", "*:delay=0.004"))
            node2 = ranks_of(c, {3, 4})
            c.wait_log_rows(d / "run.h5")
            box.run(2, ["ip", "link", "set", "eth0", "down"], timeout=10)
            t0 = time.monotonic()
            while any(alive(p) for p in node2) and time.monotonic() - t0 < limit(timeout) + 10:
                time.sleep(0.2)
            took, running = time.monotonic() - t0, c.proc.poll() is None
            gone = not any(alive(p) for p in node2)
            r = c.end(240)
            box.run(2, ["ip", "link", "set", "eth0", "up"], timeout=10)
        text, ok = exact(d / "run.h5", ref)
        ok = ok and gone and running and took < limit(timeout) + 5 and r["code"] == 3
        return r, ok, f"n2's ranks gone {took:.1f} s after the link (limit {limit(timeout):.0f} s); {text}"

    @case("a parameter store's link down (box)")
    def _(d, data):
        if why:
            return skipped()
        with ClusterBox(nodes=3) as box:
            c = start(box, d, *train(data, d, "--epochs", 5000, "--servers", 2,
                                     "--worker-timeout", 5), flags=())
            node1 = ranks_of(c, {1, 2})
            c.wait_log_rows(d / "run.h5")
            time.sleep(1.0)
            box.run(1, ["ip", "link", "set", "eth0", "down"], timeout=10)
            t0 = time.monotonic()
            while c.proc.poll() is None and time.monotonic() - t0 < 60:
                time.sleep(0.2)
            took = time.monotonic() - t0
            # n1's ranks cannot hear that the job ended: they end themselves (watchdog)
            while any(alive(p) for p in node1) and time.monotonic() - t0 < limit(5) + 10:
                time.sleep(0.2)
            gone = time.monotonic() - t0
            r = c.end(time.monotonic() - c.t0 + 60)
            box.run(1, ["ip", "link", "set", "eth0", "up"], timeout=10)
        named = any("rank 1 (a parameter store) did not answer" in ln for ln in r["lines"])
        ok = r["code"] == 1 and named and took < 5 + 10 and gone < limit(5) + 5
        return r, ok, (f"the job ended {took:.1f} s after the link, n1's ranks {gone:.1f} s "
                       f"after it (limit {limit(5):.0f} s)")

    @case(f"one node at 100 Mbit/s, median of {PAIRS} pairs (box)")
    def _(d, data):
        if why:
            return skipped()
        from mpilb.data.dataset import prepare_synthetic

        wide = d / "synth784"
        prepare_synthetic(wide, samples=30000, features=784, classes=10,
                                 shards=24, seed=7)
        args = ["--data", wide, "--hidden", "256,256", "--batch", "512", "--epochs", 8,
                "--no-progress", "--overwrite"]
        ratios, r = [], None
        with ClusterBox(nodes=3, link_rate="1gbit") as box, \
                ClusterBox(nodes=3, link_rate=["1gbit", "1gbit", "100mbit"]) as slow:
            for _ in range(PAIRS):
                times = []
                for b, hosts in ((slow, NODE_HOSTS), (box, "n0:1,n1:2")):
                    r = start(b, d, "train", *args, "--log", d / "run.h5", hosts=hosts,
                              flags=()).end(300)
                    if r["code"] != 0:
                        return r, False, f"{hosts}: exit {r['code']}"
                    times.append(summary(d / "run.h5")["train_s"])
                ratios.append(times[0] / times[1])
        ratio = statistics.median(ratios)
        return r, ratio <= 1.1, (f"with n2 at 100 Mbit/s ÷ without n2: {ratio:.2f} "
                                 f"({min(ratios):.2f}-{max(ratios):.2f}; target 1.1)")
