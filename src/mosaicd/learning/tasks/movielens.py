"""MovieLens ml-latest-small with matrix factorisation (20 factors per user and item, plus biases)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mosaicd.learning.data import Split, load_movielens
from mosaicd.settings import Partition

from .torch_task import TorchTask

__all__ = ["MatrixFactorization", "MovieLensTask"]


class MatrixFactorization(nn.Module):
    """rating(u, i) = <p_u, q_i> + b_u + b_i + mu; factors start at N(0, 0.1^2), biases at 0, mu at `mean`."""

    def __init__(self, users: int, items: int, factors: int = 20, mean: float = 0.0) -> None:
        super().__init__()
        self.user = nn.Embedding(users, factors)
        self.item = nn.Embedding(items, factors)
        self.user_bias = nn.Embedding(users, 1)
        self.item_bias = nn.Embedding(items, 1)
        self.mean = nn.Parameter(torch.tensor([float(mean)]))
        nn.init.normal_(self.user.weight, std=0.1)
        nn.init.normal_(self.item.weight, std=0.1)
        nn.init.zeros_(self.user_bias.weight)
        nn.init.zeros_(self.item_bias.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, i = x[:, 0], x[:, 1]
        dot = (self.user(u) * self.item(i)).sum(dim=1)
        return dot + self.user_bias(u).squeeze(1) + self.item_bias(i).squeeze(1) + self.mean


class MovieLensTask(TorchTask):
    """Metric RMSE (lower is better); natural partition = whole users per node."""

    name = "movielens"
    metric = "rmse"
    higher_is_better = False
    partitions = (Partition.IID, Partition.NATURAL)
    eval_batch_size = 8192

    def load(self) -> Split:
        return load_movielens(self.data_dir, self.run.seed)

    def build_model(self) -> MatrixFactorization:
        info = self.split.info
        return MatrixFactorization(info["users"], info["items"], 20, info["mean"])

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def score(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        return {"sq": float(((output.double() - target.double()) ** 2).sum())}

    def score_stacked(self, outputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"sq": ((outputs.double() - target.double()) ** 2).sum(dim=1)}

    def summarize(self, sums: dict[str, float], count: int) -> dict[str, float]:
        mse = sums["sq"] / count
        return {"rmse": float(np.sqrt(mse)), "test_loss": mse}
