"""Start-up under mpiexec: any failure on any rank is one line and a prompt end of the job;
log and checkpoint names that would destroy a file are refused (docs/logs.md)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time

import pytest

import mpirun
from mpilb.errors import UsageError

pytestmark = pytest.mark.mpi


def lines_of(res):
    return [l for l in (res.stdout + res.stderr).splitlines() if l.strip()]


def one_error(res, code, needle):
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    lines = lines_of(res)
    assert len(lines) == 1, lines
    assert lines[0].startswith("mpilb: error: ") and needle in lines[0], lines[0]


def test_non_utf8_toml_is_one_line_exit_2(tmp_path, digits_dir):
    cfg = tmp_path / "bad.toml"
    cfg.write_bytes(b'data = "d"  # f\xfcr\n')
    t0 = time.monotonic()
    res = mpirun.run(4, "train", str(cfg), "--no-progress", timeout=60, cwd=tmp_path)
    assert time.monotonic() - t0 < 30
    one_error(res, 2, "UTF-8")


@pytest.mark.parametrize("where", ["file-parent", "sys"])
def test_unwritable_cache_is_one_line_exit_2(tmp_path, where):
    if where == "sys":
        cache = "/sys/mpilb-cache-test"
        if os.access("/sys", os.W_OK) and not os.path.ismount("/sys"):
            pytest.skip("/sys is writable here")
    else:
        (tmp_path / "afile").write_text("not a directory")
        cache = str(tmp_path / "afile" / "cache")
    res = mpirun.run(4, "train", "--epochs", "1", "--no-progress", timeout=60, cwd=tmp_path,
                     MPILB_CACHE=cache)
    one_error(res, 2, "MPILB_CACHE")


FAULTY = textwrap.dedent("""
    import sys
    rank_to_fail, where = int(sys.argv.pop(1)), sys.argv.pop(1)
    from mpilb.mpi import comm
    from mpilb.cli import launch
    from mpilb.worker import loop as worker
    if comm.world()[1] == rank_to_fail:
        def boom(*a, **k):
            raise ZeroDivisionError("injected start-up failure")
        if where == "validate":
            launch._validate = boom
        else:
            worker.Worker.__init__ = boom
    from mpilb.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("rank,where", [(0, "validate"), (2, "setup")])
def test_any_exception_at_start_up_ends_the_job(tmp_path, digits_dir, rank, where):
    """Not a UsageError, not an MpilbError: before, rank 0's left the others spinning."""
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY)
    cmd = [mpirun.mpiexec(), "-n", "4", sys.executable, str(script), str(rank), where,
           "train", "--data", digits_dir, "--epochs", "1", "--no-progress",
           "--log", str(tmp_path / "run.h5")]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=mpirun.env())
    assert time.monotonic() - t0 < 30
    one_error(res, 1, f"rank {rank}: ZeroDivisionError: injected start-up failure")


def test_mpmd_with_different_options_is_a_config_error(tmp_path, digits_dir):
    base = [sys.executable, "-m", "mpilb", "train", "--data", digits_dir, "--epochs", "1",
            "--no-progress", "--log", str(tmp_path / "run.h5")]
    cmd = [mpirun.mpiexec(), "-n", "1", *base, "--hidden", "64", ":", "-n", "3", *base,
           "--hidden", "32"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=mpirun.env())
    one_error(res, 2, "rank 1 was started with other options than rank 0 (--hidden '32' vs '64')")


# ------------------------------------------------------------------ log and checkpoint names

def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_default_log_is_a_new_numbered_file_with_its_checkpoint(tmp_path, digits_dir):
    for n in (1, 2):
        res = mpirun.run(4, "train", "--data", digits_dir, "--epochs", "1", "--hidden", "16",
                         "--no-progress", timeout=60, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        log, ck = f"runs/{n:03d}.h5", f"runs/{n:03d}.ckpt.h5"
        assert (tmp_path / log).exists() and (tmp_path / ck).exists()
        assert res.stdout.splitlines()[-1] == f"mpilb: log {log}, checkpoint {ck}"


def test_existing_log_is_refused_unchanged_unless_overwrite(tmp_path, digits_dir):
    log = tmp_path / "kept.h5"
    args = ["train", "--data", digits_dir, "--epochs", "1", "--hidden", "16", "--no-progress",
            "--log", str(log)]
    assert mpirun.run(4, *args, timeout=60).returncode == 0
    before = digest(log), digest(tmp_path / "kept.ckpt.h5")
    one_error(mpirun.run(4, *args, timeout=60), 2, f"--log {log} exists")
    assert (digest(log), digest(tmp_path / "kept.ckpt.h5")) == before
    res = mpirun.run(4, *args, "--overwrite", timeout=60)
    assert res.returncode == 0, res.stderr
    assert digest(log) != before[0]


@pytest.mark.parametrize("case", ["log-is-checkpoint", "log-is-shard", "checkpoint-is-shard",
                                  "checkpoint-is-test", "log-is-config"])
def test_log_checkpoint_and_data_must_be_distinct(tmp_path, digits_dir, case):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(digits_dir, data)
    shard, test = data / "shard-00000.h5", data / "test.h5"
    cfg = tmp_path / "run.toml"
    cfg.write_text("epochs = 1\n")
    log, ck = {"log-is-checkpoint": (tmp_path / "x.h5", tmp_path / "x.h5"),
               "log-is-shard": (shard, tmp_path / "ck.h5"),
               "checkpoint-is-shard": (tmp_path / "run.h5", data / "." / "shard-00000.h5"),
               "checkpoint-is-test": (tmp_path / "run.h5", test),
               "log-is-config": (cfg, tmp_path / "ck.h5")}[case]
    before = {p: digest(p) for p in (shard, test, cfg)}
    res = mpirun.run(4, "train", str(cfg), "--data", str(data), "--no-progress", "--log", str(log),
                     "--checkpoint", str(ck), "--overwrite", timeout=60)
    one_error(res, 2, "are the same file")
    assert {p: digest(p) for p in before} == before
    assert mpirun.run(0, "data", "verify", str(data)).returncode == 0


def test_second_writer_of_a_log_is_refused(tmp_path):
    from mpilb.runfiles.runlog import RunLog

    first = RunLog(str(tmp_path / "run.h5"), {})
    with pytest.raises(UsageError, match="another mpilb run is writing this log"):
        RunLog(str(tmp_path / "run.h5"), {})
    first.close("finished")
    first.write_summary({})   # releases the lock
    RunLog(str(tmp_path / "run.h5"), {}).close("finished")


# ------------------------------------------------------------------ the wrapper itself (no MPI)

class FakeComm:
    """allgather as if the other ranks had reported `others`."""

    def __init__(self, rank, others):
        self.rank, self.others = rank, others

    class Done:
        def Test(self):
            return True

    def Ibarrier(self):   # (the others arrived)
        return self.Done()

    def allgather(self, mine):
        out = list(self.others)
        out.insert(self.rank, mine)
        return out


@pytest.mark.parametrize("exc,code", [(UsageError("bad"), 2), (RuntimeError("x"), 1),
                                      (UnicodeDecodeError("utf-8", b"\xfc", 0, 1, "no"), 1),
                                      (KeyboardInterrupt(), 130), (SystemExit(5), 1)])
def test_together_turns_any_exception_into_one_verdict(exc, code):
    from mpilb.cli.launch import JobStop, together

    def step():
        raise exc

    with pytest.raises(JobStop) as info:
        together(FakeComm(0, [None, None]), 0, step)
    assert info.value.code == code
    # the other ranks, whose own step succeeded, stop with rank 0's verdict
    released = []
    with pytest.raises(JobStop) as other:
        together(FakeComm(1, [(info.value.code, info.value.text), None]), 1, lambda: "role",
                 on_fail=released.append)
    assert (other.value.code, other.value.text) == (info.value.code, info.value.text)
    assert released == ["role"]
    assert together(FakeComm(0, [None]), 0, lambda: 42) == 42
