"""The numpy quadratic objective as a task (metric: the loss itself, lower is better)."""

from __future__ import annotations

import numpy as np

from mosaic_proto import Layout, Quadratic

from ..settings import Settings
from .base import Task


class QuadraticTask(Task):
    name = "quadratic"
    metric = "loss"
    higher_is_better = False

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.objective = Quadratic.build(settings.nodes, settings.dim, settings.curvature, settings.seed,
                                         heterogeneous=settings.heterogeneous, lr=settings.lr,
                                         local_steps=settings.local_steps)

    @property
    def layout(self) -> Layout:
        return Layout.flat(self.settings.dim)

    def initial(self, node: int) -> np.ndarray:
        return self.objective.initial(node)

    def train(self, node: int, round: int, vector: np.ndarray) -> tuple[np.ndarray, float]:
        return self.objective.train(node, round, vector)

    def evaluate(self, vector: np.ndarray) -> dict[str, float]:
        """Loss against the mean optimum (the global objective's minimiser up to a constant)."""
        e = vector.astype(np.float64) - self.objective.targets.mean(axis=0)
        return {"loss": float(e @ self.objective.a @ e)}
