"""Benchmark results as JSON: every figure with its command, repeats and spread, and the machine.

A script collects figures in a :class:`Results` and writes ``benchmarks/results/NAME.json``
(``--out``). ``benchmarks/gendocs.py`` renders those files into the tables of the docs, so a
figure in the docs is always the one a result file holds. The file's layout::

    {"name": ..., "title": ..., "argv": [...], "quick": false,
     "machine": {cpu, cores, memory_gib, blas, mpi, python, numpy, h5py, mpi4py, mpilb,
                 commit, date, load_start, load_end, notes},
     "groups": [{"title": ..., "command": ..., "figures": [
         {"id", "label", "unit", "digits", "command", "repeats", "values",
          "median", "min", "max", "target", "result"}]}],
     "elapsed_s": ...}

``target`` is ``"<= 0.65"``, ``">= 1.8"`` (or ``null``); ``result`` is PASS or MISS against it
(``null`` without a target). ``values`` are the per-repeat figures the median is taken over:
for a ratio, the ratio within each repeat (the two sides ran back to back).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A load average above this many runnable processes per core, at the start or the end,
# means other jobs were running beside the benchmark: the notes say so.
BUSY_PER_CORE = 1.0


def add_output_args(ap, name: str) -> None:
    """``--out`` and ``--quick`` (tiny runs that test the plumbing; written to a temporary file
    unless ``--out`` is given, so a quick run never replaces a real result)."""
    ap.add_argument("--out", default=None,
                    help=f"result file (default benchmarks/results/{name}.json; with --quick a "
                         f"temporary file)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny runs and one repeat: checks the script, not the figures")


def add_box_args(ap) -> None:
    """``--tcp``: the congestion control of the cluster in a box's nodes."""
    ap.add_argument("--tcp", default="loss", metavar="CC",
                    help="the box's nodes' TCP congestion control (python -m mpilb.clusterbox "
                         "up --tcp): loss (default), host or a name the kernel allows")


def out_path(opts, name: str) -> str:
    if opts.out:
        return opts.out
    if opts.quick:
        import tempfile

        return os.path.join(tempfile.gettempdir(), f"mpilb-bench-{name}.quick.json")
    return os.path.join(RESULTS_DIR, f"{name}.json")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _blas() -> str:
    import numpy as np

    try:
        cfg = np.show_config(mode="dicts")
        blas = cfg["Build Dependencies"]["blas"]
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:   # older numpy: no dict mode
        return "unknown"


def _mpi() -> str:
    try:
        from mpi4py import MPI

        return " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    except Exception as e:   # noqa: BLE001 (report what is there)
        return f"unavailable ({type(e).__name__})"


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:   # noqa: BLE001
        return "not installed"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        # changed code (not docs or results) means the figures are not the commit's
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no",
                                "--", "mpilb", "benchmarks", ":!benchmarks/results"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+changes" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _gpus() -> int:
    """GPUs CuPy sees here: with them, runs that leave --device at auto compute on them."""
    try:
        from mpilb.backend import gpu_count

        return gpu_count()
    except Exception:   # noqa: BLE001
        return 0


def machine() -> dict:
    """What the figures were measured on (the load average at the end is added on write)."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "system": f"{platform.system()} {platform.release()}",
        "blas": _blas(),
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        "mpi": _mpi(),
        "gpus": _gpus(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "h5py": _version("h5py"),
        "mpi4py": _version("mpi4py"),
        "mpilb": _version("mpilb"),
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_start": round(os.getloadavg()[0], 2),
    }


def verdict(value: float | None, target: str | None) -> str | None:
    """PASS or MISS of ``value`` against ``"<= x"`` / ``">= x"``; None without a target."""
    if target is None:
        return None
    op, bound = target.split()
    if value is None:
        return "MISS"
    ok = value <= float(bound) if op == "<=" else value >= float(bound)
    return "PASS" if ok else "MISS"


class Results:
    """The figures of one benchmark script, grouped as its tables are."""

    def __init__(self, name: str, title: str, opts=None):
        self.name = name
        self.title = title
        self.opts = opts
        self.quick = bool(getattr(opts, "quick", False))
        self.machine = machine()
        self.groups: list[dict] = []
        self.t0 = time.perf_counter()

    def box(self, box):
        """Record the cluster in a box the figures were measured on (its TCP); ``box``."""
        self.machine["box_tcp"] = box.tcp
        return box

    def group(self, title: str, command: str = "", note: str = "") -> dict:
        g = {"title": title, "command": command, "note": note, "figures": []}
        self.groups.append(g)
        return g

    def figure(self, group: dict, fid: str, label: str, values, *, unit: str = "",
               digits: int = 2, target: str | None = None, command: str | None = None,
               decide: str = "median") -> dict:
        """Add one figure measured ``len(values)`` times (None values: not reached).

        The verdict is on the median (``decide="median"``), or on every value
        (``decide="all"``: a count that must hold in every run, e.g. coverage).
        """
        vals = [None if v is None else float(v) for v in values]
        real = [v for v in vals if v is not None]
        med = statistics.median(real) if real and len(real) == len(vals) else None
        if decide == "all":
            results = [verdict(v, target) for v in vals]
            result = None if target is None else ("PASS" if all(r == "PASS" for r in results) else "MISS")
        else:
            result = verdict(med, target)
        fig = {
            "id": fid, "label": label, "unit": unit, "digits": digits,
            "command": command if command is not None else group["command"],
            "repeats": len(vals), "values": vals, "median": med,
            "min": min(real) if real else None, "max": max(real) if real else None,
            "target": target, "result": result,
        }
        group["figures"].append(fig)
        return fig

    def checks(self) -> list[tuple[str, bool, str]]:
        """(name, ok, value) of every figure with a target, for :func:`_runs.print_targets`."""
        out = []
        for g in self.groups:
            for f in g["figures"]:
                if f["target"] is not None:
                    out.append((f"{f['id']} {f['label']} {f['target']}", f["result"] == "PASS",
                                fmt_range(f)))
        return out

    def all_met(self) -> bool:
        return all(ok for _, ok, _ in self.checks())

    def write(self, path: str) -> str:
        m = dict(self.machine)
        m["load_end"] = round(os.getloadavg()[0], 2)
        m["notes"] = load_note(m)
        doc = {
            "name": self.name, "title": self.title,
            "argv": [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:],
            "quick": self.quick, "machine": m, "groups": self.groups,
            "elapsed_s": round(time.perf_counter() - self.t0, 1),
        }
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"results: {path}")
        return path


def load_note(m: dict) -> str:
    """What the load average says about the machine during the run."""
    cores = m.get("cores") or 1
    hi = max(m["load_start"], m["load_end"])
    text = (f"1-minute load average {m['load_start']:.1f} at the start and {m['load_end']:.1f} at "
            f"the end, on {cores} cores")
    if m["load_start"] > BUSY_PER_CORE * cores:
        return text + ("; the machine was busy when the benchmark started (other jobs, or "
                       "the ranks of a run just before it still in the 1-minute average), so "
                       "absolute times may be noisy and the within-run ratios are the figures "
                       "to read")
    if hi > BUSY_PER_CORE * cores:
        return text + " (the benchmark's own ranks account for part of it)"
    return text + "; the machine was otherwise quiet"


def fmt(value: float | None, digits: int) -> str:
    if value is None:
        return "not reached"
    if digits == 0:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def fmt_range(f: dict) -> str:
    """``median (min–max)`` of a figure, or the single value when measured once."""
    d = f["digits"]
    if f["repeats"] <= 1 or f["min"] == f["max"]:
        return fmt(f["median"] if f["median"] is not None else f["min"], d)
    lo, hi = fmt(f["min"], d), fmt(f["max"], d)
    return f"{fmt(f['median'], d)} ({lo}–{hi})"
