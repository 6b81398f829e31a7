"""What a workload is to Mosaic: a flat float32 vector that trains on a node's shard and evaluates.

One `Task` object serves every node that lives in a process (one for a daemon, all n for `simulate`),
so data is loaded once and each node's shard is derived from (seed, rank, n).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mosaic_proto import Layout
from mosaicd.settings import RunConfig


class Task(ABC):
    """A workload: subclass it for your own model (`--task module:Class`, docs/own-model.md). Its constructor
    takes the run, the data folder and, as keyword arguments, the run's `--task-option`s; every random draw
    must come from the run's seed and the node and round it is given, so that every process computes the same."""

    name: str  # a task's own name (the class's name where it gives none)
    metric: str = "accuracy"
    higher_is_better: bool = True

    def __init__(self, run: RunConfig, data_dir: Path = Path("data")) -> None:
        self.run, self.data_dir = run, Path(data_dir)
        if not isinstance(getattr(self, "name", None), str):
            self.name = type(self).__name__

    @property
    @abstractmethod
    def layout(self) -> Layout:
        """Ordered float tensors of the model (the spec's flattening order)."""

    @abstractmethod
    def initial(self, node: int) -> np.ndarray:
        """x_0 of `node` as a float32 vector of layout.dim values."""

    @abstractmethod
    def train(self, node: int, round: int, vector: np.ndarray) -> tuple[np.ndarray, float]:
        """H local steps from `vector` on the node's shard; the new vector and the mean training loss."""

    @abstractmethod
    def evaluate(self, vector: np.ndarray) -> dict[str, float]:
        """Metrics of one model on the global test set; always holds the key `self.metric`."""

    def node_state(self, node: int) -> dict[str, np.ndarray]:
        """What `node`'s training carries from one round to the next besides its model (an optimizer's moments, a
        step count), as named arrays: copies, taken between two rounds. Checkpoints save it (a node's and
        `simulate`'s) and `load_node_state` puts it back, so that a resumed run ends with the uninterrupted run's
        models. A task that keeps such state across rounds overrides both; the default: none."""
        return {}

    def load_node_state(self, node: int, state: dict[str, np.ndarray]) -> None:
        """Put back what `node_state(node)` gave, before `node`'s next `train`."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no per-node state, but one was given to restore "
                             f"({', '.join(sorted(state))})")

    def train_many(self, nodes: Sequence[int], round: int,
                   vectors: Sequence[np.ndarray]) -> list[tuple[np.ndarray, float]]:
        """`train` of several nodes in one round (`--batched` simulation; a task may batch them)."""
        return [self.train(i, round, v) for i, v in zip(nodes, vectors, strict=True)]

    def test_size(self) -> int | None:
        """How many test samples `evaluate` uses (None: no test set, e.g. the quadratic objective)."""
        return None

    def evaluate_many(self, vectors: Sequence[np.ndarray],
                      samples: np.ndarray | None = None) -> list[dict[str, float]]:
        """`evaluate` of several models, on the test rows `samples` (sorted indices; None: all of them)."""
        return [self.evaluate(v) for v in vectors]
