"""Unit tests for mpilb.backend (the cpu path; gpu selection with cupy/gpu_count mocked)."""

import numpy as np
import pytest

from mpilb import backend
from mpilb.errors import UsageError


def test_cpu_backend_round_trip():
    be = backend.select_backend("cpu", local_rank=3)
    assert (be.name, be.xp, be.device_id) == ("cpu", np, None)
    host = np.arange(6, dtype=np.float32)
    dev = be.asarray(host)
    assert dev is host or np.shares_memory(dev, host)  # no copy on the cpu
    assert be.asarray(host, dtype=np.float64).dtype == np.float64
    out = np.zeros(6, dtype=np.float32)
    assert be.to_host(dev, out=out) is out
    np.testing.assert_array_equal(out, host)
    np.testing.assert_array_equal(be.to_host(dev), host)
    be.synchronize()
    buf = be.empty_host(128)
    assert buf.dtype == np.uint8 and buf.shape == (128,)


def test_get_array_module_is_numpy_for_host_arrays():
    assert backend.get_array_module(np.zeros(3)) is np


def test_gpu_count_never_raises():
    assert backend.gpu_count() >= 0


def _fake_cupy(monkeypatch, present, n_gpus):
    class Device:
        def __init__(self, i):
            self.i = i

        def use(self):
            used.append(self.i)

    class FakeCupy:
        class cuda:
            pass

    FakeCupy.cuda.Device = Device
    used = []
    monkeypatch.setattr(backend, "cupy_module", lambda: FakeCupy if present else None)
    monkeypatch.setattr(backend, "gpu_count", lambda: n_gpus)
    return FakeCupy, used


def test_auto_falls_back_to_cpu_without_gpu(monkeypatch):
    _fake_cupy(monkeypatch, present=False, n_gpus=0)
    assert backend.select_backend("auto").name == "cpu"
    _fake_cupy(monkeypatch, present=True, n_gpus=0)
    assert backend.select_backend("auto").name == "cpu"


def test_auto_and_gpu_pick_local_rank_modulo_gpus(monkeypatch):
    fake, used = _fake_cupy(monkeypatch, present=True, n_gpus=4)
    be = backend.select_backend("auto", local_rank=6)
    assert (be.name, be.xp, be.device_id) == ("gpu", fake, 2)
    assert backend.select_backend("gpu", local_rank=1).device_id == 1
    assert used == [2, 1]


def test_gpu_without_cupy_says_how_to_install(monkeypatch):
    _fake_cupy(monkeypatch, present=False, n_gpus=0)
    with pytest.raises(UsageError, match=r"CuPy is not installed; pip install 'mpilb\[gpu\]'"):
        backend.select_backend("gpu")


def test_gpu_without_device(monkeypatch):
    _fake_cupy(monkeypatch, present=True, n_gpus=0)
    with pytest.raises(UsageError, match="no CUDA GPU is visible"):
        backend.select_backend("gpu")


def test_unknown_device():
    with pytest.raises(UsageError, match="auto, cpu, gpu"):
        backend.select_backend("tpu")
