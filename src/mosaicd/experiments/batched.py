"""`mosaicd simulate --batched`: the nodes' local training of a round in one stacked pass (`Task.train_many`).

Only training is batched: the fragments, the peer sampling, the messages, the barrier and the aggregation
are `InMemoryNetwork`'s, byte for byte the exact path. Before each round the members' models are trained
together; `InMemoryNetwork.step` then takes each node's result through the usual train callback.

The models are close to, not bit-equal with, `mosaicd simulate` without `--batched` (see
`learning/tasks/stacked.py`; the tolerance is stated in tests/experiments/test_batched.py and
docs/architecture.md).
"""

from __future__ import annotations

import numpy as np

from mosaic_proto import InMemoryNetwork
from mosaicd.learning.tasks import Task

__all__ = ["BatchedTraining"]


class BatchedTraining:
    """The train callback of an `InMemoryNetwork` whose round results are computed ahead by `prepare`."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self._round: int | None = None
        self._results: dict[int, tuple[np.ndarray, float]] = {}

    def prepare(self, network: InMemoryNetwork) -> None:
        """Train every member of the network's next round together, from their current models."""
        nodes, t = list(network.members), network.round
        trained = self.task.train_many(nodes, t, [network.vectors[i] for i in nodes])
        self._round, self._results = t, dict(zip(nodes, trained, strict=True))

    def __call__(self, node: int, round: int, vector: np.ndarray) -> tuple[np.ndarray, float]:
        if round != self._round or node not in self._results:
            raise RuntimeError(f"node {node}, round {round} was not prepared (prepare() before each step)")
        return self._results.pop(node)
