"""A PyTorch regressor for float targets (one per sample or a vector per sample).

    mpilb prepare npz diabetes.npz reg          # float y: a regression dataset
    mpiexec -n 4 mpilb train --data reg --model examples/regression.py:Regressor \
        --model-arg hidden=32 --epochs 40 --lr 0.05

No ``loss`` method, float targets: mpilb uses mean squared error, and evaluation reports R^2
(``test_metric``; ``metric`` = "r2" in the run log).
"""

import math

from torch import nn


class Regressor(nn.Module):
    """Flattened input -> ``hidden`` ReLU units -> ``num_targets`` outputs (``hidden=0``: a
    linear model)."""

    def __init__(self, input_shape, num_targets: int = 1, hidden: int = 32):
        super().__init__()
        features = math.prod(input_shape)
        layers = [nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, num_targets)] if hidden \
            else [nn.Linear(features, num_targets)]
        self.net = nn.Sequential(nn.Flatten(), *layers)

    def forward(self, x):
        out = self.net(x)
        return out[:, 0] if out.shape[1] == 1 else out
