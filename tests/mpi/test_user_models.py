"""Models from user code (mpilb.models.user), the NumPy example model, and the bad-input
cases of issue 12: each is exit 2 with one line naming the problem."""

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import mpirun
from mpilb.errors import UsageError
from mpilb.models import Model, build_model, parse_model_args

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def one_error_line(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("mpilb: error:"), lines[0]
    return lines[0]


def write(tmp_path, name, text) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_parse_model_args_are_toml_scalars():
    assert parse_model_args(["width=64", "lr=1e-3", "act=relu", 'name="a b"', "deep=true",
                             "sizes=[1, 2]"]) == {"width": 64, "lr": 1e-3, "act": "relu",
                                                  "name": "a b", "deep": True, "sizes": [1, 2]}
    with pytest.raises(UsageError, match="KEY=VALUE"):
        parse_model_args(["width"])


@pytest.mark.parametrize("num_classes,target_shape", [(3, ()), (0, ()), (0, (2,))])
def test_numpy_example_gradient_matches_central_differences(num_classes, target_shape):
    spec = f"{EXAMPLES / 'mymodels.py'}:Linear"
    model = build_model(spec, (4,), num_classes, target_shape=target_shape,
                        model_args={"scale": 0.5}, seed=1)
    assert isinstance(model, Model) and model.metric == ("accuracy" if num_classes else "r2")
    params = model.init_params(1).astype(np.float64)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 4))
    y = rng.integers(0, 3, 5) if num_classes else rng.standard_normal((5, *target_shape))
    loss, grad = model.loss_and_grad(params, x, y)
    eps = 1e-6
    for i in range(model.num_params):
        e = np.zeros_like(params)
        e[i] = eps
        fd = (model.loss_and_grad(params + e, x, y)[0] - model.loss_and_grad(params - e, x, y)[0]) / (2 * eps)
        assert abs(fd - grad[i]) < 1e-5 * max(1.0, abs(fd)), (i, fd, grad[i])
    result = model.evaluate(params, x, y)
    assert set(result) == {"loss", model.metric} and np.isclose(result["loss"], loss / 5)


def test_package_module_spec_and_seeded_build(tmp_path, monkeypatch):
    write(tmp_path, "mypkg_models.py", """
        import numpy as np
        import mpilb

        class Tiny(mpilb.Model):
            def __init__(self, input_shape, num_classes):
                self.num_params = int(np.prod(input_shape)) * num_classes
                self.first = np.random.rand()   # drawn from the seeded generator

            def init_params(self, seed):
                return np.zeros(self.num_params, np.float32)
        """)
    monkeypatch.syspath_prepend(str(tmp_path))
    a = build_model("mypkg_models:Tiny", (3,), 2, seed=5)
    b = build_model("mypkg_models:Tiny", (3,), 2, seed=5)
    assert a.num_params == 6 and a.first == b.first
    assert a.signature() == {"model": "Tiny", "num_params": 6, "layout": [["params", [6]]]}


@pytest.mark.parametrize("source,spec,message", [
    (None, "nothere.py:Net", "file nothere.py not found"),
    ("class Net: pass\ndef helper(): pass\n", "m.py:Nte", "has no 'Nte' (it defines: Net, helper)"),
    ("Net = 3\n", "m.py:Net", "is a int, not an mpilb.Model subclass"),
    ("import mpilb\nclass Net(mpilb.Model):\n    def __init__(self):\n        raise ValueError('bad width')\n",
     "m.py:Net", "m.py:Net() raised ValueError: bad width"),
    ("import mpilb\nclass Net(mpilb.Model):\n    def __init__(self, width=3):\n        self.num_params = width\n",
     "m.py:Net", "--model-arg depth: "),
    ("def make():\n    return {}\n", "m.py:make", "returned a dict, not an mpilb.Model"),
    ("import torch\n", "m.py:Net", 'pip install "mpilb[torch]"'),
    ("raise RuntimeError('at import')\n", "m.py:Net", "m.py raised RuntimeError: at import"),
])
def test_bad_user_models(tmp_path, monkeypatch, source, spec, message):
    if source is not None:
        write(tmp_path, "m.py", source)
    if "import torch" in (source or ""):
        monkeypatch.setitem(sys.modules, "torch", None)   # as if torch were not installed
    monkeypatch.chdir(tmp_path)
    args = {"model_args": {"depth": 2}} if "depth" in message else {}
    with pytest.raises(UsageError) as err:
        build_model(spec, (4,), 3, **args)
    assert message in str(err.value)


def test_builtin_classifier_on_regression_data():
    with pytest.raises(UsageError, match="mlp is a classifier, but the dataset holds float targets"):
        build_model("mlp", (4,), 0, target_shape=())


@pytest.fixture(scope="module")
def regression_dir(tmp_path_factory):
    from mpilb.data.dataset import prepare_npz

    tmp = tmp_path_factory.mktemp("reg")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((600, 5)).astype(np.float32)
    y = (x @ np.arange(1, 6) / 5 + 0.1 * rng.standard_normal(600)).astype(np.float32)
    np.savez(tmp / "reg.npz", x=x, y=y)
    return str(prepare_npz(tmp / "reg.npz", tmp / "reg", shards=4).root)


def test_cli_bad_model_is_one_line_exit_2(tmp_path, regression_dir):
    res = mpirun.run(0, "train", "--data", regression_dir, "--model", "mlp",
                     "--log", tmp_path / "r.h5")
    assert res.returncode == 2 and "mlp is a classifier" in one_error_line(res)
    res = mpirun.run(0, "train", "--data", regression_dir, "--model", "nothere.py:Net",
                     "--log", tmp_path / "r.h5")
    assert res.returncode == 2 and "nothere.py not found" in one_error_line(res)


def test_numpy_user_model_regression_and_resume_refuses_another_model(tmp_path, regression_dir):
    """Serial: a NumPy user model learns a linear target (R^2 logged as test_metric); a
    resume with a different user model is refused in one line."""
    from mpilb.runfiles.summary import summarize_log

    spec = f"{EXAMPLES / 'mymodels.py'}:Linear"
    ckpt = tmp_path / "c.h5"
    res = mpirun.run(0, "train", "--data", regression_dir, "--model", spec, "--epochs", "3",
                     "--lr", "0.05", "--log", tmp_path / "a.h5", "--checkpoint", ckpt,
                     "--no-progress", "--lr-schedule", "cosine", "--warmup", "10")
    assert res.returncode == 0, res.stderr
    s = summarize_log(str(tmp_path / "a.h5"))
    assert s["metric"] == "r2" and s["final_test_metric"] > 0.9
    assert s["final_test_accuracy"] is None and s["coverage"]["missing"] == 0
    other = write(tmp_path, "other.py", """
        from mymodels import Linear as Base

        class Other(Base):
            pass
        """)
    res = mpirun.run(0, "train", "--data", regression_dir, "--model", f"{other}:Other",
                     "--log", tmp_path / "a.h5", "--checkpoint", ckpt, "--resume",
                     PYTHONPATH=f"{EXAMPLES}:{Path(__file__).resolve().parents[2]}")
    assert res.returncode == 2 and "holds a different model" in one_error_line(res)


def test_numpy_user_model_on_path_trains_checkpoints_and_resumes_on_fewer_ranks(tmp_path, digits_dir):
    """`mymodels:Linear` from PYTHONPATH under mpiexec -n 4, then --resume on 3 ranks: the
    coverage of all epochs is exact and the run log says which metric it reports."""
    from mpilb.runfiles.summary import summarize_log

    env = {"PYTHONPATH": f"{Path(__file__).resolve().parents[2]}:{EXAMPLES}"}
    ckpt, log = tmp_path / "c.h5", tmp_path / "run.h5"
    common = ["train", "--data", digits_dir, "--model", "mymodels:Linear", "--lr", "0.3",
              "--checkpoint", ckpt, "--log", log, "--no-progress"]
    res = mpirun.run(4, *common, "--epochs", "2", timeout=120, **env)
    assert res.returncode == 0, res.stderr
    res = mpirun.run(3, *common, "--epochs", "4", "--resume", timeout=120, **env)
    assert res.returncode == 0, res.stderr
    s = summarize_log(str(log))
    cov = s["coverage"]
    assert s["epochs_completed"] == 4 and cov["expected"] == 4 * 1438
    assert cov["applied"] == cov["expected"] and cov["duplicates"] == 0 and cov["missing"] == 0
    assert s["metric"] == "accuracy" and s["final_test_metric"] == s["final_test_accuracy"] > 0.85


def test_constructor_error_under_mpiexec_is_one_line_from_rank_0(tmp_path, digits_dir):
    src = write(tmp_path, "net.py", """
        import mpilb

        class Net(mpilb.Model):
            def __init__(self, num_classes):
                raise ValueError(f"cannot make {num_classes} outputs")
        """)
    res = mpirun.run(3, "train", "--data", digits_dir, "--model", f"{src}:Net",
                     "--log", tmp_path / "r.h5", timeout=120)
    assert res.returncode == 2, res.stderr
    line = one_error_line(res)
    assert "net.py:Net() raised ValueError: cannot make 10 outputs" in line


def test_file_model_imports_the_modules_beside_it(tmp_path, monkeypatch):
    """`FILE.py:NAME` may import a module next to it (as a script can); afterwards the
    folder stays importable, last on sys.path, so it shadows no installed package."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = tmp_path / "models"
    folder.mkdir()
    write(folder, "neighbour_base_mod.py", """
        import mpilb

        class Base(mpilb.Model):
            def __init__(self, num_classes):
                self.num_params = num_classes
        """)
    net = write(folder, "net.py", """
        from neighbour_base_mod import Base

        class Net(Base):
            pass
        """)
    monkeypatch.delitem(sys.modules, "neighbour_base_mod", raising=False)
    model = build_model(f"{net}:Net", (4,), 3)
    assert model.num_params == 3 and type(model).__mro__[1].__name__ == "Base"
    assert sys.path[-1] == str(folder.resolve()) and sys.path.count(str(folder.resolve())) == 1
    sys.modules.pop("neighbour_base_mod", None)


@pytest.mark.parametrize("name,says", [
    ("softmax", "the built-in softmax takes no options (it has no hidden layers)"),
    ("cnn", "the built-in cnn takes no options"),
    ("mlp", "the built-in mlp takes only --hidden"),
])
def test_model_arg_on_a_builtin_says_what_it_takes(name, says):
    with pytest.raises(UsageError) as err:
        build_model(name, (1, 8, 8), 10, model_args={"width": 3})
    assert says in str(err.value) and "--model-arg applies to user models" in str(err.value)
    if name != "mlp":
        assert "--hidden" not in str(err.value)


BAD_INIT = """
    import numpy as np
    from mymodels import Linear

    class Bad(Linear):
        def init_params(self, seed):
            return np.zeros(self.num_params + 3, dtype=np.float32)
    """


def test_init_params_of_the_wrong_length_is_named(tmp_path):
    from mpilb.models import initial_params

    (tmp_path / "mymodels.py").write_text((EXAMPLES / "mymodels.py").read_text())
    bad = write(tmp_path, "bad.py", BAD_INIT)
    spec = f"{bad}:Bad"
    model = build_model(spec, (1, 8, 8), 10)
    with pytest.raises(UsageError) as err:
        initial_params(model, 0, spec)
    assert str(err.value) == (f"--model {spec}: Bad.init_params(0) returned {model.num_params + 3} "
                              f"values but num_params is {model.num_params}; they must agree")


def test_init_params_of_the_wrong_length_under_mpiexec_is_one_line_exit_2(tmp_path, digits_dir):
    """The tester's case: a model beside the module it imports (no PYTHONPATH) whose
    init_params returns 653 values for 650 parameters, on 3 ranks."""
    (tmp_path / "mymodels.py").write_text((EXAMPLES / "mymodels.py").read_text())
    bad = write(tmp_path, "bad.py", BAD_INIT)
    res = mpirun.run(3, "train", "--data", digits_dir, "--model", f"{bad}:Bad", "--epochs", "1",
                     "--log", tmp_path / "r.h5", timeout=120)
    assert res.returncode == 2, res.stderr
    line = one_error_line(res)
    assert "bad.py:Bad: Bad.init_params(0) returned 653 values but num_params is 650" in line


RETURNS_OWN = """
    import numpy as np
    import mpilb
    from mymodels import Linear

    class Returns(Linear):
        '''Ignores `out` and returns a gradient array of its own (SHORT values fewer).'''
        SHORT = 0

        def loss_and_grad(self, params, x, y, out=None):
            loss, grad = super().loss_and_grad(params, x, y, None)
            return loss, grad[:grad.size - self.SHORT].copy()

    class Short(Returns):
        SHORT = 3
"""


@pytest.mark.mpi
def test_a_model_that_returns_its_gradient_trains_under_mpi(tmp_path, digits_dir):
    """A model returning its gradient instead of writing `out` trained nothing under MPI
    (0.084 accuracy, exit 0, while serially 0.92): the returned array is what is sent now,
    and one of the wrong length is one line, exit 2."""
    from mpilb.runfiles.summary import summarize_log

    src = write(tmp_path, "ret.py", RETURNS_OWN)
    env = {"PYTHONPATH": str(EXAMPLES)}
    res = mpirun.run(3, "train", "--data", digits_dir, "--model", f"{src}:Returns", "--epochs", 3,
                     "--lr", 0.2, "--no-progress", "--log", tmp_path / "r.h5", timeout=120, **env)
    assert res.returncode == 0, res.stderr
    assert summarize_log(str(tmp_path / "r.h5"))["final_test_accuracy"] > 0.8
    res = mpirun.run(3, "train", "--data", digits_dir, "--model", f"{src}:Short", "--epochs", 3,
                     "--no-progress", "--log", tmp_path / "s.h5", timeout=120, **env)
    assert res.returncode == 2, res.stderr
    line = one_error_line(res)
    assert "Short.loss_and_grad returned a gradient of 647 values; num_params is 650" in line
