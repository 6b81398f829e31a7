import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from mosaicd.learning.data import write_synthetic
from mosaicd.learning.partition import PartitionError
from mosaicd.learning.tasks import DataMissing, Task, build_task
from mosaicd.learning.tasks.cifar import GNLeNet
from mosaicd.learning.tasks.torch_util import SGD, float_state, layout_of, load_vector, to_vector
from mosaicd.settings import Settings, TaskName

torch.set_num_threads(1)

NATURAL = {"movielens", "shakespeare"}
TORCH_TASKS = ["digits", "teacher", "cifar10", "cifar100", "movielens", "shakespeare"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    for task in ("cifar10", "cifar100", "movielens", "shakespeare"):
        write_synthetic(task, root, train=50, test=20, users=6)
    return root


def _settings(task: str, data_dir, **kw) -> Settings:
    base = dict(task=task, nodes=3, fanout=1, data_dir=data_dir, local_steps=2, batch_size=8, lr=0.05, seed=11,
                partition="natural" if task in NATURAL else "iid")
    return Settings(**{**base, **kw})


def test_every_task_name_is_registered():
    for name in TaskName:
        task = build_task(Settings(task=name, nodes=2, fanout=1, dim=16, fragments=4))
        assert isinstance(task, Task) and task.name == name.value


def test_gn_lenet_has_the_papers_size():
    assert sum(p.numel() for p in GNLeNet(10).parameters()) == 89_834
    assert layout_of(GNLeNet(10)).dim == 89_834  # no float buffers: the vector is the parameters
    assert layout_of(GNLeNet(100)).dim == 89_834 - 10_250 + 102_500


@pytest.mark.parametrize("name", TORCH_TASKS)
def test_task_trains_two_rounds_deterministically(name, data_dir):
    settings = _settings(name, data_dir, momentum=0.9, weight_decay=1e-4)
    task, twin = build_task(settings), build_task(settings)
    layout = task.layout
    x0 = task.initial(0)
    assert x0.dtype == np.float32 and x0.shape == (layout.dim,)
    assert np.array_equal(x0, task.initial(2)) and np.array_equal(x0, twin.initial(1))
    assert list(layout.names) == [n for n, _ in float_state(task.model)]
    rng_before = torch.random.get_rng_state()
    v, losses = x0, []
    for r in range(2):
        v, loss = task.train(1, r, v)
        losses.append(loss)
    assert torch.equal(rng_before, torch.random.get_rng_state())  # no global RNG use
    assert v.dtype == np.float32 and v.shape == x0.shape and np.all(np.isfinite(v))
    assert all(np.isfinite(losses)) and not np.array_equal(v, x0)
    # same inputs, another Task object: the same bits; another node or round: another result
    w = x0
    for r in range(2):
        w, _ = twin.train(1, r, w)
    assert np.array_equal(v, w)
    assert not np.array_equal(task.train(0, 0, x0)[0], task.train(1, 0, x0)[0])
    assert not np.array_equal(task.train(1, 0, x0)[0], task.train(1, 1, x0)[0])
    metrics = task.evaluate(v)
    assert task.metric in metrics and "test_loss" in metrics
    assert all(np.isfinite(list(metrics.values())))
    assert task.evaluate(v) == metrics
    assert task.evaluate_many([v, x0])[0] == metrics


@pytest.mark.parametrize("name", TORCH_TASKS)
def test_shards_of_one_task_object_cover_the_training_set(name, data_dir):
    task = build_task(_settings(name, data_dir))
    shards = [task.shard(i) for i in range(3)]
    joined = np.concatenate(shards)
    assert np.array_equal(np.sort(joined), np.arange(len(task.split.y_train)))
    assert task.shard(1) is shards[1]  # computed once
    with pytest.raises(ValueError, match="not in 0..2"):
        task.shard(3)


def test_movielens_metric_is_rmse_and_natural_means_whole_users(data_dir):
    task = build_task(_settings("movielens", data_dir))
    assert task.metric == "rmse" and task.higher_is_better is False
    users = [set(task.split.clients[task.shard(i)].tolist()) for i in range(3)]
    assert all(users) and not (users[0] & users[1] or users[1] & users[2] or users[0] & users[2])
    m = task.evaluate(task.initial(0))
    assert m["rmse"] == pytest.approx(np.sqrt(m["test_loss"]))


def test_unsupported_partition_names_the_supported_ones(data_dir):
    with pytest.raises(PartitionError, match="task digits supports --partition iid, dirichlet, shards"):
        build_task(Settings(task="digits", nodes=2, fanout=1, partition="natural"))
    with pytest.raises(PartitionError, match="task cifar10 supports"):
        build_task(Settings(task="cifar10", nodes=2, fanout=1, partition="natural"))
    with pytest.raises(PartitionError, match="task movielens supports --partition iid, natural"):
        build_task(Settings(task="movielens", nodes=2, fanout=1, partition="dirichlet"))


def test_missing_data_surfaces_when_data_is_needed(tmp_path):
    task = build_task(Settings(task="cifar10", nodes=2, fanout=1, data_dir=tmp_path))
    assert task.layout.dim == 89_834  # the model needs no data
    with pytest.raises(DataMissing, match="mosaicd data fetch cifar10"):
        task.train(0, 0, task.initial(0))


def test_dirichlet_and_shards_on_digits_and_zero_local_steps():
    for kind in ("dirichlet", "shards"):
        task = build_task(Settings(task="digits", nodes=4, fanout=1, partition=kind,
                                   **({"alpha": 0.1, "min_samples": 20} if kind == "dirichlet" else {})))
        assert min(len(task.shard(i)) for i in range(4)) >= 20
    task = build_task(Settings(task="digits", nodes=2, fanout=1, local_steps=0))
    x0 = task.initial(0)
    v, loss = task.train(0, 0, x0)
    assert np.array_equal(v, x0) and loss > 0


def test_vector_round_trip_includes_float_buffers_only():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    layout = layout_of(model)
    assert layout.names == ("0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var")
    v = np.arange(layout.dim, dtype=np.float32)
    load_vector(model, v)
    assert np.array_equal(to_vector(model), v)
    assert model[1].running_var.tolist() == [28.0, 29.0, 30.0, 31.0]
    assert model[1].num_batches_tracked.dtype == torch.int64
    with pytest.raises(ValueError, match="needs"):
        load_vector(model, v[:-1])


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.5, 1e-3)])
def test_sgd_matches_torch_optim_bit_for_bit(momentum, weight_decay):
    torch.manual_seed(0)
    ours, ref = GNLeNet(10), GNLeNet(10)
    ref.load_state_dict(ours.state_dict())
    opt_ours = SGD(ours.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        for model, opt in ((ours, opt_ours), (ref, opt_ref)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert np.array_equal(to_vector(ours), to_vector(ref))


def test_digits_learns():
    task = build_task(Settings(task="digits", nodes=3, local_steps=5, lr=0.05, batch_size=32))  # node 0: a third
    v = task.initial(0)
    for r in range(30):
        v, _ = task.train(0, r, v)
    assert task.evaluate(v)["accuracy"] > 0.93


_FRESH = """
import hashlib, sys, torch
torch.set_num_threads(1)
from mosaicd.settings import Settings
from mosaicd.learning.tasks import build_task
task = build_task(Settings(task="digits", nodes=4, fanout=1, local_steps=3, momentum=0.5, seed=5))
v = task.initial(0)
for r in range(2):
    v, loss = task.train(2, r, v)
print(hashlib.sha256(v.tobytes()).hexdigest(), repr(loss))
"""


def test_training_is_repeatable_in_a_fresh_process():
    task = build_task(Settings(task="digits", nodes=4, fanout=1, local_steps=3, momentum=0.5, seed=5))
    v = task.initial(0)
    for r in range(2):
        v, loss = task.train(2, r, v)
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [hashlib.sha256(v.tobytes()).hexdigest(), repr(loss)]
