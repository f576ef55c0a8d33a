"""benchmarks/plain_ps.py's plain exchange ends on its own and counts every worker's
exchanges, with one store and several, polling without pause and sleeping between polls
(on shared memory: the benchmark runs it over the box's links)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpirun import env, mpiexec

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plain_ps.py"


@pytest.mark.parametrize("stores, sleep", [("0", "0"), ("0,1,3", "0"), ("0,1", "0.0002")])
def test_plain_exchange_counts_every_worker_and_ends(stores, sleep):
    out = subprocess.run([mpiexec(), "-n", "5", sys.executable, str(SCRIPT), "--exchange",
                          "--stores", stores, "--params", "3000", "--seconds", "0.3",
                          "--sleep", sleep],
                         capture_output=True, text=True, timeout=60, env=env())
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    workers = {str(r) for r in range(5)} - set(stores.split(","))
    assert set(got["per_worker"]) == workers
    # hundreds a second each here; a worker whose answers were lost counts none
    assert all(rate > 10 for rate in got["per_worker"].values()), got
    assert got["updates_per_s"] == pytest.approx(sum(got["per_worker"].values()))
