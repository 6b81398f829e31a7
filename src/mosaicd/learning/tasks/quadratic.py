"""The numpy quadratic objective as a task (metric: the loss itself, lower is better).

The objective (A is d x d, the optima n x d) is built on first use only: protocol-only runs (--no-train)
with a large --dim never build it. Evaluation builds it only up to EVAL_MAX_DIM coordinates; above that
(and the objective not already built for training) the loss is reported as NaN instead of allocating
d^2 floats.
"""

from __future__ import annotations

import math
from functools import cached_property

import numpy as np

from mosaic_proto import Layout, Quadratic
from mosaic_proto.quadratic import CORRELATED_MAX_DIM
from mosaic_proto.rng import Purpose, keyed_rng

from .base import Task

EVAL_MAX_DIM = CORRELATED_MAX_DIM  # A alone is d^2 * 8 bytes (512 MiB here), and building it is a d x d QR


class QuadraticTask(Task):
    name = "quadratic"
    metric = "loss"
    higher_is_better = False

    @cached_property
    def objective(self) -> Quadratic:
        s = self.run
        return Quadratic.build(s.nodes, s.dim, s.curvature, s.seed, heterogeneous=s.heterogeneous, lr=s.lr,
                               local_steps=s.local_steps)

    @property
    def layout(self) -> Layout:
        return Layout.flat(self.run.dim)

    def initial(self, node: int) -> np.ndarray:
        # Quadratic.initial without building A: it depends on (seed, node, d) only.
        return keyed_rng(self.run.seed, Purpose.INIT, node=node).standard_normal(
            self.run.dim).astype(np.float32)

    def train(self, node: int, round: int, vector: np.ndarray) -> tuple[np.ndarray, float]:
        return self.objective.train(node, round, vector)

    def evaluate(self, vector: np.ndarray) -> dict[str, float]:
        """Loss against the mean optimum (the global objective's minimiser up to a constant)."""
        if "objective" not in self.__dict__ and self.run.dim > EVAL_MAX_DIM and self.run.curvature != "diagonal":
            return {"loss": math.nan}
        e = vector.astype(np.float64) - self.optimum
        return {"loss": self.objective.energy(e)}

    @cached_property
    def optimum(self) -> np.ndarray:
        """The mean of the nodes' optima, computed once (each evaluation reading all n of them made a round's
        evaluation of n models quadratic in n)."""
        return self.objective.targets.mean(axis=0)
