"""scikit-learn's bundled 8x8 digits with a small CNN: the offline workload for demos and tests."""

from __future__ import annotations

from torch import nn

from ..data import Split, load_digits
from .torch_task import TorchTask

__all__ = ["DigitsCNN", "DigitsTask"]


class DigitsCNN(nn.Module):
    """conv(1->16, 3x3) ReLU pool, conv(16->32, 3x3) ReLU pool, linear(128->10): 6,090 parameters."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(32 * 2 * 2, classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class DigitsTask(TorchTask):
    """1797 images, a seeded 1437/360 train/test split; partitions iid, dirichlet, shards."""

    name = "digits"

    def load(self) -> Split:
        return load_digits(self.settings.seed)

    def build_model(self) -> DigitsCNN:
        return DigitsCNN()
