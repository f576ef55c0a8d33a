"""Issue 32's items 13-15 and issue 31's dropped batch, as cases of benchmarks/hostile.py.

Kept apart so that hostile.py stays one readable page: ``add_cases(hostile)`` registers them
with the same ``@case`` decorator and judges them with the same helpers.
"""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np


def add_cases(h) -> None:
    """Register the cases on the hostile module `h` (its `case`, `run`, `mpilb`, ...)."""
    case, run, mpilb, train, one_line, exact = h.case, h.run, h.mpilb, h.train, h.one_line, h.exact

    def finished(d, data):
        run(mpilb(0, *train(data, d, "--epochs", 1)), d)

    @case("export into a missing / unwritable directory")
    def _(d, data):
        finished(d, data)
        r = run(mpilb(0, "export", "run.ckpt.h5", "no/w.npz"), d)
        r2 = run(mpilb(0, "export", "run.ckpt.h5", "/proc/mpilb-w.npz"), d)
        return r, one_line(r, 2) and one_line(r2, 2), r2["lines"][0] if r2["lines"] else ""

    @case("export onto an existing file / a symlink")
    def _(d, data):
        finished(d, data)
        (d / "w.npz").write_bytes(b"mine")
        r = run(mpilb(0, "export", "run.ckpt.h5", "w.npz"), d)
        kept = (d / "w.npz").read_bytes() == b"mine"
        (d / "precious").write_text("precious")
        (d / "l.npz").symlink_to(d / "precious")
        r2 = run(mpilb(0, "export", "run.ckpt.h5", "l.npz", "--overwrite"), d)
        safe = (d / "precious").read_text() == "precious" and not (d / "l.npz").is_symlink()
        return r, one_line(r, 2) and kept and r2["code"] == 0 and safe, \
            f"existing kept {kept}, link's target untouched {safe}"

    @case("report --csv / --plots through symlinks")
    def _(d, data):
        finished(d, data)
        ok = True
        for opt, name in (("--csv", "updates.csv"), ("--plots", "loss.png")):
            out = d / opt.strip("-")
            out.mkdir()
            (d / f"precious{opt}").write_text("precious")
            (out / name).symlink_to(d / f"precious{opt}")
            r = run(mpilb(0, "report", "run.h5", opt, out), d, timeout=60)
            ok = ok and r["code"] == 0 and (d / f"precious{opt}").read_text() == "precious"
        return r, ok, "link targets untouched" if ok else "written through a link"

    @case("report on a log whose coverage is null")
    def _(d, data):
        finished(d, data)
        with h5py.File(d / "run.h5", "r+") as f:
            f.attrs["coverage"] = "null"
        r = run(mpilb(0, "report", "run.h5"), d, timeout=30)
        return r, r["code"] == 0, r["lines"][0] if r["code"] else ""

    @case("prepare npz with 0-d arrays")
    def _(d, data):
        np.savez(d / "a.npz", x=np.float32(1.0), y=np.int64(0))
        r = run(mpilb(0, "prepare", "npz", "a.npz", "out"), d)
        return r, one_line(r, 2), r["lines"][0] if r["lines"] else ""

    @case("--batch 3000000000")
    def _(d, data):
        r = run(mpilb(4, *train(data, d, "--batch", 3000000000)), d)
        return r, one_line(r, 2), r["lines"][0] if r["lines"] else ""

    @case("checkpoint coverage of the wrong length")
    def _(d, data):
        run(mpilb(4, *train(data, d, "--epochs", 1)), d)
        with h5py.File(d / "run.ckpt.h5", "r+") as f:
            counts = f["coverage/counts"][()]
            del f["coverage/counts"]
            f["coverage/counts"] = counts[:-7]
        r = run(mpilb(4, *train(data, d, "--epochs", 2, "--resume")), d)
        return r, one_line(r, 2) and "coverage/counts" in r["lines"][0], ""

    @case("test file that is also a shard")
    def _(d, data):
        copy = d / "data"
        shutil.copytree(data, copy)
        m = json.loads((copy / "manifest.json").read_text())
        m["test"] = dict(m["shards"][0])
        (copy / "manifest.json").write_text(json.dumps(m))
        r = run(mpilb(4, *train(copy, d, "--epochs", 1)), d)
        return r, one_line(r, 2) and "test set" in r["lines"][0] and "--log" not in r["lines"][0], ""

    @case("resume with another --validation-fraction")
    def _(d, data):
        run(mpilb(4, *train(data, d, "--epochs", 1)), d)
        r = run(mpilb(4, *train(data, d, "--epochs", 2, "--resume", "--validation-fraction", 0.25)), d)
        line = r["lines"][0] if r["lines"] else ""
        return r, one_line(r, 2) and "--validation-fraction 0 (" in line and "gives 0.25" in line, ""

    @case("simulate --from a checkpoint")
    def _(d, data):
        finished(d, data)
        r = run(mpilb(0, "simulate", "--from", "run.ckpt.h5"), d)
        return r, one_line(r, 2) and "checkpoint" in r["lines"][0] and "?" not in r["lines"][0], ""

    @case("full disk at the first checkpoint (one rank)")
    def _(d, data):
        (d / "full.py").write_text(h.FULL)
        r = run([h.PY, str(d / "full.py"), "2000000",
                 *map(str, train(data, d, "--epochs", 1, "--max-seconds", 1.5, "--hidden", "1024,1024"))], d)
        said = " ".join(r["lines"])
        return r, r["code"] == 1 and "intact" not in said and "none to resume" in said, ""

    @case("TOML config with a UTF-8 BOM")
    def _(d, data):
        (d / "c.toml").write_bytes(b'\xef\xbb\xbfepochs = 1\nhidden = "16"\n')
        r = run(mpilb(4, "train", "c.toml", "--data", data, "--no-progress", "--log", d / "run.h5"), d)
        return r, r["code"] == 0, ""

    @case("crashed worker at 1 s: no batch dropped (x3)")
    def _(d, data):
        detail, ok = "", True
        for i in range(3):
            args = train(data, d, "--epochs", 30, "--inject", "2:crash@1", "--worker-timeout", 5)
            args[args.index(d / "run.h5")] = d / f"run{i}.h5"
            r = run(mpilb(4, *args, flags=("-disable-auto-cleanup",)), d)
            text, exact_ok = exact(d / f"run{i}.h5", data)
            dropped = any("lies outside its task" in line for line in r["lines"])
            ok = ok and exact_ok and r["code"] == 3 and not dropped
            detail = f"{text}; dropped batch {dropped}"
        return r, ok, detail
