"""ResNet-18 (the CIFAR variant: 3x3 stem, no max-pool; 11,173,962 values) on CIFAR-shaped synthetic data, as a
task loaded by file (`--task bench/resnet18_task.py:SyntheticResNet18`): plain torch, no torchvision, no download.

The data are 32x32x3 images of Gaussian noise around one fixed pattern per class (10 classes), drawn from a
generator of their own seed, the same in every process; `images` (train) and `test_images` are task options.
Used by `bench/resnet18.py` (a real-size model's seconds per round, `cluster` against `simulate`).
"""

from __future__ import annotations

import torch
from torch import nn

from mosaicd import TorchTask

CLASSES = 10


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm, and the identity (or a strided 1x1 projection) added."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def synthetic(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` images (count, 3, 32, 32) float32 and their classes: one fixed pattern per class plus noise."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(CLASSES, 3, 32, 32, generator=torch.Generator().manual_seed(12345))
    labels = torch.randint(0, CLASSES, (count,), generator=generator)
    return patterns[labels] + 2.0 * torch.randn(count, 3, 32, 32, generator=generator), labels


class SyntheticResNet18(TorchTask):
    name = "resnet18-synthetic"
    vmappable = False  # batch norm's running statistics are buffers that torch.func.vmap cannot update
    eval_batch_size = 64

    def __init__(self, run, data_dir, images: int = 512, test_images: int = 64) -> None:  # noqa: ANN001
        super().__init__(run, data_dir, model=ResNet18, train=synthetic(int(images), 1),
                         test=synthetic(int(test_images), 2))
