"""The PyTorch adapter (mpilb.models.torch_adapter): gradients equal plain torch's and land in
the caller's flat buffer, parameters are views of the flat vector, buffers travel as state,
and torch is imported by no other module of mpilb."""

import ast
import copy
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpilb.errors import UsageError  # noqa: E402
from mpilb.models import build_model  # noqa: E402
from mpilb.models.torch_adapter import TorchModel  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def net_with_batchnorm():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 3))


def test_only_the_adapter_and_torch_optim_import_torch():
    importers = []
    for path in (ROOT / "mpilb").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "torch" or n.startswith("torch.") for n in names):
                importers.append(path.relative_to(ROOT).as_posix())
    assert sorted(set(importers)) == ["mpilb/models/torch_adapter.py", "mpilb/models/torch_optim.py"]


def test_gradient_equals_plain_torch_and_lands_in_out():
    net = net_with_batchnorm()
    ref = copy.deepcopy(net)
    model = TorchModel(net, num_classes=3, input_shape=(4,))
    assert model.num_params == sum(p.numel() for p in ref.parameters())
    assert model.num_state == 8 + 8 + 1            # running mean, var, num_batches_tracked
    params = model.init_params(0)
    x = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    y = np.arange(16) % 3
    out = np.full(model.num_params, np.nan, dtype=np.float32)
    loss, grad = model.loss_and_grad(params, x, y, out)
    assert grad is out
    ref_loss = torch.nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y),
                                                 reduction="sum")
    ref_loss.backward()
    ref_grad = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).numpy()
    assert np.isclose(loss, float(ref_loss.detach()), rtol=1e-6)
    np.testing.assert_allclose(out, ref_grad, rtol=1e-5, atol=1e-6)
    # parameters are views of the flat vector: writing it changes the module
    params[:] = 0
    assert all(float(p.detach().abs().sum()) == 0 for p in net.parameters())
    # a second step with the same buffers zeroes the gradient first (no accumulation)
    _, grad2 = model.loss_and_grad(model.init_params(0), x, y, out)
    np.testing.assert_allclose(grad2, ref_grad, rtol=1e-5, atol=1e-6)


def test_state_round_trips_and_evaluation_uses_it():
    a = TorchModel(net_with_batchnorm(), num_classes=3, input_shape=(4,))
    b = TorchModel(net_with_batchnorm(), num_classes=3, input_shape=(4,))
    x = np.random.default_rng(1).standard_normal((32, 4)).astype(np.float32) * 3 + 1
    y = np.arange(32) % 3
    params = a.init_params(0)
    a.loss_and_grad(params, x, y)             # training mode: running statistics move
    assert not np.allclose(a.get_state(), b.get_state())
    b.set_state(a.get_state())
    np.testing.assert_array_equal(a.get_state(), b.get_state())
    assert a.evaluate(params, x, y) == b.evaluate(params.copy(), x, y)


def test_state_follows_the_module_onto_another_device():
    # module.to(device) replaces buffer tensors (parameters keep their objects): the state
    # must be read from the module as it is, not from the CPU tensors it had when built.
    # Seen on a GPU: the torch CNN trained, but evaluation used the initial BatchNorm
    # statistics (test accuracy 0.20 against 0.99 on the CPU).
    net = net_with_batchnorm()
    model = TorchModel(net, num_classes=3, input_shape=(4,))
    net.to = lambda *a, **k: net._apply(lambda t: t.clone())   # what a move to a GPU does
    model._device = "elsewhere"                                 # so that _bind moves it
    before = model.get_state().copy()
    x = np.random.default_rng(1).standard_normal((32, 4)).astype(np.float32) * 3 + 1
    model.loss_and_grad(model.init_params(0), x, np.arange(32) % 3)
    live = torch.cat([b.detach().reshape(-1).float() for b in net.buffers()]).numpy()
    assert not np.allclose(live, before)                        # the statistics moved...
    np.testing.assert_array_equal(model.get_state(), live)      # ...and the state says so
    model.set_state(before)
    np.testing.assert_array_equal(
        torch.cat([b.detach().reshape(-1).float() for b in net.buffers()]).numpy(), before)


def test_regression_default_mse_and_r2():
    torch.manual_seed(0)
    model = TorchModel(torch.nn.Linear(3, 2), num_classes=0, target_shape=(2,), input_shape=(3,))
    assert model.metric == "r2"
    params = model.init_params(0)
    x = np.random.default_rng(2).standard_normal((10, 3)).astype(np.float32)
    y = np.random.default_rng(3).standard_normal((10, 2)).astype(np.float32)
    W, b = params[:6].reshape(2, 3), params[6:]
    pred = x @ W.T + b
    loss, _ = model.loss_and_grad(params, x, y)
    assert np.isclose(loss, ((pred - y) ** 2).sum(), rtol=1e-5)
    from mpilb.models import r2_score

    assert np.isclose(model.evaluate(params, x, y)["r2"], r2_score(pred, y), atol=1e-6)


def test_module_loss_and_metrics_are_used():
    class Custom(torch.nn.Module):
        metric = "neg_mae"

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def forward(self, x):
            return self.lin(x)[:, 0]

        def loss(self, output, y):
            return (output - y).abs().mean()

        def metrics(self, output, y):
            return {"neg_mae": -float((output - y).abs().mean())}

    model = TorchModel(Custom(), num_classes=0, input_shape=(2,))
    x = np.ones((4, 2), np.float32)
    y = np.zeros(4, np.float32)
    params = model.init_params(0)
    loss, _ = model.loss_and_grad(params, x, y)
    pred = x @ params[:2] + params[2]
    assert np.isclose(loss, 4 * np.abs(pred).mean(), rtol=1e-5)
    result = model.evaluate(params, x, y)
    assert model.metric == "neg_mae" and np.isclose(result["neg_mae"], -np.abs(pred).mean(), rtol=1e-5)


@pytest.mark.parametrize("module,message", [
    (lambda: torch.nn.ReLU(), "has no parameters"),
    (lambda: torch.nn.Linear(4, 5), "outputs of shape (2, 5)"),
    (lambda: torch.nn.Linear(3, 3), "forward pass on a batch of shape (2, 4) raised RuntimeError"),
])
def test_bad_modules_fail_before_training(module, message):
    with pytest.raises(UsageError) as err:
        TorchModel(module(), num_classes=3, input_shape=(4,), where="m.py:Net")
    assert message in str(err.value) and "m.py:Net" in str(err.value)


def test_example_cnn_builds_from_file_with_seed():
    spec = f"{EXAMPLES / 'torch_cnn.py'}:Net"
    a = build_model(spec, (1, 8, 8), 10, seed=3, model_args={"channels": 8})
    b = build_model(spec, (1, 8, 8), 10, seed=3, model_args={"channels": 8})
    c = build_model(spec, (1, 8, 8), 10, seed=4, model_args={"channels": 8})
    np.testing.assert_array_equal(a.init_params(3), b.init_params(3))
    assert not np.array_equal(a.init_params(3), c.init_params(4))
    assert a.signature()["model"] == "torch:Net"
    assert [n for n, _ in a.layout()][:4] == ["features.0.weight", "features.0.bias",
                                              "features.1.weight", "features.1.bias"]
    assert a.num_state == 2 * 8 + 1 + 2 * 16 + 1   # BatchNorm means, variances, counts
