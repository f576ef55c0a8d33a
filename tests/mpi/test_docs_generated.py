"""The measured tables in the docs are exactly what the benchmark result files hold.

benchmarks/gendocs.py renders the generated blocks of docs/benchmarks.md, docs/benchmarks/*.md
and the other pages in gendocs.DOCS from benchmarks/results/*.json; these tests fail when a doc was edited by hand
between the markers, a result file changed without regenerating, a file was written by a
--quick run, or a file's own verdicts do not follow from its figures. (A block whose result
file does not exist yet says so and shows no figures.)
"""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _results  # noqa: E402
import gendocs  # noqa: E402

RESULT_FILES = sorted(glob.glob(str(ROOT / "benchmarks" / "results" / "*.json")))


@pytest.mark.parametrize("doc", gendocs.DOCS)
def test_doc_matches_its_result_files(doc):
    text = (ROOT / doc).read_text()
    assert text.count("<!-- BEGIN generated:") == len(gendocs.blocks(text)), \
        f"{doc}: a BEGIN marker without its END"
    assert gendocs.regenerate(text) == text, \
        f"{doc} is stale against benchmarks/results: run `python benchmarks/gendocs.py`"


def test_every_result_file_appears_in_the_docs():
    used = {b for doc in gendocs.DOCS for b in gendocs.blocks((ROOT / doc).read_text())}
    names = {Path(p).stem for p in RESULT_FILES}
    assert names <= used, f"result files no doc shows: {sorted(names - used)}"


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: Path(p).stem)
def test_result_file_is_complete_and_consistent(path):
    res = json.loads(Path(path).read_text())
    assert not res["quick"], "a --quick run's figures do not belong in the repository"
    m = res["machine"]
    # a file converted after the run on another machine (the GPU check) says so, and its notes
    # stand in for the load averages nobody read there
    loads = () if m.get("converted_from") else ("load_start", "load_end")
    for key in ("cpu", "cores", "blas", "mpi", "python", "numpy", "h5py", "mpi4py", "commit",
                "date", "notes") + loads:
        assert m.get(key) not in (None, ""), key
    assert res["groups"]
    for g in res["groups"]:
        assert g["figures"], g["title"]
        for f in g["figures"]:
            vals = [v for v in f["values"] if v is not None]
            # a figure over all the runs above (coverage) has no command of its own
            assert f["repeats"] == len(f["values"]) >= 1, f["id"]
            assert f["command"] or not g["command"], f["id"]
            if len(vals) == len(f["values"]):
                assert f["min"] <= f["median"] <= f["max"], f["id"]
                assert f["min"] == min(vals) and f["max"] == max(vals), f["id"]
            if f["target"] is None:
                assert f["result"] is None, f["id"]
            elif all(_results.verdict(v, f["target"]) == "PASS" for v in f["values"]):
                assert f["result"] == "PASS", f["id"]
            elif all(_results.verdict(v, f["target"]) == "MISS" for v in f["values"]):
                assert f["result"] == "MISS", f["id"]


def _result(values, target):
    r = _results.Results.__new__(_results.Results)
    r.name, r.title, r.quick, r.groups = "demo", "Demo", False, []
    r.machine = {"cpu": "CPU X", "cores": 2, "memory_gib": 8.0, "system": "Linux", "blas": "openblas 1",
                 "blas_threads": "default", "mpi": "MPICH 5", "python": "3.11", "numpy": "2",
                 "h5py": "3", "mpi4py": "4", "mpilb": "0", "commit": "abc", "date": "2026-01-01 00:00 UTC",
                 "load_start": 3.0, "load_end": 5.0}
    g = r.group("(a) demo", "mpilb demo --x")
    r.figure(g, "a.ratio", "ratio", values, unit="x", target=target)
    return r, g


def test_render_shows_range_target_and_miss(tmp_path):
    r, g = _result([0.5, 0.7, 0.6], ">= 0.65")
    assert g["figures"][0]["median"] == 0.6 and g["figures"][0]["result"] == "MISS"
    r.t0 = 0
    r.write(str(tmp_path / "demo.json"))
    doc = ("prose before\n<!-- BEGIN generated: demo -->\nold table\n<!-- END generated -->\n"
           "prose after\n")
    out = gendocs.regenerate(doc, str(tmp_path))
    assert out.startswith("prose before\n<!-- BEGIN generated: demo -->\n")
    assert out.endswith("<!-- END generated -->\nprose after\n")
    assert "old table" not in out
    assert "| ratio | 0.60 (0.50–0.70) | 3 | ≥ 0.65 | **MISS** |" in out
    assert "CPU X, 2 cores" in out and "2026-01-01 00:00 UTC" in out and "`abc`" in out
    assert "targets: 0 of 1 met" in out
    assert gendocs.regenerate(out, str(tmp_path)) == out   # idempotent


def test_quick_results_are_refused_and_missing_files_show_no_figures(tmp_path):
    r, _ = _result([1.0], "<= 2")
    r.quick, r.t0 = True, 0
    r.write(str(tmp_path / "demo.json"))
    doc = "<!-- BEGIN generated: demo -->\n<!-- END generated -->\n"
    with pytest.raises(gendocs.GenError, match="--quick"):
        gendocs.regenerate(doc, str(tmp_path))
    # no result file yet: the block says so and shows no figures
    empty = gendocs.regenerate(doc.replace("demo", "other"), str(tmp_path))
    assert "No result file yet (`benchmarks/results/other.json`)" in empty
    assert "|" not in empty


def test_load_note_says_when_the_machine_was_busy():
    busy = _results.load_note({"cores": 2, "load_start": 6.0, "load_end": 7.0})
    assert "the machine was busy" in busy
    quiet = _results.load_note({"cores": 2, "load_start": 0.3, "load_end": 0.5})
    assert "quiet" in quiet


@pytest.mark.mpi
def test_bench_ps_quick_writes_a_result_file(tmp_path):
    """The plumbing end to end: a --quick benchmark run writes a file gendocs renders."""
    from mpirun import env

    out = tmp_path / "bench_ps.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ps.py"), "--quick",
                          "--optimizers", "adam", "--out", str(out)],
                         capture_output=True, text=True, timeout=120,
                         env=env(PYTHONPATH=str(ROOT)))
    assert res.returncode in (0, 1), res.stderr   # 1: the target missed (tiny quick runs)
    data = json.loads(out.read_text())
    assert data["quick"] and data["machine"]["cores"] == os.cpu_count()
    ratio = data["groups"][0]["figures"][0]
    # (on a loaded machine a 0.3 s quick loop may apply no update: the ratio is then 0)
    assert ratio["id"] == "adam.ratio" and ratio["target"] == ">= 0.5" and ratio["median"] >= 0
    assert ratio["result"] in ("PASS", "MISS") and ratio["repeats"] == 1
    assert "| server updates/s ÷ bare loop updates/s |" in gendocs.render(data)


def test_the_gpu_check_becomes_a_result_file(tmp_path):
    """tests/gpu/result.py turns device_check.json into the result file docs/gpu.md shows."""
    import subprocess
    import sys

    check = {"gpu": "Some GPU",
             "models": {f"{m}/{d}": (3e-16 if d == "float64" else 2e-3)
                        for m in ("softmax", "mlp", "cnn") for d in ("float64", "float32")},
             "step_ms": {"numpy": 30.0, "cupy": 1.5, "speedup": 20.0},
             "torch_adapter": {"grad_rel_diff": 6e-7, "step_ratio": 1.1}}
    (tmp_path / "device_check.json").write_text(json.dumps(check))
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, str(Path(ROOT) / "tests" / "gpu" / "result.py"),
                    str(tmp_path / "device_check.json"), "--out", str(out)], check=True,
                   capture_output=True, text=True)
    res = json.loads(out.read_text())
    figs = {f["id"]: f for g in res["groups"] for f in g["figures"]}
    assert res["machine"]["gpu"] == "Some GPU"
    assert figs["grad.mlp.float64"]["result"] == "PASS"
    assert figs["grad.mlp.float32"]["result"] == "MISS"     # 2e-3: above float32's 1e-4
    assert figs["step.speedup"]["median"] == 20.0 and figs["torch.step_ratio"]["median"] == 1.1
    assert "| mlp, float32 (×1e-07) | 20000.00 | 1 | ≤ 1e3 | **MISS** |" in gendocs.render(res)
