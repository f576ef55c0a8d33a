"""Unit tests for mpilb.models: gradients, sum semantics, init, views, training, errors."""

import numpy as np
import pytest

from mpilb.errors import UsageError
from mpilb.models import MODELS, build_model

CASES = {
    "softmax": dict(name="softmax", input_shape=(10,), num_classes=4),
    "mlp": dict(name="mlp", input_shape=(10,), num_classes=4, hidden=(7, 5)),
    "cnn": dict(name="cnn", input_shape=(1, 8, 8), num_classes=3),
}


def _batch(model, n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *model.input_shape))
    y = rng.integers(0, model.num_classes, n)
    return x, y


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient_matches_central_differences(case):
    model = build_model(**CASES[case])
    rng = np.random.default_rng(1)
    params = model.init_params(seed=3).astype(np.float64)
    params += 0.05 * rng.standard_normal(params.shape)  # nonzero biases too
    x, y = _batch(model, 5)
    _, grad = model.loss_and_grad(params, x, y)
    coords = rng.choice(model.num_params, size=min(200, model.num_params), replace=False)
    h = 1e-6
    numeric = np.empty(len(coords))
    for k, i in enumerate(coords):
        up, down = params.copy(), params.copy()
        up[i] += h
        down[i] -= h
        numeric[k] = (model.loss_and_grad(up, x, y)[0] - model.loss_and_grad(down, x, y)[0]) / (2 * h)
    analytic = grad[coords]
    rel = np.linalg.norm(numeric - analytic) / max(np.linalg.norm(numeric) + np.linalg.norm(analytic), 1e-12)
    assert rel < 1e-5, rel
    assert np.abs(analytic).max() > 1e-3  # the check is not vacuous


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_is_a_sum_over_the_batch(case):
    model = build_model(**CASES[case])
    params = model.init_params(0).astype(np.float64)
    x, y = _batch(model, 6)
    loss1, grad1 = model.loss_and_grad(params, x, y)
    loss2, grad2 = model.loss_and_grad(params, np.concatenate([x, x]), np.concatenate([y, y]))
    assert isinstance(loss1, float)
    assert loss2 == pytest.approx(2 * loss1, rel=1e-12)
    np.testing.assert_allclose(grad2, 2 * grad1, rtol=1e-10, atol=1e-12)


def test_loss_is_stable_for_huge_logits():
    model = build_model("softmax", (2,), 2)
    params = np.array([1e4, -1e4, 0.0, 0.0, 0.0, 0.0], dtype=np.float32)
    loss, grad = model.loss_and_grad(params, np.array([[1.0, 0.0]]), np.array([1]))
    assert loss == pytest.approx(2e4, rel=1e-6)
    assert np.isfinite(grad).all()


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_grad_written_into_grad_out(case):
    model = build_model(**CASES[case])
    params = model.init_params(0)
    x, y = _batch(model, 4)
    out = np.full(model.num_params, np.nan, dtype=np.float32)
    loss, grad = model.loss_and_grad(params, x, y, out=out)
    assert grad is out and grad.dtype == np.float32 and np.isfinite(grad).all()
    _, grad64 = model.loss_and_grad(params.astype(np.float64), x, y)
    np.testing.assert_allclose(grad, grad64, rtol=1e-3, atol=1e-4)


def test_flat_and_shaped_inputs_agree():
    model = build_model("cnn", (64,), 3)  # a flat perfect square becomes 1x8x8
    params = model.init_params(0)
    x, _ = _batch(model, 3)
    np.testing.assert_allclose(model.logits(params, x), model.logits(params, x.reshape(3, 1, 8, 8)))


def test_init_is_seeded_float32_and_he_scaled():
    model = build_model("mlp", (400,), 10, hidden=(300, 200))
    a, b, c = model.init_params(7), model.init_params(7), model.init_params(8)
    assert a.dtype == np.float32 and a.shape == (model.num_params,)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    v = model.views(a)
    assert v["dense1.W"].std() == pytest.approx(np.sqrt(2 / 400), rel=0.05)
    assert v["dense2.W"].std() == pytest.approx(np.sqrt(2 / 300), rel=0.05)
    assert v["out.W"].std() == pytest.approx(np.sqrt(2 / (200 + 10)), rel=0.1)  # Glorot
    assert not v["dense1.b"].any() and not v["out.b"].any()


def test_views_share_memory_and_follow_layout():
    model = build_model("mlp", (5,), 3, hidden=(4,))
    assert model.layout() == [("dense1.W", (5, 4)), ("dense1.b", (4,)),
                            ("out.W", (4, 3)), ("out.b", (3,))]
    assert model.num_params == 5 * 4 + 4 + 4 * 3 + 3
    flat = np.zeros(model.num_params, dtype=np.float32)
    views = model.views(flat)
    views["out.W"][1, 2] = 5.0
    assert flat[5 * 4 + 4 + 1 * 3 + 2] == 5.0
    for view in views.values():
        assert np.shares_memory(view, flat)


def test_evaluate_after_a_few_sgd_steps_separates_a_toy_set():
    rng = np.random.default_rng(0)
    centers = np.array([[3.0, 0.0], [-3.0, 0.0], [0.0, 3.0]])
    y = rng.integers(0, 3, 600)
    x = (centers[y] + 0.5 * rng.standard_normal((600, 2))).astype(np.float32)
    for name in ("softmax", "mlp"):
        model = build_model(name, (2,), 3, hidden=(16,))
        params = model.init_params(0)
        acc0 = model.evaluate(params, x, y)["accuracy"]
        for _ in range(20):
            _, grad = model.loss_and_grad(params, x, y)
            params -= 0.05 / len(x) * grad
        r = model.evaluate(params, x, y, batch_size=128); loss, acc = r["loss"], r["accuracy"]
        assert acc > 0.9, (name, acc0, acc)
        assert 0 < loss < 1


def test_evaluate_matches_manual_mean_loss():
    model = build_model("softmax", (3,), 2)
    params = model.init_params(1).astype(np.float64)
    x, y = _batch(model, 10)
    r = model.evaluate(params, x, y, batch_size=3); loss, acc = r["loss"], r["accuracy"]
    assert loss == pytest.approx(model.loss_and_grad(params, x, y)[0] / 10)
    assert acc == pytest.approx(np.mean(model.logits(params, x).argmax(1) == y))


def test_registry_and_unknown_model():
    assert set(MODELS) >= {"softmax", "mlp", "cnn"}
    with pytest.raises(UsageError, match="valid models: cnn, mlp, softmax"):
        build_model("resnet", (4,), 2)


@pytest.mark.parametrize("hidden", [(), (0,), (64, -1)])
def test_bad_hidden_sizes(hidden):
    with pytest.raises(UsageError, match="hidden"):
        build_model("mlp", (4,), 2, hidden=hidden)


@pytest.mark.parametrize("shape", [(10,), (1, 6, 6), (3, 8), (2, 2, 2, 2)])
def test_cnn_rejects_non_image_samples(shape):
    with pytest.raises(UsageError, match=r"cnn needs image-shaped samples.*got sample shape"):
        build_model("cnn", shape, 2)


def test_bad_classes_and_shape():
    with pytest.raises(UsageError, match="num_classes"):
        build_model("softmax", (4,), 1)
    with pytest.raises(UsageError, match="sample shape"):
        build_model("softmax", (0,), 3)
