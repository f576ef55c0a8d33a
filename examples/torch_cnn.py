"""A small PyTorch CNN for the 8x8 digits (`mpilb prepare digits d`).

    mpiexec -n 4 mpilb train --data d --model examples/torch_cnn.py:Net --epochs 20

mpilb builds ``Net`` on every rank from ``--seed`` (it passes ``num_classes`` because the
constructor asks for it), trains it with its server and workers, and leaves the trained
weights in the checkpoint: ``mpilb export RUN.ckpt.h5 net.pt`` then
``Net().load_state_dict(torch.load("net.pt"))``.
"""

import torch
from torch import nn


class Net(nn.Module):
    """conv3x3(16) - BatchNorm - ReLU - maxpool2 - conv3x3(32) - BatchNorm - ReLU - maxpool2 -
    linear.

    The BatchNorm layers' running statistics are buffers: mpilb sends them with every push,
    the server keeps the latest, and evaluation and the checkpoint use them.
    """

    def __init__(self, num_classes: int = 10, channels: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(2 * channels * 2 * 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, 1, 8, 8)
        return self.classifier(self.features(x).flatten(1))
