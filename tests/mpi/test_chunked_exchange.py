"""benchmarks/chunked_exchange.py's exchange loop ends on its own and counts exchanges, in both
layouts and both ways of answering (on shared memory: the box runs it over its links)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpirun import env, mpiexec

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "chunked_exchange.py"


@pytest.mark.parametrize("ranks, servers, chunks, way", [
    (5, "0", 1, "each"),
    (5, "0", 4, "each"),
    (6, "0,2,4", 3, "each"),
    (6, "0,2,4", 3, "whole"),
    (5, "0", 3, "serial"),
    (6, "0,2,4", 3, "serial"),
])
def test_exchange_loop_counts_and_ends(ranks, servers, chunks, way):
    out = subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPT), "_loop",
                          "3000", str(chunks), "0.3", servers, way],
                         capture_output=True, text=True, timeout=60, env=env())
    assert out.returncode == 0, out.stderr[-2000:]
    rate = json.loads(out.stdout.strip().splitlines()[-1])["exchanges_per_s"]
    assert rate > 10   # thousands a second here; a loop that lost its answers counts none
