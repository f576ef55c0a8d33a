"""Job templates (jobs/): every one parses, and every sbatch template runs end to end on this
machine through the Slurm test shim (tests/shim: sbatch, srun and scontrol over mpiexec),
asserting on the run logs the jobs write."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import h5py
import pytest

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "jobs"
SHIM = ROOT / "tests" / "shim"
SBATCH_TEMPLATES = sorted((JOBS / "slurm").glob("*.sbatch"))
TEMPLATES = SBATCH_TEMPLATES + sorted((JOBS / "mpirun").glob("*.sh"))
TIMEOUT = 120
TRAIN = ["--model", "mlp", "--hidden", "16", "--epochs", "1", "--seed", "1"]


def shim_env(tmp_path: Path, **extra) -> dict:
    """This machine's environment as a job would see it: the shims first on PATH, then the
    Python that runs the tests (for `mpilb`, `mpiexec` and `python3`); no SLURM_* variables
    leaking in from a real job around the test run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_", "MPILB_"))}
    dirs = [str(SHIM), sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    env["PATH"] = os.pathsep.join(dirs + [env.get("PATH", "")])
    env["SLURM_SHIM_STATE"] = str(tmp_path / "slurm")
    env["MPILB_CACHE"] = str(tmp_path / "cache")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(cmd, tmp_path: Path, env: dict) -> subprocess.Popen:
    """Start a job in a session of its own, so that it can be ended with everything it started."""
    return subprocess.Popen([str(c) for c in cmd], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Wait for a job; past the timeout kill its whole process group (a hang is a failure)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        if proc.poll() is None:   # an exception (e.g. KeyboardInterrupt) while waiting
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(cmd, tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    return finish(start(cmd, tmp_path, env))


def sbatch(tmp_path: Path, *args, **env) -> tuple[subprocess.CompletedProcess, str]:
    """Run `sbatch ARGS` through the shim; returns (process, job id)."""
    proc = run([SHIM / "sbatch", *args], tmp_path, shim_env(tmp_path, **env))
    job_id = next((line.split()[-1] for line in proc.stderr.splitlines()
                   if line.startswith("Submitted batch job")), None)
    assert job_id, proc.stderr
    return proc, job_id


def run_log(path: Path) -> dict:
    """Root attributes of a run log, config and summary decoded."""
    with h5py.File(path, "r") as f:
        attrs = dict(f.attrs)
        attrs["config"] = json.loads(attrs["config"])
        if "summary" in f:
            attrs["summary"] = json.loads(f["summary"].attrs["json"])
    return attrs


def assert_finished(log: Path, world_size: int, proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    attrs = run_log(log)
    assert attrs["status"] == "finished"
    assert attrs["world_size"] == world_size
    coverage = attrs["summary"]["coverage"]
    assert coverage["missing"] == 0 and coverage["duplicates"] == 0
    assert coverage["applied"] == coverage["expected"] > 0
    return attrs


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    """scikit-learn's digits as an mpilb dataset, made with the command users run."""
    out = tmp_path_factory.mktemp("jobs-data") / "digits"
    env = shim_env(out.parent)
    subprocess.run(["mpilb", "prepare", "digits", str(out), "--shards", "4"], env=env,
                   check=True, capture_output=True, timeout=TIMEOUT)
    return out


# ---------------------------------------------------------------- static checks

@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.relative_to(JOBS).as_posix())
def test_template_parses(template):
    proc = subprocess.run(["bash", "-n", str(template)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert os.access(template, os.X_OK), f"{template} is not executable"


@pytest.mark.parametrize("template", SBATCH_TEMPLATES, ids=lambda p: p.name)
def test_sbatch_template_uses_pmix_and_explains_pmi2(template):
    text = template.read_text()
    assert 'srun --mpi="${MPILB_SRUN_MPI:-pmix}"' in text or 'mpi=${MPILB_SRUN_MPI:-pmix}' in text
    assert "pmi2" in text
    assert "HDF5_USE_FILE_LOCKING" in text


# ---------------------------------------------------------------- the shim itself

def test_sbatch_shim_requeue_reruns_the_script(tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks=3\n#SBATCH --requeue\n"
        'echo "start ${SLURM_RESTART_COUNT:-0} $SLURM_JOB_ID $SLURM_NTASKS $SLURM_TASKS_PER_NODE '
        '$SLURM_SUBMIT_DIR $TMPDIR $0 $*"\n'
        'if [[ -z ${SLURM_RESTART_COUNT:-} ]]; then scontrol requeue "$SLURM_JOB_ID"; exit 0; fi\n'
        "exit 7\n")
    proc, job_id = sbatch(tmp_path, script, "a b", "c")
    assert proc.returncode == 7, proc.stderr
    starts = [line.split() for line in proc.stdout.splitlines()]
    assert [s[1] for s in starts] == ["0", "1"]
    for s in starts:
        assert s[2:6] == [job_id, "3", "2,1", str(tmp_path)]
        assert s[6].startswith(str(tmp_path / "slurm")) and s[7] != str(script)
        assert s[8:] == ["a", "b", "c"]
    log = (tmp_path / "slurm" / "requeue.log").read_text().split()
    assert log[0] == job_id and len(log) == 2


def test_sbatch_shim_rejects_unknown_options(tmp_path):
    script = tmp_path / "bad.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --no-such-option=1\necho ran\n")
    proc = run([SHIM / "sbatch", script], tmp_path, shim_env(tmp_path))
    assert proc.returncode == 1
    assert "unknown option --no-such-option" in proc.stderr and "ran" not in proc.stdout


def _tasks(proc: subprocess.CompletedProcess, out: Path) -> list[dict]:
    """The variables each task of a step wrote to OUT/<SLURM_PROCID>.json, in rank order."""
    assert proc.returncode == 0, proc.stderr
    files = sorted(out.glob("*.json"), key=lambda p: int(p.stem))
    tasks = [json.loads(p.read_text()) for p in files]
    for p in files:
        p.unlink()
    return tasks


@pytest.mark.mpi
def test_srun_shim_sets_task_variables_and_joins_components(tmp_path):
    show = [sys.executable, "-c",
            "import os, json, sys; keys = ('SLURM_PROCID', 'SLURM_LOCALID', 'SLURM_NODEID', "
            "'SLURM_NTASKS', 'SLURM_STEP_ID', 'PMI_SIZE', 'SLURM_MPI_TYPE', 'SHIMSLURM_NTASKS'); "
            "open(os.path.join(sys.argv[1], os.environ['SLURM_PROCID'] + '.json'), 'w').write("
            "json.dumps({k: os.environ.get(k) for k in keys}))", str(tmp_path)]
    env = shim_env(tmp_path)
    tasks = _tasks(run([SHIM / "srun", "--mpi=pmix", "-N", "2", "-n", "5", *show], tmp_path, env),
                   tmp_path)
    assert [t["SLURM_PROCID"] for t in tasks] == ["0", "1", "2", "3", "4"]
    assert [t["SLURM_NODEID"] for t in tasks] == ["0", "0", "0", "1", "1"]
    assert [t["SLURM_LOCALID"] for t in tasks] == ["0", "1", "2", "0", "1"]
    assert {t["SLURM_NTASKS"] for t in tasks} == {t["PMI_SIZE"] for t in tasks} == {"5"}
    assert {t["SLURM_MPI_TYPE"] for t in tasks} == {"pmix"}
    assert {t["SHIMSLURM_NTASKS"] for t in tasks} == {None}
    # Heterogeneous step: one MPI world, ranks numbered through the components, own nodes.
    tasks = _tasks(run([SHIM / "srun", "-n", "1", *show, ":", "-n", "2", *show], tmp_path, env),
                   tmp_path)
    assert [(t["SLURM_PROCID"], t["SLURM_NODEID"], t["SLURM_LOCALID"]) for t in tasks] == [
        ("0", "0", "0"), ("1", "1", "0"), ("2", "1", "1")]
    assert {t["PMI_SIZE"] for t in tasks} == {"3"}
    assert {t["SLURM_STEP_ID"] for t in tasks} == {"0"}   # srun outside a job: a job of its own


# ---------------------------------------------------------------- templates end to end

@pytest.mark.mpi
def test_train_cpu(tmp_path, digits):
    proc, job = sbatch(tmp_path, "--nodes=2", "--ntasks-per-node=2",
                       JOBS / "slurm/train_cpu.sbatch", "--data", digits, *TRAIN)
    attrs = assert_finished(tmp_path / f"mpilb-{job}.h5", 4, proc)
    assert attrs["config"]["device"] == "cpu"
    # the job's output shows the run going on (no --no-progress), at the batch interval
    assert re.search(r"^mpilb \[\s*0\.0 s\] epoch 1/1, 0/\d+ samples, training started$",
                     proc.stderr, re.M), proc.stderr
    assert attrs["config"]["progress"] and attrs["config"]["progress_interval"] is None


def test_no_template_silences_progress():
    for template in SBATCH_TEMPLATES:
        assert "--no-progress" not in re.sub(r"#.*", "", template.read_text()), template.name


@pytest.mark.mpi
def test_train_gpu_falls_back_to_cpu(tmp_path, digits):
    # 2 GPUs per node + rank 0 = 3 tasks: the layout the template asks for, so no warning.
    proc, job = sbatch(tmp_path, "--gpus-per-node=2", "--ntasks=3",
                       JOBS / "slurm/train_gpu.sbatch", *TRAIN,
                       MPILB_DATA=digits, MPILB_DEVICE="auto")
    attrs = assert_finished(tmp_path / f"mpilb-{job}.h5", 3, proc)
    assert attrs["config"]["device"] == "auto"
    assert "warning" not in proc.stderr


@pytest.mark.mpi
def test_train_gpu_warns_when_workers_do_not_match_gpus(tmp_path, digits):
    proc, job = sbatch(tmp_path, "--gpus-per-node=4", "--ntasks=3",
                       JOBS / "slurm/train_gpu.sbatch", *TRAIN,
                       MPILB_DATA=digits, MPILB_DEVICE="cpu")
    assert_finished(tmp_path / f"mpilb-{job}.h5", 3, proc)
    assert "one worker per GPU needs --ntasks=5" in proc.stderr


@pytest.mark.mpi
def test_hetjob_is_one_mpi_world(tmp_path, digits):
    # The template as users get it, with the GPU group shrunk to two workers on one node.
    text = (JOBS / "slurm/hetjob.sbatch").read_text()
    small = text.replace("#SBATCH --nodes=2\n", "#SBATCH --nodes=1\n").replace(
        "#SBATCH --ntasks-per-node=4\n", "#SBATCH --ntasks-per-node=2\n")
    assert small != text
    script = tmp_path / "hetjob.sbatch"
    script.write_text(small)
    proc, job = sbatch(tmp_path, script, "--data", digits, *TRAIN, MPILB_DEVICE="cpu")
    # Two separate worlds would each have failed the engine's start-up (a world of 1 trains
    # serially and a world of 2 has no server for the other component).
    assert_finished(tmp_path / f"mpilb-{job}.h5", 3, proc)
    assert "rank 0 on node00, 2 workers on node01" in proc.stdout


@pytest.mark.mpi
def test_stage_local_trains_from_node_local_copies(tmp_path, digits):
    proc, job = sbatch(tmp_path, "--nodes=2", "--ntasks-per-node=2",
                       JOBS / "slurm/stage_local.sbatch", *TRAIN, MPILB_DATA=digits)
    attrs = assert_finished(tmp_path / f"mpilb-{job}.h5", 4, proc)
    stage_root = tmp_path / "slurm" / f"job-{job}" / "tmp" / f"mpilb-{job}"
    assert attrs["config"]["data"] == str(stage_root / "digits")
    assert attrs["config"]["store"] == "local"
    staged = re.findall(r"^mpilb: staged \S+ to (node\d+):", proc.stdout, re.M)
    assert sorted(staged) == ["node00", "node01"]
    assert not stage_root.exists(), "the staged copies were not removed"


def test_stage_local_needs_a_dataset(tmp_path):
    proc, _ = sbatch(tmp_path, "--nodes=1", "--ntasks=2", JOBS / "slurm/stage_local.sbatch", *TRAIN)
    assert proc.returncode == 2
    assert "set MPILB_DATA or pass --data DIR" in proc.stderr


@pytest.mark.mpi
def test_requeue_checkpoints_on_usr1_and_resumes(tmp_path, digits):
    epochs = 20
    cmd = [SHIM / "sbatch", "--ntasks=3", JOBS / "slurm/requeue.sbatch", "--data", digits,
           "--model", "mlp", "--hidden", "16", "--epochs", epochs, "--seed", "1",
           "--inject", "*:delay=0.01", "--checkpoint-interval", "0.5"]
    proc = start(cmd, tmp_path, shim_env(tmp_path))
    # Slurm's --signal=B:USR1@120 goes to the batch shell once training is under way; the
    # sbatch shim hands it to the batch shell.
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("mpilb-*.ckpt.h5")) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    done = finish(proc)
    out, err = done.stdout, done.stderr
    assert proc.returncode == 0, out + err
    job = next(tmp_path.glob("mpilb-*.ckpt.h5")).name.split("-")[1].split(".")[0]
    assert (tmp_path / "slurm" / "requeue.log").read_text().split()[0] == job
    assert f"job {job} preempted at start 0" in out
    assert "--resume" not in out.split(f"job {job} start 1:")[0]
    assert "--resume" in out.split(f"job {job} start 1:")[1]
    # One log for the job: the resumed run continued it to the end of the last epoch.
    attrs = assert_finished(tmp_path / f"mpilb-{job}.h5", 3, done)
    assert attrs["resumed"] == 1
    assert attrs["summary"]["epochs_completed"] == epochs
    assert f"job {job} start 1 ended: exit code 0, run status finished" in out


@pytest.mark.mpi
def test_local_sh(tmp_path, digits):
    log = tmp_path / "local.h5"
    env = shim_env(tmp_path, MPILB_NP=3, MPILB_DATA=digits)
    proc = run([JOBS / "mpirun/local.sh", *TRAIN, "--log", log, "--no-progress"], tmp_path, env)
    attrs = assert_finished(log, 3, proc)
    assert attrs["config"]["device"] == "auto"


@pytest.mark.mpi
def test_join_grows_a_running_job_from_a_second_job(tmp_path, digits):
    """train_cpu.sbatch runs; join.sbatch --ntasks=2, a second job, adds two workers to it
    (ids 3 and 4): both jobs exit 0, the run finishes with exact coverage and members/ holds
    the two joins."""
    env = shim_env(tmp_path)
    train = start([SHIM / "sbatch", "--nodes=1", "--ntasks=3", JOBS / "slurm/train_cpu.sbatch",
                   "--data", digits, "--model", "mlp", "--hidden", "16", "--epochs", "150",
                   "--seed", "1", "--no-progress", "--log", tmp_path / "run.h5",
                   # its workers sleep 3 ms a step, so that the run (~22 steps a worker an
                   # epoch: at least ~10 s) outlives the second job's start on a fast machine
                   # too (unpaced it ended first there: "the run has ended", exit 2)
                   "--inject", "*:delay=0.003"], tmp_path, env)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not _holds_updates(tmp_path / "run.h5"):
            assert train.poll() is None and time.monotonic() < deadline, train.communicate()
            time.sleep(0.2)
        join = run([SHIM / "sbatch", "--ntasks=2", JOBS / "slurm/join.sbatch", tmp_path / "run.h5"],
                   tmp_path, env)
    finally:
        proc = finish(train, timeout=TIMEOUT * 3)
    assert join.returncode == 0, join.stdout + join.stderr
    assert join.stderr.count("joined as worker") == 2, join.stderr
    attrs = assert_finished(tmp_path / "run.h5", 3, proc)
    from mpilb.runfiles.runlog import read_columns
    members = read_columns(str(tmp_path / "run.h5"))[1]["members"]
    assert sorted(members["worker"]) == [3, 4]
    assert {3, 4} <= {w["rank"] for w in attrs["summary"]["per_worker"]}


def _holds_updates(log: Path) -> bool:
    from mpilb.runfiles.runlog import holds_updates
    return log.exists() and holds_updates(str(log))
