"""The paper's network metrics over all nodes' models (spec, "Metrics")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mosaic_proto import consensus_distance
from mosaicd.learning.tasks.base import Task

__all__ = ["average_model", "network_metrics"]


def average_model(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """mean_i x_i, summed in float64, as float32."""
    return np.mean(np.stack([np.asarray(v, dtype=np.float64) for v in vectors]), axis=0).astype(np.float32)


def network_metrics(task: Task, vectors: Sequence[np.ndarray]) -> dict[str, Any]:
    """The spec's four metrics of `task.metric` over the nodes' models, on the global test set.

    - node_average: mean over nodes of each node model's metric
    - average_model: the metric of the single model mean_i x_i
    - consensus_distance: mean over nodes of ||x_i - mean_j x_j||
    - node_spread: standard deviation (population, ddof=0) over nodes of the node metrics
    - per_node: every node's metric, in the order of `vectors`
    plus `metric` (its name), `higher_is_better`, and the test losses (node average and average model)
    where the task reports `test_loss`.
    """
    if len(vectors) == 0:
        raise ValueError("network_metrics needs at least one model")
    name = task.metric
    node_metrics = task.evaluate_many(vectors)
    per_node = [float(m[name]) for m in node_metrics]
    avg = task.evaluate(average_model(vectors))
    out: dict[str, Any] = {
        "metric": name,
        "higher_is_better": bool(task.higher_is_better),
        "node_average": float(np.mean(per_node)),
        "average_model": float(avg[name]),
        "consensus_distance": consensus_distance(np.stack([np.asarray(v) for v in vectors])),
        "node_spread": float(np.std(per_node)),
        "per_node": per_node,
    }
    if "test_loss" in avg and all("test_loss" in m for m in node_metrics):
        out["node_average_test_loss"] = float(np.mean([m["test_loss"] for m in node_metrics]))
        out["average_model_test_loss"] = float(avg["test_loss"])
    return out
