"""`mpilb doctor`: check the MPI, HDF5 and GPU setup a run depends on, and say how to fix it.

Run it the way training runs (`mpiexec -n 4 mpilb doctor`, or `srun ... mpilb doctor` in a
job) so that it sees the same launcher, nodes and GPUs. Every rank reports what it sees;
rank 0 prints the lot, then a ping-pong between rank 0 and each other rank measures latency
(8-byte messages) and bandwidth (4 MiB messages). Problems are listed with their fix:
errors (the run would fail or hang) make the exit code 1, warnings (it would run, perhaps
slowly) leave it 0.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
import time

import numpy as np

from mpilb.cli.installation import same_installation
from mpilb.mpi.launcher import launch

PING_BYTES = 8
BANDWIDTH_BYTES = 4 * 2**20
PAIR_SECONDS = 1.0          # ping-pong time per (0, r) pair ...
TOTAL_PING_SECONDS = 16.0   # ... shortened on large jobs so the whole check stays short
TAG_START, TAG_COUNT, TAG_PING = 31, 32, 33
THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")

# File systems where HDF5's default file locking is known to fail or to be slow.
PARALLEL_FS = ("lustre", "gpfs", "nfs", "nfs4", "beegfs", "ceph", "fuse.ceph", "cephfs",
               "fuse.glusterfs", "panfs", "wekafs", "pvfs2", "orangefs", "fuse.sshfs")


class Findings:
    """Problems found, each with its fix: errors break a run, warnings slow or surprise it."""

    def __init__(self):
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def error(self, text: str) -> None:
        self.errors.append(text)

    def warn(self, text: str) -> None:
        self.warnings.append(text)


# ---------------------------------------------------------------- what each rank sees

def _nvidia_smi_gpus() -> int | None:
    """GPUs the driver lists (`nvidia-smi -L`), or None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _rank_facts(comm) -> dict:
    """This rank's host, local rank, GPUs and MPI CUDA support."""
    from mpilb import backend
    from mpilb.mpi import comm as C

    cupy = backend.cupy_module()
    gpus = backend.gpu_count()
    return {
        "host": socket.gethostname(),
        "local_rank": C.local_rank(comm),
        "gpus": gpus,
        "cupy": getattr(cupy, "__version__", None),
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "driver_gpus": _nvidia_smi_gpus() if gpus == 0 else None,
        "cuda_support": C.mpi_info()["cuda_support"],
    }


# ---------------------------------------------------------------- ping-pong

def _echo(comm, buf: np.ndarray) -> None:
    """Partner side: echo batches of messages until rank 0 sends a batch of 0."""
    batch = np.zeros(2, np.int64)   # message bytes, round trips
    while True:
        comm.Recv(batch, source=0, tag=TAG_COUNT)
        nbytes, n = int(batch[0]), int(batch[1])
        if n == 0:
            return
        view = buf[:nbytes]
        for _ in range(n):
            comm.Recv(view, source=0, tag=TAG_PING)
            comm.Send(view, dest=0, tag=TAG_PING)


def _rounds(comm, peer: int, view: np.ndarray, n: int) -> float:
    """Time n round trips of `view` with `peer`; returns seconds."""
    comm.Send(np.array([view.nbytes, n], np.int64), dest=peer, tag=TAG_COUNT)
    t0 = time.perf_counter()
    for _ in range(n):
        comm.Send(view, dest=peer, tag=TAG_PING)
        comm.Recv(view, source=peer, tag=TAG_PING)
    return time.perf_counter() - t0


def _one_way(comm, peer: int, view: np.ndarray, seconds: float) -> float:
    """One-way time of a message of view.nbytes: calibrate (which also warms the path up),
    then ping-pong for the rest of ~`seconds`."""
    n, spent = 4, 0.0
    while True:
        elapsed = _rounds(comm, peer, view, n)
        spent += elapsed
        if elapsed >= 0.1 * seconds:
            break
        n *= 4
    n = max(n, int((seconds - spent) * n / elapsed))
    return _rounds(comm, peer, view, n) / (2 * n)


def ping_pong(comm, seconds_per_pair: float) -> list[tuple[int, float, float]]:
    """Latency and bandwidth between rank 0 and each other rank, one pair at a time.

    Returns, on rank 0, [(rank, latency_s, bytes_per_s)]; [] elsewhere. Ranks not yet in a
    pair wait without spinning; the measurement itself uses plain blocking calls.
    """
    from mpilb.mpi import comm as C

    rank, size = comm.Get_rank(), comm.Get_size()
    buf = np.ones(BANDWIDTH_BYTES, np.uint8)
    if rank != 0:
        C.recv_when_ready(comm, np.zeros(1, np.int64), 0, TAG_START)
        _echo(comm, buf)
        return []
    results = []
    for peer in range(1, size):
        comm.Send(np.zeros(1, np.int64), dest=peer, tag=TAG_START)
        latency = _one_way(comm, peer, buf[:PING_BYTES], seconds_per_pair / 2)
        transfer = _one_way(comm, peer, buf, seconds_per_pair / 2)
        comm.Send(np.zeros(2, np.int64), dest=peer, tag=TAG_COUNT)
        results.append((peer, latency, BANDWIDTH_BYTES / transfer))
    return results


# ---------------------------------------------------------------- checks (rank 0)

def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def _fs_type(path: str) -> str | None:
    """File system type of `path`, from /proc/mounts (longest matching mount point)."""
    try:
        with open("/proc/mounts") as fh:
            mounts = [line.split()[1:3] for line in fh]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = None
    for point, kind in mounts:
        if (real == point or real.startswith(point.rstrip("/") + "/")) and (
                best is None or len(point) > len(best[0])):
            best = (point, kind)
    return best[1] if best else None


def _check_mpi(info: dict, size: int, launcher: str, launched: int | None, out: Findings) -> None:
    if launched is not None and launched != size:
        out.error(f"{launcher} started {launched} processes but MPI sees a world of {size}: the "
                  f"MPI library mpi4py uses ({info['libmpi'] or info['vendor']}) is not the one "
                  "the launcher belongs to. Launch with that library's own mpiexec, use srun "
                  "--mpi=pmi2 or --mpi=pmix under Slurm, or rebuild mpi4py against the "
                  "cluster's MPI: pip install --no-binary mpi4py --force-reinstall mpi4py "
                  "(docs/slurm.md)")
    if _numbers(info["standard"]) < _numbers(info["compiled_standard"]):
        out.error(f"mpi4py was built against MPI {info['compiled_standard']} but runs with a "
                  f"library implementing MPI {info['standard']} ({info['libmpi']}): rebuild it "
                  "against the MPI you run: pip install --no-binary mpi4py --force-reinstall mpi4py")
    mpicc = info["mpi4py_mpicc"]
    if mpicc and info["libmpi"] and not same_installation(shutil.which(mpicc) or mpicc,
                                                          info["libmpi"], info.get("library", "")):
        out.warn(f"mpi4py was built with {mpicc} but runs with {info['libmpi']}; if these belong "
                 "to different MPI installations, load the MPI module mpi4py was built with, or "
                 "rebuild: pip install --no-binary mpi4py --force-reinstall mpi4py")
    if THREAD_LEVELS.index(info["thread_level"]) < THREAD_LEVELS.index(info["thread_requested"]):
        out.error(f"MPI provides thread level {info['thread_level']}, mpilb asks for "
                  f"{info['thread_requested']} (the shard prefetch thread runs beside MPI): use an "
                  "MPI library built with thread support")


def mpi4py_line(info: dict) -> str:
    """The doctor's mpi4py row: its version and how it was built (installation.py)."""
    from mpilb.cli import installation as I

    wheels = {name: I.distribution(name) for name in I.MPI_WHEELS}
    holder = I.wheel_holding(info["libmpi"], wheels) if info["libmpi"] else None
    build = I.mpi4py_build(info["mpi4py_mpicc"], info.get("mpi4py_extension", ""),
                           I.distribution("mpi4py"), holder)
    return f"{info['mpi4py']} ({build})"


def _check_build(mpi4py: str, launcher: str, out: Findings) -> None:
    """A cluster job on the MPICH wheel from PyPI: it runs, without the site's fast paths."""
    if launcher.startswith("srun") and "libmpi from the mpich wheel" in mpi4py:
        out.warn("this Slurm job runs on the mpich wheel from PyPI (the [mpi] extra), which "
                 "knows nothing of the cluster's interconnect: build mpi4py against the site's "
                 "MPI (docs/slurm.md, 'Using the cluster's MPI instead of the bundled wheel')")


def _check_hdf5(out: Findings) -> str:
    """The HDF5 file-locking line, and a warning where locking meets a parallel file system."""
    setting = os.environ.get("HDF5_USE_FILE_LOCKING")
    value = (setting or "").strip().upper()
    if value in ("FALSE", "0"):
        return f"off (HDF5_USE_FILE_LOCKING={setting}): right for shards on parallel file systems"
    if value == "BEST_EFFORT":
        return ("best effort (HDF5_USE_FILE_LOCKING=BEST_EFFORT): locks where the file system "
                "supports them, ignores failures")
    line = (f"on (HDF5_USE_FILE_LOCKING={setting})" if setting else "on (HDF5_USE_FILE_LOCKING unset)")
    places = {"working directory": os.getcwd()}
    for var in ("MPILB_DATA", "MPILB_CACHE"):
        if os.environ.get(var):
            places[var] = os.environ[var]
    for what, path in places.items():
        kind = _fs_type(path)
        if kind in PARALLEL_FS:
            out.warn(f"HDF5 file locking is on and the {what} ({path}) is on {kind}: opens can "
                     "fail ('unable to lock file') or serialise across ranks; set "
                     "HDF5_USE_FILE_LOCKING=FALSE (mpilb never writes shards during training; "
                     "the Slurm templates set it)")
    return line + ": fine on local disks; on Lustre/GPFS/NFS set HDF5_USE_FILE_LOCKING=FALSE"


def _gpu_lines(ranks: list[dict], cuda_aware: bool, out: Findings) -> list[str]:
    """One line per rank (a summary per host on large jobs), and the GPU findings."""
    size = len(ranks)
    workers = range(1, size) if size > 1 else range(size)
    lines = []
    if size <= 16:
        for r, f in enumerate(ranks):
            role = "server, needs no GPU" if (r == 0 and size > 1) else "worker"
            if f["gpus"]:
                seen = f"{f['gpus']} GPU(s), uses GPU {f['local_rank'] % f['gpus']}"
            elif f["cupy"] is None:
                seen = "no GPU (CuPy not installed)"
            else:
                seen = "no GPU visible to CuPy"
            lines.append(f"rank {r} ({f['host']}, local rank {f['local_rank']}, {role}): {seen}")
    else:
        for host in sorted({f["host"] for f in ranks}):
            on = [f for f in ranks if f["host"] == host]
            lines.append(f"{host}: {len(on)} ranks, {max(f['gpus'] for f in on)} GPU(s) visible")

    no_cupy = [r for r in workers if ranks[r]["cupy"] is None]
    with_driver = [r for r in no_cupy if ranks[r]["driver_gpus"]]
    if with_driver:
        out.warn(f"rank(s) {_ranks(with_driver)}: the driver lists GPUs (nvidia-smi) but CuPy is "
                 "not installed, so workers compute on the CPU: pip install cupy-cuda12x "
                 "(the mpilb[gpu] extra), or use --device cpu")
    blind = [r for r in workers if ranks[r]["cupy"] is not None and ranks[r]["gpus"] == 0]
    if blind:
        visible = ranks[blind[0]]["cuda_visible"]
        out.warn(f"rank(s) {_ranks(blind)}: no GPU visible (CUDA_VISIBLE_DEVICES="
                 f"{visible if visible is not None else 'unset'}): request GPUs from the "
                 "scheduler (--gpus-per-node), install the CuPy that matches the CUDA driver "
                 "(cupy-cuda12x), or use --device cpu")
    for host in sorted({ranks[r]["host"] for r in workers}):
        on = [r for r in workers if ranks[r]["host"] == host]
        gpus = max(ranks[r]["gpus"] for r in on)
        if gpus and len(on) > gpus:
            out.warn(f"{host}: {len(on)} workers share {gpus} GPU(s); for one worker per GPU "
                     "start GPUs + 1 ranks (rank 0 needs none), see jobs/slurm/train_gpu.sbatch")

    support = {ranks[r]["cuda_support"] for r in workers}
    if cuda_aware:
        if False in support:
            out.error("MPILB_CUDA_AWARE=1 but the MPI library is not CUDA-aware "
                      "(MPIX_Query_cuda_support() is 0): unset MPILB_CUDA_AWARE and mpilb "
                      "stages through pinned host memory, or use a CUDA-aware MPI build")
        elif None in support:
            out.warn("MPILB_CUDA_AWARE=1 but this MPI library cannot say whether it is "
                     "CUDA-aware; if it is not, workers will crash handing device memory to "
                     "MPI: unset MPILB_CUDA_AWARE unless the library is built with CUDA")
    return lines


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _cuda_aware_line(cuda_aware: bool, support: set) -> str:
    requested = "on (MPILB_CUDA_AWARE=1)" if cuda_aware else "off: device buffers are staged through pinned host memory"
    if True in support and False not in support:
        library = "the MPI library reports CUDA support"
    elif False in support:
        library = "the MPI library reports no CUDA support"
    else:
        library = "the MPI library cannot say"
    return f"{requested}; {library}"


def _doorbell_line(via: dict, facts: list[dict], out: Findings) -> str:
    """Which ranks wake rank 0 (and are woken by it) with doorbells (doorbell.py); `via`:
    how each of them rings (doorbell.LOCAL or NETWORK)."""
    from mpilb.mpi import doorbell

    others = len(facts) - 1
    if others == 0:
        return "not used (one rank)"
    if not doorbell.wanted():
        return ("off (MPILB_DOORBELL=0)" if os.environ.get("MPILB_DOORBELL") == "0"
                else "not on this platform (Linux only): waits poll")
    mute = [r for r in range(1, len(facts)) if r not in via]
    for near, why in ((True, "share rank 0's host but cannot ring it (each in its own network namespace?)"),
                      (False, "on other hosts cannot ring rank 0 (UDP blocked by a firewall, or no IPv4 route?)")):
        ranks = [r for r in mute if (facts[r]["host"] == facts[0]["host"]) == near]
        if ranks:
            out.warn(f"rank(s) {_ranks(ranks)} {why}: they and rank 0 poll for each other's "
                     f"messages instead (later notice, more CPU)")
    udp = sum(v == doorbell.NETWORK for v in via.values())
    return (f"rank 0 <-> {len(via)} of {others} rank(s) ({len(via) - udp} through local sockets, "
            f"{udp} over the network by UDP; the others poll)")


def _waits_line(spins: list[bool]) -> str:
    """Which ranks poll before they sleep when they wait for a message (cores.py)."""
    from mpilb.mpi.cores import SPIN_S

    spin = [r for r, s in enumerate(spins) if s]
    rest = [r for r, s in enumerate(spins) if not s]
    if os.environ.get("MPILB_SPIN") in ("0", "1"):
        why = f" (MPILB_SPIN={os.environ['MPILB_SPIN']} on rank 0)"
    else:
        why = " (rank 0 needs a CPU more than the ranks on its node, a worker one each)"
    if not rest:
        return f"every rank polls {SPIN_S * 1e3:g} ms before it sleeps{why}"
    if not spin:
        return f"every rank sleeps between polls{why}"
    return (f"rank(s) {_ranks(spin)} poll {SPIN_S * 1e3:g} ms before they sleep, "
            f"rank(s) {_ranks(rest)} sleep between polls{why}")


def layout_section(nodes: list[int], hosts: list[str]) -> list[str]:
    """The job's nodes and which pairs talk through shared memory or the network, with the
    one store of --servers 1, and where --servers K / per-node would put theirs."""
    from mpilb.core.topology import layout_lines, span, store_ranks

    n = max(nodes) + 1
    where = [f"--servers {k}: ranks {span(store_ranks(nodes, k))}" for k in range(2, min(n, 3) + 1)]
    where.append(f"--servers per-node: ranks {span(store_ranks(nodes, 'per-node'))}")
    return layout_lines(nodes, [0], hosts) + [f"stores with {w}" for w in where]


def _format_pingpong(results) -> list[str]:
    return [f"rank 0 <-> {peer}: latency {lat * 1e6:.2f} us ({PING_BYTES} B), "
            f"bandwidth {bw / 1e9:.2f} GB/s ({BANDWIDTH_BYTES // 2**20} MiB)"
            for peer, lat, bw in results]


def doctor() -> int:
    """Entry point of `mpilb doctor` on every rank; rank 0 prints. Returns the exit code."""
    from mpilb import __version__
    from mpilb.mpi import comm as C
    from mpilb.mpi import cores
    from mpilb.mpi import doorbell

    comm, rank, size = C.world()
    facts = comm.gather(_rank_facts(comm), root=0)
    nodes = C.nodes(comm)
    bell = doorbell.open_job(comm, rank, size)
    spins = cores.start_waits(comm)
    seconds = min(PAIR_SECONDS, TOTAL_PING_SECONDS / max(1, size - 1))
    results = ping_pong(comm, seconds) if size > 1 else []
    if rank != 0:
        return 0

    import h5py

    out = Findings()
    info = C.mpi_info()
    job = launch()
    launcher, launched = job.name, job.size
    _check_mpi(info, size, launcher, launched, out)
    mpi4py = mpi4py_line(info)
    _check_build(mpi4py, launcher, out)
    if h5py.version.hdf5_built_version_tuple != h5py.version.hdf5_version_tuple:
        out.warn(f"h5py was built against HDF5 {'.'.join(map(str, h5py.version.hdf5_built_version_tuple))} "
                 f"but runs with {h5py.version.hdf5_version}: reinstall h5py for this HDF5")
    locking = _check_hdf5(out)
    cuda_aware = os.environ.get("MPILB_CUDA_AWARE", "") == "1"
    gpu_lines = _gpu_lines(facts, cuda_aware, out)
    workers = facts[1:] if size > 1 else facts
    cupy = facts[0]["cupy"] or next((f["cupy"] for f in workers if f["cupy"]), None)
    mpiexec = shutil.which("mpiexec")
    hosts = len({f["host"] for f in facts})

    rows = [
        ("mpilb", __version__),
        ("MPI library", " ".join(info["library"].splitlines()[0].split())),
        ("MPI standard", f"{info['standard']} (mpi4py compiled for {info['compiled_standard']})"),
        ("libmpi", info["libmpi"] or "unknown"),
        ("mpiexec on PATH", (mpiexec + ("" if not info["libmpi"] or same_installation(
            mpiexec, info["libmpi"], info["library"]) else " (another installation than libmpi)"))
            if mpiexec else "none"),
        ("launcher", launcher),
        ("world size", f"{size} rank(s) on {hosts} host(s)"),
        ("thread level", f"{info['thread_level']} (requested {info['thread_requested']})"),
        ("mpi4py", mpi4py),
        ("h5py", _version("h5py")),
        ("HDF5", h5py.version.hdf5_version),
        ("numpy", np.__version__),
        ("CuPy", cupy or "not installed"),
        ("HDF5 file locking", locking),
        ("CUDA-aware MPI", _cuda_aware_line(cuda_aware, {f["cuda_support"] for f in workers})),
        ("doorbells", _doorbell_line({r: bell.via(r) for r in bell.peers}, facts, out)),
        ("waits", _waits_line(spins)),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"mpilb doctor: {size} rank(s)")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print("GPUs:")
    for line in gpu_lines:
        print(f"  {line}")
    if size > 1:
        print("layout (with --servers 1):")
        for line in layout_section(nodes, [f["host"] for f in facts]):
            print(f"  {line}")
    print("ping-pong:")
    if results:
        for line in _format_pingpong(results):
            print(f"  {line}")
    else:
        print("  skipped: one rank (run `mpiexec -n 2 mpilb doctor` to measure the network)")
    if not (out.errors or out.warnings):
        print("no problems found")
    for text in out.errors:
        print(f"ERROR: {text}")
    for text in out.warnings:
        print(f"warning: {text}")
    return 1 if out.errors else 0
