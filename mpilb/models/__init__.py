"""Models: the public protocol (:mod:`.base`), the built-ins (:mod:`.builtin`), models from
user code (:mod:`.user`) and the PyTorch adapter (:mod:`.torch_adapter`, the only module
that imports torch).
"""

from __future__ import annotations

from mpilb.errors import UsageError
from mpilb.models.base import Model, accuracy, r2_score
from mpilb.models.builtin import CNN, MLP, MODELS, FlatClassifier, Softmax, build_builtin, register_model
from mpilb.models.user import build_user_model, initial_params, is_user_spec, parse_model_args

__all__ = ["CNN", "MLP", "MODELS", "FlatClassifier", "Model", "Softmax", "accuracy",
           "build_model", "build_user_model", "initial_params", "parse_model_args", "r2_score", "register_model"]

# What each built-in can be given, for the message refusing --model-arg on a built-in.
BUILTIN_OPTIONS = {
    "mlp": "the built-in mlp takes only --hidden (its layer sizes, e.g. --hidden 256,128)",
    "softmax": "the built-in softmax takes no options (it has no hidden layers)",
    "cnn": "the built-in cnn takes no options (its layers are fixed)",
}


def build_model(name: str, input_shape: tuple, num_classes: int, hidden=(256, 128), *,
                target_shape=(), model_args=None, seed: int = 0) -> Model:
    """Build a built-in model by name, or a user model from ``FILE.py:NAME`` /
    ``package.module:NAME``.

    Args:
        name: "softmax", "mlp", "cnn" or a user spec.
        input_shape: shape of one sample.
        num_classes: classes of the labels; 0 for a dataset of float targets.
        hidden: the mlp's hidden layer widths (built-ins only).
        target_shape: shape of one sample's target when ``num_classes`` is 0.
        model_args: keyword arguments for a user model (``--model-arg``).
        seed: every rank builds the model from it.

    Raises:
        UsageError: naming the model and what is wrong.
    """
    if is_user_spec(name):
        return build_user_model(name, input_shape, num_classes, target_shape, model_args, seed)
    if model_args:
        raise UsageError(f"--model-arg applies to user models (FILE.py:NAME); "
                         f"{BUILTIN_OPTIONS.get(name, f'the built-in {name} takes no options')}")
    if name in MODELS and int(num_classes) == 0:
        raise UsageError(f"--model {name} is a classifier, but the dataset holds float targets "
                         "(regression); use a model of your own (--model FILE.py:NAME, see "
                         "docs/models.md)")
    return build_builtin(name, input_shape, num_classes, hidden)
