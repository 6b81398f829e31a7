"""CIFAR-10 / CIFAR-100 with GN-LeNet (the paper's model: 89,834 parameters for 10 classes)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mosaicd.learning.data import Split, load_cifar

from .torch_task import TorchTask

__all__ = ["Cifar10Task", "Cifar100Task", "GNLeNet"]

# per-channel statistics of the CIFAR-10 training set (also used for CIFAR-100)
_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1) * 255.0
_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1) * 255.0


class GNLeNet(nn.Module):
    """3 x [conv 5x5 (pad 2) -> GroupNorm(2) -> ReLU -> max-pool 2x2] with 32, 32, 64 channels, then linear."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 5, padding=2), nn.GroupNorm(2, cout), nn.ReLU(), nn.MaxPool2d(2)]

        self.features = nn.Sequential(*block(3, 32), *block(32, 32), *block(32, 64))
        self.classifier = nn.Linear(64 * 4 * 4, classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class Cifar10Task(TorchTask):
    name = "cifar10"
    classes = 10
    eval_batch_size = 100  # activations of 1000 images would take half a GB
    eval_channels_last = True  # faster on the CPU (bench/evaluate.py; bench/README.md)

    def load(self) -> Split:
        return load_cifar(self.data_dir, self.classes)

    def build_model(self) -> GNLeNet:
        return GNLeNet(self.classes)

    def inputs(self, x: np.ndarray) -> torch.Tensor:
        """uint8 (B, 3, 32, 32) rows -> normalised float32."""
        return (torch.from_numpy(np.array(x)).to(torch.float32) - _MEAN) / _STD

    def x(self, rows: np.ndarray) -> torch.Tensor:
        """Off the CPU the uint8 rows travel (a quarter of the bytes) and are normalised there: the same
        elementwise float32 operations, hence the same values."""
        if self.device.type == "cpu":
            return self.inputs(rows)
        pixels = torch.from_numpy(np.array(rows)).to(self.device).to(torch.float32)
        return (pixels - _MEAN.to(self.device)) / _STD.to(self.device)


class Cifar100Task(Cifar10Task):
    name = "cifar100"
    classes = 100
