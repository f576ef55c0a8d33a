"""--respawn: a lost worker is replaced by a process rank 0 spawns (MPI_Comm_spawn), admitted
as a joiner is; where the launcher cannot spawn, one line and the run goes on as without it
(docs/membership.md, "Replacing a lost worker")."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import pytest

import mpirun
from mpilb.runfiles.runlog import read_columns
from mpilb.runfiles.summary import summarize_log
from test_survival import SHIM, assert_degraded_exact, finish, launch, supervised_ranks, train

pytestmark = pytest.mark.mpi


def members(log) -> list[tuple[float, int, int, str]]:
    """(t, worker, node, event) of every `members/` row."""
    _, cols = read_columns(str(log))
    m = cols["members"]
    return [(float(t), int(w), int(n), e.decode() if isinstance(e, bytes) else str(e))
            for t, w, n, e in zip(m["t"], m["worker"], m["node"], m["event"])]


def test_a_worker_killed_by_sigkill_is_replaced(synth_dir, tmp_path):
    """4 workers, rank 2 SIGKILLed once training runs: declared lost after --worker-timeout,
    a replacement (worker 5) spawned on its host and admitted; its first push is applied
    within 5 s of the loss; it rings rank 0 with its pushes as a joiner does (the run log's
    `doorbells`: via local, rings counted; before, it had no doorbell and rank 0 polled
    while it worked); exit 3, `degraded` (a worker was lost), exact coverage."""
    import json

    timeout, epochs = 3, 40   # long enough for the replacement's pushes on a quiet machine
    cmd = [mpirun.mpiexec(), "-disable-auto-cleanup", "-n", "5", sys.executable, "-m", "mpilb",
           *train(synth_dir, tmp_path, "--epochs", epochs, "--worker-timeout", timeout,
                  "--survive-signals", "--respawn")]
    proc = launch(cmd, tmp_path)
    pids = supervised_ranks(proc, 5)
    mpirun.wait_training(tmp_path / "run.h5", proc)
    os.kill(pids[2], signal.SIGKILL)
    code, out, err = finish(proc, timeout=180)
    assert code == 3, (code, out, err)
    assert "a replacement for rank 2 started" in err and "worker 5 replaces rank 2" in err, err
    rows = members(tmp_path / "run.h5")
    assert [(w, e) for _, w, _, e in rows] == [(2, "lost"), (5, "respawn")], rows
    (t_lost, _, node_lost, _), (t_new, _, node_new, _) = rows
    assert node_new == 0 and t_new >= t_lost   # rank 2's node (one node here)
    u = read_columns(str(tmp_path / "run.h5"))[1]["updates"]
    mine = np.asarray(u["t"])[np.asarray(u["worker"]) == 5]
    assert len(mine) > 0, "the replacement's pushes were never applied"
    assert mine.min() - t_lost < 5.0, (t_lost, t_new, mine.min())
    assert_degraded_exact(tmp_path, synth_dir, epochs)
    per_worker = {w["rank"]: w["samples"] for w in summarize_log(str(tmp_path / "run.h5"))["per_worker"]}
    assert per_worker.get(5, 0) > 0, per_worker
    bells = json.loads(read_columns(str(tmp_path / "run.h5"))[0]["doorbells"])
    assert bells.get("5", {}).get("via") == "local" and bells["5"]["rings"] > 0, bells


def test_respawn_under_srun_says_it_cannot_and_the_run_goes_on(synth_dir, tmp_path):
    """Under srun (the test shim's) --respawn is refused at start-up with one line; a worker
    that crashes is then lost as without --respawn: exit 3, degraded, no replacement."""
    args = train(synth_dir, tmp_path, "--epochs", 12, "--inject", "2:crash@0.3",
                 "--worker-timeout", 3, "--respawn")
    cmd = [os.path.join(SHIM, "srun"), "--no-kill", "-n", "4", sys.executable, "-m", "mpilb", *args]
    env = mpirun.env(SLURM_SHIM_STATE=tmp_path / "slurm")
    env["PATH"] = os.pathsep.join([SHIM, env["PATH"]])
    code, out, err = finish(launch(cmd, tmp_path, env), timeout=120)
    assert code == 3, (code, out, err)
    said = [line for line in err.splitlines() if line.startswith("mpilb: --respawn:")]
    assert len(said) == 1 and "srun cannot spawn" in said[0] and "goes on" in said[0], err
    assert [(w, e) for _, w, _, e in members(tmp_path / "run.h5")] == [(2, "lost")]
    assert_degraded_exact(tmp_path, synth_dir, 12)


def test_respawn_refuses_sync_mode(synth_dir, tmp_path):
    r = mpirun.run(3, *train(synth_dir, tmp_path, "--epochs", 1, "--mode", "sync", "--respawn"),
                   timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--respawn cannot be combined with --mode sync" in lines[0], r.stderr
