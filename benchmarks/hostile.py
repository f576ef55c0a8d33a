"""The hostile cases of issues 16 and 32, each run and judged: exit code, lines printed, time taken,
processes left behind, and what the run log says.

    python benchmarks/hostile.py [--keep DIR] [--only NAME,...]

Every case runs `mpilb` as a user would (`mpiexec -n 4` unless said otherwise) in a fresh
folder, with a hard timeout. A job's processes are found by a variable set in its
environment (Hydra starts each rank in a session of its own), so "left" counts every
process of the case still alive 1 s after it ended. The last column says whether the outcome
is the one the issue asks for; the script exits 1 if any is not. The cases that need nodes
run on the cluster in a box (root, `ip`, `tc`) and print "skipped" where there is none.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "tests" / "shim"
PY = sys.executable


def mpiexec() -> str:
    path = shutil.which("mpiexec", path=os.path.dirname(PY) + os.pathsep + os.environ["PATH"])
    if path is None:
        sys.exit("mpiexec not found: pip install mpich")
    return path


def mpilb(n: int, *args, flags=()) -> list[str]:
    base = [PY, "-m", "mpilb", *map(str, args)]
    return base if n == 0 else [mpiexec(), *flags, "-n", str(n), *base]


class Case:
    """One run of a command in `cwd`, with the job marked in its environment."""

    def __init__(self, cmd, cwd: Path, env=None):
        self.env = dict(os.environ, **(env or {}))
        self.env["MPILB_HOSTILE_JOB"] = f"{cwd}:{time.monotonic_ns()}"
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.t0 = time.monotonic()

    def processes(self) -> dict[int, dict]:
        return _runs.marked_processes(("MPILB_HOSTILE_JOB=" + self.env["MPILB_HOSTILE_JOB"]).encode())

    def rank_pids(self, n: int, timeout: float = 60) -> dict[int, int]:
        while time.monotonic() - self.t0 < timeout:
            found = {int(e[b"PMI_RANK"]): pid for pid, e in self.processes().items()
                     if b"PMI_RANK" in e and pid != self.proc.pid}
            if len(found) == n:
                return found
            time.sleep(0.1)
        raise RuntimeError("ranks did not start")

    def wait_log_rows(self, log: Path, timeout: float = 60) -> None:
        from mpilb.runfiles.runlog import holds_updates

        while time.monotonic() - self.t0 < timeout and self.proc.poll() is None:
            if holds_updates(log):
                return
            time.sleep(0.2)

    def end(self, timeout: float = 120) -> dict:
        try:
            out, err = self.proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - self.t0)))
            code = self.proc.returncode
        except subprocess.TimeoutExpired:
            code, out, err = "TIMEOUT", "", ""
        seconds = time.monotonic() - self.t0
        time.sleep(1.0)
        left = [p for p in self.processes() if p != self.proc.pid]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        lines = [l for l in (out + err).splitlines() if l.strip() and not l.startswith(("Abort(", "="))]
        return {"code": code, "s": seconds, "left": len(left), "lines": lines}


def run(cmd, cwd, timeout=120, env=None) -> dict:
    return Case(cmd, cwd, env).end(timeout)


def summary(log: Path) -> dict:
    from mpilb.runfiles.summary import summarize_log

    return summarize_log(str(log))


def recomputed_coverage(log: Path, sizes) -> dict:
    """Coverage from updates/ (epoch, shard, lo, hi) alone, over the completed epochs."""
    from mpilb.runfiles.runlog import read_columns

    _, cols = read_columns(str(log))
    up = cols["updates"]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    out = {"expected": 0, "applied": 0, "duplicates": 0, "missing": 0}
    for e in sorted(set(int(x) for x in cols["epochs"]["epoch"])):
        counts = np.zeros(int(offsets[-1]), dtype=np.int64)
        for s, lo, hi in zip(*(up[c][up["epoch"] == e] for c in ("shard", "lo", "hi"))):
            counts[offsets[s] + lo: offsets[s] + hi] += 1
        out["expected"] += counts.size
        out["applied"] += int(np.count_nonzero(counts))
        out["duplicates"] += int(np.count_nonzero(counts > 1))
        out["missing"] += int(np.count_nonzero(counts == 0))
    return out


def exact(log: Path, data: Path) -> str:
    from mpilb.data.dataset import open_dataset

    s = summary(log)
    mine = recomputed_coverage(log, open_dataset(data).shard_sizes)
    ok = mine == s["coverage"] and mine["applied"] == mine["expected"] > 0 and not mine["duplicates"]
    return (f"{s['status']}, {s['epochs_completed']} epochs, lost {s['lost_workers']}, coverage "
            f"{mine['applied']}/{mine['expected']} from the log's ranges"
            + ("" if ok else f" (MISMATCH: server says {s['coverage']})")), ok


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def one_line(r: dict, code: int) -> bool:
    return r["code"] == code and len(r["lines"]) == 1 and r["lines"][0].startswith("mpilb: error:")


# --------------------------------------------------------------------------- the cases
CASES = {}


def case(name):
    def register(fn):
        CASES[name] = fn
        return fn
    return register


def train(data, d, *extra):
    return ["train", "--data", data, "--hidden", 16, "--no-progress", "--log", d / "run.h5", *extra]


@case("bad TOML encoding")
def _(d, data):
    (d / "bad.toml").write_bytes(b'data = "d"  # f\xfcr\n')
    r = run(mpilb(4, "train", "bad.toml"), d)
    return r, one_line(r, 2), ""


@case("read-only MPILB_CACHE")
def _(d, data):
    r = run(mpilb(4, "train", "--epochs", 1, "--no-progress"), d, env={"MPILB_CACHE": "/proc/mpilb-cache"})
    return r, one_line(r, 2), ""


def interrupted(d, data, n):
    """A run stopped by --max-seconds part-way through a later epoch (small dataset)."""
    data = data.parent / "small"
    run(mpilb(n, *train(data, d, "--epochs", 200, "--batch", 16, "--max-seconds", 1.5)), d)
    with h5py.File(d / "run.ckpt.h5", "r") as f:
        return int(f.attrs["epoch"]), bool(f["coverage/counts"][()].any())


for _n, _label in ((4, "MPI"), (1, "one rank")):
    def _fewer(d, data, n=_n):
        epoch, _ = interrupted(d, data, n)
        data = data.parent / "small"
        run(mpilb(n, *train(data, d, "--epochs", epoch, "--batch", 16, "--resume")), d)
        r = run(mpilb(n, *train(data, d, "--epochs", epoch + 2, "--batch", 16, "--resume")), d)
        text, ok = exact(d / "run.h5", data)
        return r, ok and r["code"] == 0 and epoch >= 1, f"checkpoint epoch {epoch}; {text}"

    def _seed(d, data, n=_n):
        epoch, mid = interrupted(d, data, n)
        data = data.parent / "small"
        before = digest(d / "run.h5"), digest(d / "run.ckpt.h5")
        r = run(mpilb(n, *train(data, d, "--epochs", epoch + 2, "--batch", 16, "--resume", "--seed", 1)), d)
        unchanged = before == (digest(d / "run.h5"), digest(d / "run.ckpt.h5"))
        return r, one_line(r, 2) and unchanged and mid, f"mid-epoch {mid}, files unchanged {unchanged}"

    case(f"resume, fewer epochs, then more ({_label})")(_fewer)
    case(f"resume --seed 1 mid-epoch ({_label})")(_seed)


@case("two runs share one log")
def _(d, data):
    first = Case(mpilb(4, *train(data, d, "--epochs", 5000, "--max-seconds", 25)), d)
    first.wait_log_rows(d / "run.h5")
    second = run(mpilb(4, *train(data, d, "--epochs", 1, "--overwrite")), d)
    r = first.end()
    s = summary(d / "run.h5")
    ok = one_line(second, 2) and "another mpilb run" in second["lines"][0] and r["code"] == 0
    ok = ok and s["status"] == "finished" and s["train_s"] >= 25
    return second, ok, f"first run exit {r['code']}, its log {s['status']} after {s['train_s']:.0f} s"


@case("empty shard (load balancer)")
def _(d, data):
    empty = d / "data"
    shutil.copytree(data, empty)
    m = json.loads((empty / "manifest.json").read_text())
    entry = m["shards"][2]
    path = empty / entry["file"]
    with h5py.File(path, "r") as f:
        specs = [(k, f[k].shape[1:], f[k].dtype, f[k].chunks) for k in ("x", "y")]
    path.unlink()
    with h5py.File(path, "w") as f:
        for k, shape, dtype, chunks in specs:
            f.create_dataset(k, shape=(0, *shape), maxshape=(None, *shape), dtype=dtype, chunks=chunks)
    entry["samples"], entry["sha256"] = 0, digest(path)
    (empty / "manifest.json").write_text(json.dumps(m))
    r = run(mpilb(4, *train(empty, d, "--epochs", 3, "--worker-timeout", 5)), d)
    text, ok = exact(d / "run.h5", empty)
    return r, ok and r["code"] == 0, text


@case("rank 0 SIGSTOPped for 2x --worker-timeout")
def _(d, data):
    c = Case(mpilb(4, *train(data, d, "--epochs", 500, "--max-seconds", 8, "--worker-timeout", 2)), d)
    pids = c.rank_pids(4)
    c.wait_log_rows(d / "run.h5")
    os.kill(pids[0], signal.SIGSTOP)
    time.sleep(4)
    os.kill(pids[0], signal.SIGCONT)
    r = c.end()
    s = summary(d / "run.h5")
    return r, r["code"] == 0 and s["lost_workers"] == [], f"{s['status']}, lost {s['lost_workers']}"


@case("--log names a shard of the dataset")
def _(d, data):
    copy = d / "data"
    shutil.copytree(data, copy)
    before = digest(copy / "shard-00000.h5")
    r = run(mpilb(4, "train", "--data", copy, "--no-progress", "--log", copy / "shard-00000.h5",
                  "--overwrite"), d)
    intact = digest(copy / "shard-00000.h5") == before
    return r, one_line(r, 2) and intact, f"shard unchanged {intact}"


@case("--log X --checkpoint X")
def _(d, data):
    r = run(mpilb(4, "train", "--data", data, "--no-progress", "--log", "x.h5", "--checkpoint", "x.h5"), d)
    return r, one_line(r, 2), ""


@case("existing --log without --overwrite")
def _(d, data):
    run(mpilb(4, *train(data, d, "--epochs", 1)), d)
    before = digest(d / "run.h5")
    r = run(mpilb(4, *train(data, d, "--epochs", 1)), d)
    return r, one_line(r, 2) and digest(d / "run.h5") == before, "file unchanged"


FULL = """
import resource, signal, sys
from mpilb.mpi import comm   # MPI's shared-memory files are made before the disk is "full"
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from mpilb.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@case("full disk during a checkpoint (one rank)")
def _(d, data):
    (d / "full.py").write_text(FULL)
    # a killed writer's leftover temp file
    (d / ".run.ckpt.h5.tmp999999").write_bytes(b"x" * 100000)
    # files over 2 MB cannot be written: the log (0.7 MB) fits, the checkpoint (9 MB) not
    r = run([PY, str(d / "full.py"), "2000000",
             *map(str, train(data, d, "--epochs", 1, "--max-seconds", 1.5, "--hidden", "1024,1024"))], d)
    temps = sorted(p.name for p in d.glob(".*tmp*"))
    return r, r["code"] == 1 and len(r["lines"]) <= 2 and not temps, f"temp files left: {temps}"


@case("report on a truncated log")
def _(d, data):
    run(mpilb(0, *train(data, d, "--epochs", 1)), d)
    (d / "t.h5").write_bytes((d / "run.h5").read_bytes()[:3000])
    r = run(mpilb(0, "report", "t.h5"), d, timeout=30)
    return r, one_line(r, 2), ""


@case("report on a checkpoint / plots onto a file")
def _(d, data):
    run(mpilb(0, *train(data, d, "--epochs", 1)), d)
    r = run(mpilb(0, "report", "run.ckpt.h5"), d, timeout=30)
    (d / "f").write_text("x")
    r2 = run(mpilb(0, "report", "run.h5", "--plots", "f"), d, timeout=30)
    return r, one_line(r, 2) and one_line(r2, 2), r2["lines"][0] if r2["lines"] else ""


@case("damaged checkpoint JSON / NaN parameter")
def _(d, data):
    run(mpilb(4, *train(data, d, "--epochs", 1)), d)
    shutil.copy(d / "run.ckpt.h5", d / "keep.h5")
    with h5py.File(d / "run.ckpt.h5", "r+") as f:
        f.attrs["balancer"] = '{"name": "load", "rat'
    r = run(mpilb(4, *train(data, d, "--epochs", 2, "--resume")), d)
    shutil.copy(d / "keep.h5", d / "run.ckpt.h5")
    with h5py.File(d / "run.ckpt.h5", "r+") as f:
        f["params"][3] = np.nan
    r2 = run(mpilb(4, *train(data, d, "--epochs", 2, "--resume")), d)
    return r, one_line(r, 2) and one_line(r2, 2), r2["lines"][0] if r2["lines"] else ""


@case("empty test set")
def _(d, data):
    run(mpilb(0, "prepare", "synthetic", "e", "--samples", 300, "--features", 4, "--classes", 3,
              "--shards", 2, "--test-fraction", 0), d)
    r = run(mpilb(4, *train(d / "e", d, "--epochs", 1)), d)
    out = subprocess.run(mpilb(0, "report", "run.h5", "--json"), cwd=d, capture_output=True, text=True).stdout
    acc = json.loads(out)["final_test_accuracy"]
    return r, r["code"] == 0 and acc is None and "NaN" not in out, f"final_test_accuracy {acc}"


@case("--data FILE / corrupt npz")
def _(d, data):
    np.savez(d / "a.npz", x=np.zeros((20, 3), np.float32), y=np.zeros(20, np.int64))
    (d / "b.npz").write_bytes((d / "a.npz").read_bytes()[:300])
    r = run(mpilb(4, "train", "--data", "a.npz", "--no-progress"), d)
    r2 = run(mpilb(0, "prepare", "npz", "b.npz", "out"), d)
    return r, one_line(r, 2) and one_line(r2, 2), r2["lines"][0] if r2["lines"] else ""


@case("MPMD ranks with different options")
def _(d, data):
    base = [PY, "-m", "mpilb", *map(str, train(data, d, "--epochs", 1))]
    r = run([mpiexec(), "-n", "1", *base, "--batch", "32", ":", "-n", "3", *base, "--batch", "64"], d)
    return r, one_line(r, 2), ""


def _signal_after(d, data, when, sig=signal.SIGTERM, extra=(), flags=()):
    c = Case(mpilb(4, *train(data, d, *extra), flags=flags), d)
    if when == "finished":
        for line in c.proc.stdout:
            if line.startswith("mpilb: finished"):
                break
        os.kill(c.proc.pid, sig)
    else:
        pids = c.rank_pids(4)
        c.wait_log_rows(d / "run.h5")
        time.sleep(when)
        for pid in ([c.proc.pid] if sig == signal.SIGTERM else pids.values()):
            os.kill(pid, sig)
    return c.end(), summary(d / "run.h5")


@case("SIGTERM just after 'finished'")
def _(d, data):
    r, s = _signal_after(d, data, "finished", extra=("--epochs", 1))
    return r, r["code"] == 0 and s["status"] == "finished", s["status"]


@case("SIGTERM with a hung worker")
def _(d, data):
    r, s = _signal_after(d, data, 1.0, extra=("--epochs", 100, "--inject", "2:hang@0.5",
                                              "--worker-timeout", 3))
    return r, r["code"] == 0 and s["status"] == "preempted", f"{s['status']}, lost {s['lost_workers']}"


@case("SIGUSR1 to every rank, -disable-auto-cleanup")
def _(d, data):
    r, s = _signal_after(d, data, 1.0, sig=signal.SIGUSR1, extra=("--epochs", 100),
                         flags=("-disable-auto-cleanup",))
    ck = (d / "run.ckpt.h5").exists()
    return r, r["code"] == 0 and s["status"] == "preempted" and ck, f"{s['status']}, checkpoint {ck}"


for _launcher in ("mpiexec -disable-auto-cleanup", "srun --no-kill (shim)"):
    def _crash(d, data, launcher=_launcher):
        # (the crash early: on a fast machine 6 epochs took 1.4 s, and a crash at 2 s never came)
        args = train(data, d, "--epochs", 12, "--inject", "2:crash@0.3", "--worker-timeout", 5)
        if launcher.startswith("srun"):
            cmd = [str(SHIM / "srun"), "--no-kill", "-n", "4", PY, "-m", "mpilb", *map(str, args)]
            env = {"PATH": f"{SHIM}{os.pathsep}{os.environ['PATH']}", "SLURM_SHIM_STATE": str(d / "slurm")}
        else:
            cmd, env = mpilb(4, *args, flags=("-disable-auto-cleanup",)), None
        r = run(cmd, d, env=env)
        text, ok = exact(d / "run.h5", data)
        with h5py.File(d / "run.h5", "r") as f:
            tail = float(f.attrs["wall_s"]) - float(f["epochs/t_end"][-1])
        s = summary(d / "run.h5")
        ok = ok and r["code"] == 3 and s["lost_workers"] == [2] and s["epochs_completed"] == 12
        return r, ok and tail < 5 + 10, f"{text}; end {tail:.1f} s after the last epoch"

    case(f"crashed worker, {_launcher}")(_crash)


# --------------------------------------------------------------------------- issue 32's cases
def _checkpointed(d, data, *extra):
    r = run(mpilb(4, *train(data, d, "--epochs", 2, *extra)), d)
    assert r["code"] == 0, r["lines"]
    return d / "run.ckpt.h5"


@case("checkpoint edited to name os:system, evaluate")
def _(d, data):
    ckpt = _checkpointed(d, data)
    with h5py.File(ckpt, "a") as f:
        cfg = json.loads(f.attrs["config"])
        cfg["model"], cfg["model_arg"] = "os:system", [f'command="touch {d / "ran"}"']
        f.attrs["config"] = json.dumps(cfg)
    r = run(mpilb(0, "evaluate", ckpt, "--data", data), d)
    ran = (d / "ran").exists()
    return r, one_line(r, 2) and not ran, f"code ran: {ran}"


@case("--overwrite, rank 0 killed, --resume")
def _(d, data):
    _checkpointed(d, data)   # run A
    c = Case(mpilb(4, *train(data, d, "--epochs", 200, "--overwrite", "--checkpoint-interval", 1000)), d)
    pids = c.rank_pids(4)
    c.wait_log_rows(d / "run.h5")
    os.kill(pids[0], signal.SIGKILL)
    b = c.end()
    r = run(mpilb(4, *train(data, d, "--epochs", 20, "--resume")), d)
    if r["code"] == 2:   # B wrote no checkpoint: A's went with A's log, nothing to resume
        return r, one_line(r, 2), f"B: exit {b['code']}; nothing of A's resumed"
    text, ok = exact(d / "run.h5", data)   # B's own checkpoint: a true resume of B
    return r, ok and r["code"] == 0 and summary(d / "run.h5")["epochs_completed"] == 20, text


@case("--resume with another run's --checkpoint")
def _(d, data):
    other = d / "other"
    other.mkdir()
    ckpt = _checkpointed(other, data)
    _checkpointed(d, data)
    before = digest(d / "run.h5")
    r = run(mpilb(4, *train(data, d, "--epochs", 6, "--resume", "--checkpoint", ckpt)), d)
    return r, one_line(r, 2) and digest(d / "run.h5") == before, ""


@case("resume with a truncated log")
def _(d, data):
    _checkpointed(d, data)
    (d / "run.h5").write_bytes((d / "run.h5").read_bytes()[:5000])
    r = run(mpilb(4, *train(data, d, "--epochs", 10, "--resume")), d)
    return r, one_line(r, 2), ""


@case("log deleted mid-run")
def _(d, data):
    c = Case(mpilb(4, *train(data, d, "--epochs", 200, "--max-seconds", 4)), d)
    c.wait_log_rows(d / "run.h5")
    (d / "run.h5").unlink()
    r = c.end()
    s = summary(d / "run.h5")
    return r, r["code"] == 0 and s["epochs_completed"] >= 1, f"{s['epochs_completed']} epochs in the log"


@case("Ctrl-C (SIGINT to mpiexec), then --resume")
def _(d, data):
    c = Case(mpilb(4, *train(data, d, "--epochs", 200)), d)
    c.wait_log_rows(d / "run.h5")
    time.sleep(1.0)
    os.kill(c.proc.pid, signal.SIGINT)
    r = c.end()
    s = summary(d / "run.h5")
    again = run(mpilb(4, *train(data, d, "--epochs", s["epochs_completed"] + 1, "--resume")), d)
    ok = r["code"] == 0 and s["status"] == "preempted" and again["code"] == 0
    return r, ok, f"{s['status']}; resumed: exit {again['code']}"


RETURNS = """
import numpy as np
from mpilb.models import MLP


class Returns(MLP):
    def __init__(self, input_shape, num_classes, short: int = 0):
        super().__init__(input_shape, num_classes, (16,))
        self.short = short

    def loss_and_grad(self, params, x, y, out=None):
        loss, grad = super().loss_and_grad(params, x, y, None)
        return loss, grad[:grad.size - self.short].copy()
"""


@case("model returns its gradient (and one 3 short)")
def _(d, data):
    (d / "ret.py").write_text(RETURNS)
    base = ["train", "--data", data, "--no-progress", "--epochs", 3, "--model", d / "ret.py:Returns"]
    r = run(mpilb(4, *base, "--log", d / "run.h5"), d)
    acc = summary(d / "run.h5")["final_test_accuracy"]
    short = run(mpilb(4, *base, "--log", d / "s.h5", "--model-arg", "short=3"), d)
    return short, r["code"] == 0 and acc > 0.5 and one_line(short, 2), f"accuracy {acc:.3f}"


def _stalled_store(d, data, timeout, then_sigterm):
    c = Case(mpilb(5, *train(data, d, "--epochs", 2000, "--servers", 2, "--worker-timeout", timeout,
                             "--checkpoint-interval", 1)), d)
    pids = c.rank_pids(5)
    c.wait_log_rows(d / "run.h5")
    time.sleep(1.0)
    os.kill(pids[1], signal.SIGSTOP)
    t = time.monotonic()
    if then_sigterm:
        time.sleep(1.0)
        os.kill(c.proc.pid, signal.SIGTERM)
    r = c.end()
    try:
        os.kill(pids[1], signal.SIGCONT)
    except ProcessLookupError:
        pass
    return r, time.monotonic() - t


@case("parameter store stalled (SIGSTOP), --worker-timeout 5")
def _(d, data):
    r, took = _stalled_store(d, data, 5, False)
    return r, one_line(r, 1) and took < 15, f"ended {took:.1f} s after the stall"


@case("SIGTERM during a store stall")
def _(d, data):
    r, took = _stalled_store(d, data, 60, True)
    s = summary(d / "run.h5")
    return r, r["code"] == 0 and s["status"] == "preempted" and took < 31, f"{s['status']}, {took:.1f} s"


@case("the log's disk full (400 kB tmpfs)")
def _(d, data):
    full = d / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(full)]).returncode:
        return {"code": "-", "s": 0.0, "lines": [], "left": 0}, True, "skipped: no tmpfs (root)"
    try:
        r = run(mpilb(4, "train", "--data", data, "--hidden", 16, "--no-progress", "--epochs", 100,
                      "--log", full / "run.h5", "--checkpoint", d / "c.ckpt.h5"), d)
    finally:
        time.sleep(0.5)
        subprocess.run(["umount", str(full)])
    ck = (d / "c.ckpt.h5").exists()
    return r, one_line(r, 1) and ck, f"checkpoint written: {ck}"


import _hostile_refusals  # noqa: E402  (issue 32's refusals and messages, issue 31's dropped batch)
_hostile_refusals.add_cases(sys.modules[__name__])
import _hostile_nodes  # noqa: E402  (issue 32's cases that need nodes, and a SIGKILLed worker)
_hostile_nodes.add_cases(sys.modules[__name__])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", help="run the cases in this folder and keep it")
    ap.add_argument("--only", help="comma-separated substrings of case names")
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="mpilb-hostile-"))
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MPILB_CACHE", str(root / "cache"))
    data = root / "synth"
    if not data.exists():
        subprocess.run(mpilb(0, "prepare", "synthetic", data, "--samples", 12000, "--features", 32,
                             "--classes", 10, "--shards", 12), check=True, capture_output=True)
    if not (root / "small").exists():
        subprocess.run(mpilb(0, "prepare", "synthetic", root / "small", "--samples", 2000,
                             "--features", 16, "--classes", 4, "--shards", 8),
                       check=True, capture_output=True)
    bad = 0
    print(f"{'case':48} {'exit':>5} {'s':>6} {'lines':>5} {'left':>4}  ok  detail")
    for i, (name, fn) in enumerate(CASES.items()):
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        d = root / f"case{i:02d}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        try:
            r, ok, detail = fn(d, data)
        except Exception as exc:  # noqa: BLE001 - a case that breaks is a failed case
            r, ok, detail = {"code": "-", "s": 0.0, "lines": [], "left": 0}, False, f"{type(exc).__name__}: {exc}"
        ok = ok and r["left"] == 0 and r["code"] != "TIMEOUT"
        bad += not ok
        first = r["lines"][0] if r["lines"] else ""
        print(f"{name:48} {r['code']!s:>5} {r['s']:6.1f} {len(r['lines']):5d} {r['left']:4d}  "
              f"{'yes' if ok else 'NO '} {detail or first}", flush=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
