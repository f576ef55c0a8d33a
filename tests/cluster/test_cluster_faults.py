"""Faults that need nodes: a parameter store whose node's link goes down ends the job with
one line naming it within --worker-timeout + 10 s (it hung for minutes before, still hung 4
minutes after the link came back)."""

from __future__ import annotations

import subprocess
import sys
import time

import h5py
import pytest

from mpilb.clusterbox import ClusterBox, missing

WHY = missing()
pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(WHY is not None, reason=f"no cluster box here: {WHY}")]


def test_a_store_whose_link_goes_down_ends_the_job_naming_it(tmp_path, digits_dir):
    log = tmp_path / "run.h5"
    with ClusterBox(nodes=3, link_rate="1gbit") as box:
        # rank 0 and a store on n0 and n1 (the lowest rank of each), workers on n1 and n2
        proc = box.popen(0, box.mpiexec_cmd(
            ["-hosts", "n0:1,n1:2,n2:2", sys.executable, "-m", "mpilb", "train",
             "--data", digits_dir, "--hidden", "32", "--epochs", "5000", "--servers", "2",
             "--worker-timeout", "5", "--no-progress", "--log", str(log)]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 90
        while not log.exists() or log.stat().st_size < 20000:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        time.sleep(1.0)
        assert box.run(1, ["ip", "link", "set", "eth0", "down"], timeout=10).returncode == 0
        t0 = time.monotonic()
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            box.run(1, ["ip", "link", "set", "eth0", "up"], timeout=10)
            if proc.poll() is None:
                proc.kill()
        took = time.monotonic() - t0
    assert proc.returncode == 1, err
    assert took < 5 + 10, took
    assert "mpilb: error: rank 1 (a parameter store) did not answer" in err, err
    with h5py.File(log, "r") as f:
        assert f.attrs["status"] == "failed"
