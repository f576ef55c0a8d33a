"""The names users import from `mpilb` itself (docs/models.md, docs/logs.md) stay there
whatever package holds them, and `import mpilb` loads none of the machinery."""

import subprocess
import sys

import mpilb


def test_the_run_log_readers_are_public_names():
    from mpilb.runfiles import runlog

    assert mpilb.read_log is runlog.read and mpilb.read_columns is runlog.read_columns
    for name in mpilb.__all__:
        assert getattr(mpilb, name) is not None, name


def test_importing_mpilb_loads_no_numpy_nor_mpi():
    code = "import sys, mpilb; print(sorted(m for m in ('numpy', 'mpi4py', 'h5py') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
