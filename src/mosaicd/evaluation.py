"""The paper's network metrics over all nodes' models (spec, "Metrics")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mosaic_proto import consensus_distance

from .tasks.base import Task


def network_metrics(task: Task, vectors: Sequence[np.ndarray]) -> dict[str, Any]:
    """node-average, average-model, consensus distance and node spread of `task.metric`."""
    per_node = [m[task.metric] for m in task.evaluate_many(vectors)]
    mean_vector = np.mean(np.stack([np.asarray(v, dtype=np.float64) for v in vectors]), axis=0).astype(np.float32)
    return {
        "metric": task.metric,
        "node_average": float(np.mean(per_node)),
        "average_model": float(task.evaluate(mean_vector)[task.metric]),
        "consensus_distance": consensus_distance(np.stack(vectors)),
        "node_spread": float(np.std(per_node)),
        "per_node": [float(x) for x in per_node],
    }
