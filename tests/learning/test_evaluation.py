import numpy as np
import pytest
import torch

from mosaic_proto import Layout
from mosaicd.learning.evaluation import average_model, network_metrics
from mosaicd.learning.tasks import Task, build_task
from mosaicd.settings import Settings

torch.set_num_threads(1)


class Norm(Task):
    """A stand-in whose metric is a known function of the vector."""

    name = "norm"
    metric = "score"

    @property
    def layout(self) -> Layout:
        return Layout.flat(2)

    def initial(self, node):
        return np.zeros(2, np.float32)

    def train(self, node, round, vector):
        return vector, 0.0

    def evaluate(self, vector):
        return {"score": float(vector[0]), "test_loss": float(vector[1])}


def test_the_four_metrics_by_hand():
    vectors = [np.array([1.0, 0.0], np.float32), np.array([3.0, 0.0], np.float32),
               np.array([2.0, 3.0], np.float32)]
    m = network_metrics(Norm(Settings()), vectors)
    assert m["metric"] == "score" and m["higher_is_better"] is True
    assert m["per_node"] == [1.0, 3.0, 2.0]
    assert m["node_average"] == pytest.approx(2.0)
    assert m["average_model"] == pytest.approx(2.0)  # score of the mean vector (2, 1)
    assert m["node_spread"] == pytest.approx(np.std([1.0, 3.0, 2.0]))
    centre = np.array([2.0, 1.0])
    expected = np.mean([np.linalg.norm(v - centre) for v in vectors])
    assert m["consensus_distance"] == pytest.approx(expected)
    assert m["node_average_test_loss"] == pytest.approx(1.0) and m["average_model_test_loss"] == pytest.approx(1.0)


def test_identical_models_have_no_spread_or_distance():
    task = build_task(Settings(task="digits", nodes=3, fanout=1))
    x = task.initial(0)
    m = network_metrics(task, [x, x.copy(), x.copy()])
    assert m["consensus_distance"] == 0.0 and m["node_spread"] == 0.0
    assert m["node_average"] == pytest.approx(m["average_model"])
    assert 0.0 <= m["average_model"] <= 1.0 and len(m["per_node"]) == 3


def test_quadratic_task_metrics_are_lower_is_better():
    task = build_task(Settings(task="quadratic", nodes=2, fanout=1, dim=4, fragments=2))
    m = network_metrics(task, [task.initial(0), task.initial(1)])
    assert m["metric"] == "loss" and m["higher_is_better"] is False
    assert "node_average_test_loss" not in m


def test_average_model_is_float32_and_needs_models():
    avg = average_model([np.full(3, 1.0, np.float32), np.full(3, 2.0, np.float32)])
    assert avg.dtype == np.float32 and avg.tolist() == [1.5, 1.5, 1.5]
    with pytest.raises(ValueError):
        network_metrics(Norm(Settings()), [])
