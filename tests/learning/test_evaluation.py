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


# -- --eval-samples and many models at once ----------------------------------------------------------------------

def test_eval_subset_is_fixed_per_seed_and_sorted():
    from mosaicd.learning.evaluation import eval_subset

    a = eval_subset(7, 359, 100)
    assert a is not None and len(a) == 100 and len(set(a.tolist())) == 100 and (np.diff(a) > 0).all()
    assert a.max() < 359
    assert np.array_equal(a, eval_subset(7, 359, 100))  # every round and every run with this seed
    assert not np.array_equal(a, eval_subset(8, 359, 100))
    assert eval_subset(7, 359, None) is None and eval_subset(7, 359, 359) is None and eval_subset(7, 359, 999) is None


def test_eval_samples_subset_for_nodes_full_set_for_the_average():
    from mosaicd.learning.evaluation import eval_subset

    run = Settings(task="digits", nodes=3, fanout=1, eval_samples=60, seed=4)
    task = build_task(run)
    rng = np.random.default_rng(0)
    vectors = [task.initial(0) + rng.normal(0, 0.05, task.layout.dim).astype(np.float32) for _ in range(3)]
    m = network_metrics(task, vectors)
    assert m["eval_samples"] == 60 and m["test_size"] == 359
    rows = eval_subset(4, 359, 60)
    assert m["per_node"] == [task.evaluate_one(v, rows)["accuracy"] for v in vectors]
    assert m["average_model"] == task.evaluate(average_model(vectors))["accuracy"]
    full = network_metrics(build_task(Settings(task="digits", nodes=3, fanout=1, seed=4)), vectors)
    assert full["eval_samples"] == 359 and full["node_average_test_loss"] != m["node_average_test_loss"]
    assert full["average_model"] == m["average_model"]


@pytest.mark.parametrize("task_name", ["digits", "cifar10", "movielens", "teacher"])
def test_stacked_evaluation_and_training_match_one_by_one(task_name, tmp_path):
    """vmap over stacked parameters: the same numbers up to float32 summation order."""
    from mosaicd.learning.data import write_synthetic

    if task_name in ("cifar10", "movielens"):
        write_synthetic(task_name, tmp_path, train=80, test=30)
    run = Settings(task=task_name, nodes=4, fanout=1, local_steps=3, momentum=0.9, weight_decay=1e-3,
                   batch_size=8, data_dir=tmp_path)
    task = build_task(run)
    rng = np.random.default_rng(1)
    vectors = [task.initial(0) + rng.normal(0, 0.05, task.layout.dim).astype(np.float32) for _ in range(4)]
    rows = np.array([0, 3, 4, 9, 17])
    for samples in (None, rows):
        one = task.evaluate_many(vectors, samples)  # one model at a time on the CPU
        task.stacked_eval = True
        many = task.evaluate_many(vectors, samples)
        task.stacked_eval = None
        assert [sorted(m) for m in one] == [sorted(m) for m in many]
        for a, b in zip(one, many, strict=True):
            for key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    exact = [task.train(i, 2, v) for i, v in enumerate(vectors)]
    fresh = build_task(run)  # from the same (empty) optimizer states
    fresh.stacked_train = True  # vmap's path, which the CPU leaves aside for a CNN
    stacked = fresh.train_many(range(4), 2, vectors)
    for (xa, la), (xb, lb) in zip(exact, stacked, strict=True):
        assert np.abs(xa - xb).max() < 1e-5 and lb == pytest.approx(la, rel=1e-5)
        assert np.abs(xa - vectors[0]).max() > 1e-3  # it trained


def test_stacked_correct_is_argmaxs_count_with_ties_and_non_finite_logits():
    """`stacked_correct` compares the target's logit with the largest instead of calling argmax: the same counts,
    ties going to the first class as argmax's do; a NaN or inf anywhere takes argmax itself."""
    from mosaicd.learning.tasks.torch_task import stacked_correct

    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (5, 400, 6), generator=gen).float()  # three values over six classes: many ties
    target = torch.randint(0, 6, (400,), generator=gen)
    want = (logits.argmax(dim=-1) == target).sum(dim=1)
    assert torch.equal(stacked_correct(logits, target), want) and 0 < int(want.min())
    assert torch.equal(stacked_correct(logits.transpose(1, 2).contiguous().transpose(1, 2), target), want)
    for bad in (float("nan"), float("inf"), float("-inf")):
        odd = logits.clone()
        odd[1, 7, 2] = bad
        assert torch.equal(stacked_correct(odd, target), (odd.argmax(dim=-1) == target).sum(dim=1))


def test_shared_input_features_first_equals_each_models_own_input():
    """Evaluation's shared batch runs features first (`_features_first`): the same outputs as every model given the
    batch as its own input, for every layer kind a stack takes."""
    from torch import nn

    from mosaicd.learning.tasks.stacked import sequential_forward, unstack

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16, bias=False), nn.Tanh(),
                          nn.Flatten(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 5), nn.Sigmoid())
    vectors = [np.concatenate([p.detach().numpy().ravel() * (1 + j) for p in model.parameters()]) for j in range(3)]
    params = unstack(model, vectors, torch.device("cpu"))
    x = torch.randn(7, 3, 4)
    shared = sequential_forward(model, params, x, shared=True)
    own = sequential_forward(model, params, x.expand(3, *x.shape))
    assert shared.shape == own.shape == (3, 7, 5)
    assert torch.allclose(shared, own, rtol=1e-5, atol=1e-6)
