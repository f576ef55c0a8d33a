"""The command line: prepare, data, serial train, report, and bad input (exit 2, one line)."""

import json
import shutil

import h5py
import pytest

import mpirun


def one_error_line(res):
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("mpilb: error: ")
    assert "Traceback" not in res.stderr
    return lines[0]


def test_prepare_verify_info(tmp_path):
    out = tmp_path / "d"
    res = mpirun.run(0, "prepare", "synthetic", out, "--samples", "600", "--features", "8",
                     "--classes", "3", "--shards", "3")
    assert res.returncode == 0, res.stderr
    assert mpirun.run(0, "data", "verify", out).returncode == 0
    info = mpirun.run(0, "data", "info", out)
    assert info.returncode == 0 and "shard" in info.stdout


def test_serial_training_writes_log_and_report(digits_dir, tmp_path):
    log = tmp_path / "serial.h5"
    res = mpirun.run(0, "train", "--data", digits_dir, "--model", "mlp", "--hidden", "64",
                     "--epochs", "20", "--no-progress", "--log", log)
    assert res.returncode == 0, res.stderr
    rep = mpirun.run(0, "report", log, "--json")
    s = json.loads(rep.stdout)
    assert s["status"] == "finished" and s["workers"] == 1
    assert s["final_test_accuracy"] >= 0.95
    cov = s["coverage"]
    assert cov["applied"] == cov["expected"] == 20 * 1438 and cov["duplicates"] == cov["missing"] == 0
    with h5py.File(log, "r") as f:
        for attr in ("mpilb_version", "config", "mpi_library", "world_size", "hostnames",
                     "start_time", "status", "cpus"):
            assert attr in f.attrs
        cpus = json.loads(f.attrs["cpus"])   # what replays model shared cores with
        assert len(cpus) == 1 and cpus[0] >= 1
        for group in ("updates", "workers", "eval", "shards", "epochs"):
            assert group in f
        assert json.loads(f["summary"].attrs["json"]) == s
        assert len(f["epochs/epoch"]) == 20


def test_target_accuracy_and_max_seconds_stop(digits_dir, tmp_path):
    log = tmp_path / "t.h5"
    res = mpirun.run(0, "train", "--data", digits_dir, "--model", "softmax", "--epochs", "50",
                     "--target-accuracy", "0.9", "--eval-interval", "0.05", "--no-progress", "--log", log)
    assert res.returncode == 0, res.stderr
    s = json.loads(mpirun.run(0, "report", log, "--json").stdout)
    assert s["time_to_target_s"] is not None and s["epochs_completed"] < 50
    assert s["best_test_accuracy"] >= 0.9


@pytest.fixture
def broken_digits(digits_dir, tmp_path):
    def make():
        dst = tmp_path / "broken"
        shutil.copytree(digits_dir, dst)
        return dst
    return make


def test_checksum_mismatch_names_the_file(broken_digits, tmp_path):
    d = broken_digits()
    with h5py.File(d / "shard-00002.h5", "r+") as f:
        f["x"][0, 0, 0, 0] = 0.5
    res = mpirun.run(0, "train", "--data", d, "--epochs", "1", "--log", tmp_path / "r.h5")
    assert res.returncode == 2
    assert "shard-00002.h5" in one_error_line(res) and "checksum" in res.stderr


def test_missing_shard(broken_digits, tmp_path):
    d = broken_digits()
    (d / "shard-00001.h5").unlink()
    res = mpirun.run(0, "data", "verify", d)
    assert res.returncode == 2 and "shard-00001.h5" in one_error_line(res)


@pytest.mark.parametrize("args,message", [
    (("train", "--lr", "-1"), "--lr"),
    (("train", "--batch", "0"), "--batch"),
    (("train", "--hidden", "12,-3"), "--hidden"),
    (("train", "--balancr", "load"), "balancr"),
    (("train", "--data", "/nonexistent/dir"), "/nonexistent/dir"),
    (("train", "--device", "gpu", "--epochs", "1"), "--device gpu"),
    (("train", "--inject", "3:compute=2"), "3:compute=2"),
    (("report", "/nonexistent.h5"), "/nonexistent.h5"),
])
def test_bad_input_is_one_line_exit_2(args, message, digits_dir, tmp_path):
    args = list(args)
    if args[0] == "train" and "--data" not in args:
        args += ["--data", digits_dir, "--log", str(tmp_path / "r.h5")]
    res = mpirun.run(0, *args)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert message in one_error_line(res)


def test_unknown_config_key_in_file(tmp_path, digits_dir):
    cfg = tmp_path / "run.toml"
    cfg.write_text('modle = "mlp"\n')
    res = mpirun.run(0, "train", cfg, "--data", digits_dir)
    assert res.returncode == 2
    assert "'model'" in one_error_line(res)


def test_box_is_the_cluster_box_command_line(tmp_path):
    """`mpilb box ...` is `python -m mpilb.clusterbox ...` under mpilb's name."""
    res = mpirun.run(0, "box", "--help")
    assert res.returncode == 0 and res.stdout.startswith("usage: mpilb box ")
    assert "{up,run,down,status,cleanup}" in res.stdout
    res = mpirun.run(0, "box", "frob")          # refused before the tools are looked for
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert res.stderr.startswith("mpilb box: error: argument action: invalid choice: 'frob'")
    assert "box " in mpirun.run(0, "--help").stdout
