"""`mosaicd simulate --batched` against the exact run, and --device.

Tolerance. Batched training computes the same steps on the same batches with the same SGD arithmetic, but
torch.func.vmap turns the n convolutions into one grouped convolution and the products into batched ones, which sum
in another order (and a stack of matrix products pads smaller batches, summing each node's own rows, and takes
cross-entropy as logsumexp minus the target's logit): each step differs in the last bits of float32 (about 1e-7
relative), and those differences grow with the rounds (the map from x_t to x_{t+1} is not a contraction). Over the
few rounds tested here the measured gaps of every evaluated metric were below 1e-7 (three seeds, digits, n = 8, six
rounds with momentum and weight decay). The test allows an accuracy gap of ACCURACY_TOL (two of the 359 test images:
an image whose two top logits are within 1e-6 may flip) and a test- or training-loss gap of LOSS_TOL, a thousand
times what was measured, so that it fails on a wrong batch, step or update (those move the metrics by 1e-3 or more
after one round) and not on rounding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaicd.cli import main
from mosaicd.experiments.simulate import run_simulation
from mosaicd.learning.data import write_synthetic
from mosaicd.learning.tasks import build_task
from mosaicd.learning.tasks.torch_util import train_seed, train_seeds
from mosaicd.outputs import read_rounds
from mosaicd.settings import Settings

ACCURACY_TOL = 2 / 359


@pytest.fixture(autouse=True)
def _stacked_on_the_cpu_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """vmap's stacked training of convolutional models, which on the CPU `--batched` leaves aside (slower there)."""
    from mosaicd.learning.tasks.torch_task import TorchTask

    monkeypatch.setattr(TorchTask, "stacked_train", True)


LOSS_TOL = 1e-4
METRICS = ("node_average", "average_model", "node_average_test_loss", "average_model_test_loss", "train_loss")


def _close(exact_out: Path, batched_out: Path) -> None:
    exact, batched = read_rounds(exact_out), read_rounds(batched_out)
    assert [r["round"] for r in exact] == [r["round"] for r in batched]
    for a, b in zip(exact, batched, strict=True):
        for key in METRICS:
            tol = ACCURACY_TOL if key in ("node_average", "average_model") else LOSS_TOL
            assert abs(a[key] - b[key]) <= tol, (a["round"], key, a[key], b[key])
        assert np.allclose(a["per_node"], b["per_node"], atol=ACCURACY_TOL, rtol=0)


def test_batched_digits_matches_the_exact_run(tmp_path: Path) -> None:
    common = {"task": "digits", "nodes": 8, "rounds": 4, "fragments": 4, "fanout": 2, "local_steps": 3,
              "momentum": 0.9, "weight_decay": 1e-4, "seed": 1, "eval_every": 2}
    run_simulation(Settings.load(**common, out=tmp_path / "exact"), progress=False)
    batched = run_simulation(Settings.load(**common, batched=True, out=tmp_path / "batched"), progress=False)
    assert batched["status"] == "finished" and batched["settings"]["batched"] is True
    rows = read_rounds(tmp_path / "batched")
    assert len(rows) == 2 and len(batched["model_sha256"]) == 8
    _close(tmp_path / "exact", tmp_path / "batched")
    # the batched run learns: the metrics are not those of the initial models
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]


def test_batched_mlp_through_batched_matrix_products_matches_the_exact_run(tmp_path: Path) -> None:
    """The teacher task's MLP (an nn.Sequential of Linear and ReLU): stacked as torch.bmm with the backward pass
    written out (`sequential_grads`), not vmap, every batch size in one stack (a node's smaller batch padded, its
    loss over its own rows); its evaluation stacked too (cross-entropy as logsumexp). Non-IID shards, momentum kept
    across rounds."""
    from mosaicd.learning.tasks.stacked import stackable_sequential

    common = {"task": "teacher", "nodes": 8, "rounds": 4, "fragments": 4, "fanout": 2, "local_steps": 3,
              "momentum": 0.9, "lr": 0.05, "partition": "dirichlet", "alpha": 0.3, "seed": 2, "eval_every": 2,
              "batch_size": 48}
    task = build_task(Settings.load(**common))
    assert stackable_sequential(task.model)
    sizes = {len(task.shard(i)) for i in range(8)}
    assert min(sizes) < 48 <= max(sizes), sizes  # smaller batches padded into the stack of the full ones
    run_simulation(Settings.load(**common, out=tmp_path / "exact"), progress=False)
    run_simulation(Settings.load(**common, batched=True, out=tmp_path / "batched"), progress=False)
    _close(tmp_path / "exact", tmp_path / "batched")
    rows = read_rounds(tmp_path / "batched")
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]


@pytest.mark.parametrize("builtin_loss", [True, False])
def test_sequential_grads_are_autograds_for_every_elementwise_layer(builtin_loss: bool) -> None:
    """The written-out backward pass of a stack of MLPs against autograd through `sequential_forward`: every layer
    kind `stackable_sequential` takes (a Linear without bias too), padded batches, the built-in cross-entropy and a
    loss of the user's own (through autograd on the outputs only)."""
    from torch import nn

    from mosaicd.learning.tasks.stacked import sequential_forward, sequential_grads, unstack

    torch.manual_seed(0)
    layers = [nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
              nn.GELU(approximate="tanh"), nn.Linear(16, 16, bias=False), nn.Sigmoid(), nn.Linear(16, 16), nn.SiLU(),
              nn.Identity(), nn.Linear(16, 5)]
    model = nn.Sequential(*layers)
    settings = Settings.load(task="teacher", nodes=4)
    if builtin_loss:
        task = build_task(settings)
    else:
        from mosaicd.learning.tasks.torch_task import TorchTask

        task = TorchTask(settings.run_config(), model=lambda: model, train=(np.zeros((4, 3, 4), np.float32),
                         np.zeros(4, np.int64)),
                         loss=lambda out, y: ((out.softmax(-1) - nn.functional.one_hot(y, 5)) ** 2).mean())
    vectors = [np.concatenate([p.detach().numpy().ravel() * (1 + j) for p in model.parameters()]) for j in range(3)]
    params = unstack(model, vectors, torch.device("cpu"))
    x, y = torch.randn(3, 6, 3, 4), torch.randint(0, 5, (3, 6))
    counts = torch.tensor([6, 4, 1])
    got, losses = sequential_grads(task, model, params, x, y, counts)
    leaves = {name: t.detach().requires_grad_(True) for name, t in params.items()}
    want_losses = task.loss_many(sequential_forward(model, leaves, x), y, counts)
    want = dict(zip(leaves, torch.autograd.grad(want_losses.sum(), list(leaves.values())), strict=True))
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-7), name
        assert got[name].abs().sum() > 0, name
    assert torch.allclose(losses, want_losses.detach(), rtol=1e-6)


def test_sequential_grads_take_a_loss_whose_gradient_is_one_constant() -> None:
    """A loss linear in the outputs has autograd's gradient as one expanded constant; the ReLU after it writes its
    gradient in place, so the loss's gradient is made the step's own first (same gradients as autograd)."""
    from torch import nn

    from mosaicd.learning.tasks.stacked import sequential_forward, sequential_grads, unstack
    from mosaicd.learning.tasks.torch_task import TorchTask

    class SumOfOutputs(TorchTask):
        def loss_many(self, outputs: torch.Tensor, targets: torch.Tensor,
                      counts: torch.Tensor | None = None) -> torch.Tensor:
            return outputs.sum(dim=(1, 2))  # autograd's gradient: ones, expanded from one value

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    task = SumOfOutputs(Settings.load(task="teacher", nodes=4).run_config(), model=lambda: model,
                        train=(np.zeros((4, 4), np.float32), np.zeros(4, np.int64)),
                        loss=lambda out, y: out.sum(dim=-1).mean())
    vectors = [np.concatenate([p.detach().numpy().ravel() * (1 + j) for p in model.parameters()]) for j in range(2)]
    params = unstack(model, vectors, torch.device("cpu"))
    x, y = torch.randn(2, 5, 4), torch.zeros(2, 5, dtype=torch.int64)
    got, _ = sequential_grads(task, model, params, x, y, None)
    leaves = {name: t.detach().requires_grad_(True) for name, t in params.items()}
    want = torch.autograd.grad(task.loss_many(sequential_forward(model, leaves, x), y).sum(), list(leaves.values()))
    for name, expected in zip(leaves, want, strict=True):
        assert torch.allclose(got[name], expected, rtol=1e-6, atol=1e-8), name


def test_sequential_grads_name_samples_of_more_than_one_dimension() -> None:
    """The stacked products run features first, (models, features, samples): samples that are still more than one
    dimension after the leading Flattens are refused in words, not by a product's shape error."""
    from torch import nn

    from mosaicd.learning.tasks.stacked import sequential_grads, unstack

    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    task = build_task(Settings.load(task="teacher", nodes=4))
    vectors = [np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])] * 2
    with pytest.raises(ValueError, match="samples of one dimension"):
        sequential_grads(task, model, unstack(model, vectors, torch.device("cpu")), torch.randn(2, 5, 3, 4),
                         torch.zeros(2, 5, dtype=torch.int64), None)


def test_stacked_products_at_one_thread_hold_numpy_s_blas_to_one_thread() -> None:
    """At --threads 1 a stack of MLPs multiplies through numpy's BLAS (`stacked.products`), which runs on one thread
    inside training and evaluation, as torch does (seen from a loss of the user's own, which runs inside the step and
    scores each evaluated model), its own count restored after."""
    from threadpoolctl import threadpool_info
    from torch import nn

    from mosaicd.learning.tasks.torch_task import TorchTask

    def blas_threads() -> set[int]:
        return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}

    seen: list[set[int]] = []

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(blas_threads())
        return nn.functional.cross_entropy(out, y)

    before = blas_threads()
    rng = np.random.default_rng(0)
    train = (rng.standard_normal((64, 8)).astype(np.float32), rng.integers(0, 3, 64))
    task = TorchTask(Settings.load(task="teacher", nodes=4, threads=1, local_steps=2, batched=True),
                     model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), train=train,
                     test=train, loss=loss)
    vectors = [task.initial(0)] * 4
    trained = task.train_many(list(range(4)), 0, vectors)
    assert len(trained) == 4 and not np.array_equal(trained[0][0], vectors[0])
    assert seen and all(pools == {1} for pools in seen), seen
    assert blas_threads() == before
    trained_count = len(seen)
    scores = task.evaluate_many([v for v, _ in trained])  # stacked: a --batched run's MLP
    assert len(scores) == 4 and len(seen) > trained_count and all(pools == {1} for pools in seen), seen[trained_count:]
    assert blas_threads() == before and before != {1}  # numpy's own count here: more than one


def test_batched_gnlenet_with_small_shards_matches(tmp_path: Path) -> None:
    """GN-LeNet (the CIFAR-10 model), with shards smaller than the batch on some nodes (their own batch size)."""
    write_synthetic("cifar10", tmp_path / "data", train=60, test=20)
    common = {"task": "cifar10", "nodes": 4, "rounds": 2, "fragments": 4, "fanout": 2, "local_steps": 2,
              "batch_size": 16, "partition": "dirichlet", "alpha": 0.3, "min_samples": 8, "seed": 3,
              "data_dir": tmp_path / "data"}
    settings = Settings.load(**common)
    task = build_task(settings)
    sizes = {len(task.shard(i)) for i in range(4)}
    assert min(sizes) < 16 <= max(sizes), sizes  # both kinds of batch are taken
    run_simulation(Settings.load(**common, out=tmp_path / "exact"), progress=False)
    run_simulation(Settings.load(**common, batched=True, out=tmp_path / "batched"), progress=False)
    for a, b in zip(read_rounds(tmp_path / "exact"), read_rounds(tmp_path / "batched"), strict=True):
        for key in ("node_average_test_loss", "average_model_test_loss", "train_loss"):
            assert abs(a[key] - b[key]) <= LOSS_TOL, (key, a[key], b[key])


def test_train_seeds_are_each_nodes_train_seed() -> None:
    """A stacked round's per-node seeds at once are the exact runner's, node by node (and so its batches)."""
    nodes = [0, 1, 2, 17, 999, 4321]
    for seed, round in [(0, 0), (7, 19), (2**40 + 3, 2999)]:
        assert train_seeds(seed, nodes, round) == [train_seed(seed, node, round) for node in nodes]
    assert train_seeds(5, [], 3) == []


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**62), st.integers(1, 300), st.integers(1, 3), st.floats(0, 1)),
                min_size=1, max_size=6))
def test_shuffled_prefixes_are_torch_randperms(lanes: list[tuple[int, int, int, float]]) -> None:
    """Every node's permutations drawn at once (`draws.shuffled_prefixes`) are the ones torch.randperm draws from
    the node's generator, pass after pass; `draws.matches()` holds on this torch."""
    from mosaicd.learning.tasks import draws

    assert draws.matches()
    seeds, sizes, passes, keep = zip(*[(s, n, p, max(1, round(f * n))) for s, n, p, f in lanes], strict=True)
    got = draws.shuffled_prefixes(list(seeds), np.array(sizes), np.array(passes), np.array(keep))
    lane = 0
    for seed, n, p, k in zip(seeds, sizes, passes, keep, strict=True):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(p):
            assert np.array_equal(got[lane, :k], torch.randperm(n, generator=gen).numpy()[:k])
            lane += 1
    assert lane == len(got)


@pytest.mark.parametrize("local_steps,batch_size,samples,partition", [
    (5, 32, 64, "dirichlet"), (7, 48, 40, "dirichlet"), (1, 8, 64, "iid"), (3, 64, 64, "iid")])
def test_batch_rows_drawn_at_once_are_the_nodes_own(local_steps: int, batch_size: int, samples: int,
                                                    partition: str) -> None:
    """`stacked.batch_rows` (numpy, all nodes at once) against a torch generator and randperm per node and pass:
    shards of one pass or many, smaller than the batch or larger."""
    from mosaicd.learning.tasks import stacked

    s = Settings.load(task="teacher", nodes=40, local_steps=local_steps, batch_size=batch_size,
                      samples_per_node=samples, partition=partition,
                      **({"alpha": 0.1, "min_samples": 1} if partition == "dirichlet" else {}))
    task = build_task(s)
    nodes = list(range(40))
    shards = [task.shard(n) for n in nodes]
    for round in (0, 3):
        rows, sizes = stacked.batch_rows(task, nodes, round, shards)
        assert np.array_equal(rows, stacked.drawn_by_torch(local_steps, shards, train_seeds(s.seed, nodes, round),
                                                           sizes))
    lengths = [len(shard) for shard in shards]
    assert min(lengths) < batch_size or partition == "iid"


def test_device_cpu_runs_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["simulate", "--task", "digits", "--nodes", "3", "--fanout", "1", "--rounds", "1", "--device", "cpu",
              "--batched", "--eval-samples", "50", "--quiet", "--out", str(tmp_path)])
    assert stopped.value.code == 0
    import json
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["settings"]["device"] == "cpu" and summary["final"]["eval_samples"] == 50
    assert summary["final"]["test_size"] == 359


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_an_error_naming_device(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["simulate", "--task", "digits", "--nodes", "3", "--fanout", "1", "--rounds", "1", "--device", "cuda",
              "--quiet", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert stopped.value.code == 1 and "--device cuda: CUDA is not available" in err, err


@pytest.mark.parametrize("argv", [["--device", "tpu"], ["--device", "cuda:x"], ["--eval-samples", "0"]])
def test_bad_device_and_eval_samples_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["simulate", *argv])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and argv[0] in err, err


def test_batched_applies_to_simulate_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["cluster", "--batched"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "--batched does not apply to `mosaicd cluster`" in err, err


def test_eval_samples_in_simulate_and_in_the_cluster_barrier(tmp_path: Path) -> None:
    """--eval-samples is a run setting: the barrier of a cluster evaluates the same subset as simulate, and the
    models stay bit-equal."""
    from mosaicd.experiments.cluster import run_cluster

    common = {"task": "digits", "nodes": 3, "fanout": 1, "rounds": 2, "eval_samples": 40, "seed": 2,
              "round_deadline": 60}
    simulated = run_simulation(Settings.load(**common, out=tmp_path / "sim"), progress=False)
    clustered = run_cluster(Settings.load(**common, out=tmp_path / "cluster"), progress=False, timeout=120)
    assert simulated["model_sha256"] == clustered["model_sha256"]
    for a, b in zip(read_rounds(tmp_path / "sim"), read_rounds(tmp_path / "cluster"), strict=True):
        assert a["eval_samples"] == b["eval_samples"] == 40 and a["test_size"] == b["test_size"] == 359
        assert a["per_node"] == b["per_node"] and a["average_model"] == b["average_model"]
