"""A PyTorch MLP classifier for flat features (e.g. `mpilb prepare synthetic`).

    mpiexec -n 4 mpilb train --data synth --model examples/torch_mlp.py:MLP --model-arg hidden=256
"""

import math

from torch import nn


class MLP(nn.Module):
    """Flattened input -> ``hidden`` ReLU units (``layers`` of them) -> the classes."""

    def __init__(self, input_shape, num_classes: int, hidden: int = 128, layers: int = 2):
        super().__init__()
        sizes = [math.prod(input_shape)] + [hidden] * layers
        blocks = [nn.Flatten()]
        for a, b in zip(sizes[:-1], sizes[1:]):
            blocks += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*blocks, nn.Linear(sizes[-1], num_classes))

    def forward(self, x):
        return self.net(x)
