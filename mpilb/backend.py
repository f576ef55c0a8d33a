"""Array backend: NumPy on the CPU, CuPy on a GPU.

This is the only module that imports cupy, and only lazily, so mpilb runs without it.
Array code elsewhere follows the ``xp`` idiom: ``xp = get_array_module(a)``.
"""

from __future__ import annotations

import functools
import types

import numpy as np

from mpilb.errors import UsageError

DEVICES = ("auto", "cpu", "gpu")


@functools.lru_cache(maxsize=1)
def cupy_module() -> types.ModuleType | None:
    """Return the cupy module if it can be imported, else None (cached)."""
    try:
        import cupy  # noqa: PLC0415 - optional dependency, imported only here
    except Exception:  # ImportError, but also broken CUDA installs raising at import
        return None
    return cupy


def gpu_count() -> int:
    """Number of visible CUDA devices; 0 without cupy or without a GPU. Never raises."""
    cupy = cupy_module()
    if cupy is None:
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, no device, CUDA_VISIBLE_DEVICES="" ...
        return 0


def get_array_module(a) -> types.ModuleType:
    """The array module (numpy or cupy) that ``a`` belongs to."""
    cupy = cupy_module()
    if cupy is None:
        return np
    return cupy.get_array_module(a)


class Backend:
    """Where a rank's arrays live: ``name`` is "cpu" or "gpu", ``xp`` numpy or cupy."""

    def __init__(self, name: str, xp: types.ModuleType, device_id: int | None = None):
        self.name = name
        self.xp = xp
        self.device_id = device_id

    def __repr__(self) -> str:
        dev = "" if self.device_id is None else f", device_id={self.device_id}"
        return f"Backend({self.name!r}{dev})"

    def asarray(self, a, dtype=None):
        """Host (or backend) array -> backend array; no copy on the cpu when dtypes match."""
        return self.xp.asarray(a, dtype=dtype)

    def to_host(self, a, out: np.ndarray | None = None) -> np.ndarray:
        """Copy a backend array to host memory, into ``out`` (e.g. a pinned buffer) if given."""
        if self.name == "cpu":
            if out is None:
                return np.asarray(a)
            np.copyto(out, a, casting="same_kind")
            return out
        if out is None:
            return self.xp.asnumpy(a)
        a.get(out=out)
        return out

    def synchronize(self) -> None:
        """Wait for queued device work (needed before MPI touches device memory)."""
        if self.name == "gpu":
            self.xp.cuda.get_current_stream().synchronize()

    def empty_host(self, n_bytes: int) -> np.ndarray:
        """Uninitialised host buffer of ``n_bytes`` uint8; pinned on the gpu for fast copies."""
        if self.name == "gpu":
            import cupyx  # noqa: PLC0415 - ships with cupy

            return cupyx.empty_pinned((n_bytes,), dtype=np.uint8)
        return np.empty(n_bytes, dtype=np.uint8)


def select_backend(device: str, local_rank: int = 0) -> Backend:
    """Choose the backend for a rank.

    Args:
        device: "auto" (gpu when one is visible, else cpu), "cpu" or "gpu".
        local_rank: rank on this node; the gpu used is ``local_rank % gpu_count()``.

    Raises:
        UsageError: unknown device, or "gpu" without cupy or without a visible GPU.
    """
    if device not in DEVICES:
        raise UsageError(f"--device {device!r}: expected one of {', '.join(DEVICES)}")
    if device == "cpu":
        return Backend("cpu", np)
    n_gpus = gpu_count()
    if device == "auto" and n_gpus == 0:
        return Backend("cpu", np)
    cupy = cupy_module()
    if cupy is None:
        raise UsageError(
            "--device gpu: CuPy is not installed; pip install 'mpilb[gpu]' or use --device cpu"
        )
    if n_gpus == 0:
        raise UsageError("--device gpu: no CUDA GPU is visible on this node; use --device cpu")
    device_id = local_rank % n_gpus
    cupy.cuda.Device(device_id).use()
    return Backend("gpu", cupy, device_id)
