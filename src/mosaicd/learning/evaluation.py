"""The paper's network metrics over all nodes' models (spec, "Metrics")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mosaic_proto import consensus_distance
from mosaicd.learning.tasks.base import Task

__all__ = ["average_model", "eval_subset", "network_metrics", "node_evaluation"]

EVAL_SUBSET_KEY = 0x65766131  # "eva1": separates the evaluation subset's stream from the run's other draws


def average_model(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """mean_i x_i, summed in float64, as float32."""
    return np.mean(np.stack([np.asarray(v, dtype=np.float64) for v in vectors]), axis=0).astype(np.float32)


def eval_subset(seed: int, size: int, samples: int | None) -> np.ndarray | None:
    """The sorted test rows node models are evaluated on with --eval-samples: the same for every round and
    run with this seed and test set size (None: the whole test set)."""
    if samples is None or samples >= size:
        return None
    rng = np.random.default_rng(np.random.SeedSequence([seed, EVAL_SUBSET_KEY, size]))
    return np.sort(rng.choice(size, samples, replace=False))


def evaluation_rows(task: Task) -> tuple[int | None, np.ndarray | None]:
    """The test set's size (None: a task without one) and the rows node models are evaluated on (`eval_subset`)."""
    size = task.test_size()
    return size, eval_subset(task.run.seed, size, task.run.eval_samples) if size is not None else None


def _row_counts(size: int | None, subset: np.ndarray | None) -> dict[str, int]:
    """`eval_samples` (the rows each node model was evaluated on) and `test_size`, for tasks with a test set."""
    return {} if size is None else {"eval_samples": size if subset is None else len(subset), "test_size": size}


def network_metrics(task: Task, vectors: Sequence[np.ndarray]) -> dict[str, Any]:
    """The spec's four metrics of `task.metric` over the nodes' models, on the global test set.

    - node_average: mean over nodes of each node model's metric
    - average_model: the metric of the single model mean_i x_i
    - consensus_distance: mean over nodes of ||x_i - mean_j x_j||
    - node_spread: standard deviation (population, ddof=0) over nodes of the node metrics
    - per_node: every node's metric, in the order of `vectors`
    plus `metric` (its name), `higher_is_better`, the test losses (node average and average model)
    where the task reports `test_loss`, and for tasks with a test set `eval_samples`: how many test samples
    each node model was evaluated on (`--eval-samples`, a fixed seeded subset) and `test_size`, all of which
    the average model is evaluated on. The node models go through `task.evaluate_many` together.
    """
    if len(vectors) == 0:
        raise ValueError("network_metrics needs at least one model")
    name = task.metric
    size, subset = evaluation_rows(task)
    node_metrics = task.evaluate_many(vectors, subset)
    per_node = [float(m[name]) for m in node_metrics]
    avg = task.evaluate(average_model(vectors))
    out: dict[str, Any] = {
        "metric": name,
        "higher_is_better": bool(task.higher_is_better),
        "node_average": float(np.mean(per_node)),
        "average_model": float(avg[name]),
        "consensus_distance": consensus_distance([np.asarray(v) for v in vectors]),
        "node_spread": float(np.std(per_node)),
        "per_node": per_node,
    }
    out.update(_row_counts(size, subset))
    if "test_loss" in avg and all("test_loss" in m for m in node_metrics):
        out["node_average_test_loss"] = float(np.mean([m["test_loss"] for m in node_metrics]))
        out["average_model_test_loss"] = float(avg["test_loss"])
    return out


def node_evaluation(task: Task, vector: np.ndarray) -> dict[str, Any]:
    """One node's evaluation of its own model, as its snapshot keeps it (`daemon/http/model_codec.py`'s `metrics`):
    the same rows (`--eval-samples`: `eval_subset`) and the same per-model path (`task.evaluate_many`) as
    `network_metrics`, so that the barrier's row from the nodes' metrics equals simulate's (on the CPU)."""
    size, subset = evaluation_rows(task)
    values = {k: float(v) for k, v in task.evaluate_many([vector], subset)[0].items()}
    return {"values": values, "metric": task.metric, "higher_is_better": bool(task.higher_is_better),
            "source": "task", **_row_counts(size, subset)}


def average_evaluation(task: Task, vectors: Sequence[np.ndarray]) -> dict[str, Any]:
    """The average model's part of `network_metrics` (what a barrier with the run's task adds to the nodes')."""
    avg = task.evaluate(average_model(vectors))
    out: dict[str, Any] = {"metric": task.metric, "higher_is_better": bool(task.higher_is_better),
                           "average_model": float(avg[task.metric])}
    if "test_loss" in avg:
        out["average_model_test_loss"] = float(avg["test_loss"])
    return out
