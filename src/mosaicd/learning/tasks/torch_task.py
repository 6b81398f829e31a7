"""What every torch workload shares: lazy data, cached shards, seeded local SGD, batched evaluation.

A subclass says how to load its `Split`, build its model and turn stored arrays into tensors; or, a user's
own task (`mosaicd.TorchTask`, docs/own-model.md), gives `model` (a factory, called under the run's seed), `train`
and `test` data ((inputs, targets) tensors or arrays, or a Dataset of pairs), and optionally `loss` and `metric`
(a batch's mean from the model's output and the targets; default cross-entropy and accuracy, the metric named by
the class's `metric`). Partitioning, batching, seeding and evaluation are the same for both. One
object serves every node of a process: data and the partition are computed once, the model object is
reused (a lock serialises calls), and a node's work depends only on (run, node, round, vector).

Devices: the model lives on `run.device` (`--device`); batches are drawn on the CPU (the same generator
and indices on every device) and moved over; vectors are numpy on the CPU. On a GPU, deterministic
kernels are asked for (`torch_util.deterministic_cuda`), so that the same run gives the same bits there too
(on the same GPU model and software; a CPU run and a GPU run differ in the last bits).

Many nodes at once (`train_many`, `evaluate_many`, `stacked.py`): stacked parameters through
torch.func.vmap, for `--batched` simulation and the barrier's evaluation on accelerators.

Repeatability: batches come from a torch.Generator keyed by (seed, node, round); no global RNG is used
(the initial model is built under fork_rng). The CPU kernels used here give the same bits for the same
inputs and the same torch thread count; a different thread count changes the summation order of some
backward reductions (conv weight gradients), hence the last bits. torch.use_deterministic_algorithms
is not called: it would import torch._dynamo (~70 MB per process) and changes nothing on CPU. For the
same reason the default optimizer is `torch_util.SGD` (torch.optim.SGD's arithmetic, tested bit-equal).

Optimizers (`optim.py`): the run's `--optimizer` (or the task's `optimizer=` factory), one per node, kept across
rounds with `--optimizer-state keep` and checkpointed through `node_state` / `load_node_state`; the learning rate
of each step from `--lr-schedule`; `--clip-grad-norm` before each step.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mosaic_proto import Layout
from mosaicd.learning.data import Split
from mosaicd.learning.partition import PartitionError, partition, supported_message
from mosaicd.settings import Partition, RunConfig

from . import stacked, torch_eval
from .base import Task
from .optim import NodeOptimizers, OptimizerFactory, Schedule, clip_gradients, set_lr
from .torch_util import check_device, layout_of, load_vector, to_vector, train_generator

__all__ = ["TorchTask", "as_arrays"]

Data = Any  # (inputs, targets) as tensors or arrays, or a torch.utils.data.Dataset of (input, target) pairs


def as_arrays(data: Data, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of `data` as two numpy arrays (a Dataset read once, item by item, and stacked)."""
    if isinstance(data, tuple | list) and len(data) == 2:
        pairs = data
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        items = [data[i] for i in range(len(data))]
        if not items:
            raise ValueError(f"{what}: the data set is empty")
        pairs = (np.stack([_array(x) for x, _ in items]), np.stack([_array(y) for _, y in items]))
    else:
        raise TypeError(f"{what}: expected (inputs, targets) or a Dataset of (input, target) pairs, "
                        f"got {type(data).__name__}")
    x, y = (_array(a) for a in pairs)
    if len(x) != len(y):
        raise ValueError(f"{what}: {len(x)} inputs but {len(y)} targets")
    return x, y


def _array(a: Any) -> np.ndarray:
    """A numpy array of `a`; float64 made float32, as Mosaic's models are."""
    array = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return array.astype(np.float32) if array.dtype == np.float64 else array


def stacked_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's cross-entropy, (m, B) from logits (m, B, C) and class indices (m, B): as logsumexp minus the
    target's logit, which on the CPU runs several times faster than F.cross_entropy's log-softmax over few classes
    (the same values but for the last bits)."""
    return torch.logsumexp(outputs, dim=-1) - outputs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def stacked_correct(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """How many of each model's rows argmax classifies as `target`, (m,) from logits (m, B, C) and classes (B,):
    whether the target's logit is the first largest, compared directly, since on the CPU argmax over a few classes
    costs as much as the model's matrix products; argmax itself off the CPU and where a logit is not finite (its
    rule for NaN)."""
    if outputs.device.type != "cpu" or not bool(torch.isfinite(outputs.sum())):  # a NaN or inf makes the sum one
        return (outputs.argmax(dim=-1) == target).sum(dim=1)
    mine = outputs.gather(-1, target.expand(outputs.shape[0], -1).unsqueeze(-1)).squeeze(-1)
    earlier = torch.arange(outputs.shape[-1], device=outputs.device) < target.unsqueeze(-1)
    before = outputs.masked_fill(~earlier, float("-inf")).amax(dim=-1)  # the largest of the classes before it
    return ((outputs.amax(dim=-1) == mine) & (before < mine)).sum(dim=1)


def _accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(dim=-1) == target).float().mean()


class TorchTask(Task):
    """A torch model trained by seeded local SGD on each node's part of a data set (the module's docstring)."""

    partitions: tuple[Partition, ...] = (Partition.IID, Partition.DIRICHLET, Partition.SHARDS)
    eval_batch_size: int = 1000
    vmappable: bool = True  # torch.func.vmap runs the model (not LSTM): batched training and evaluation
    stacked_eval: bool | None = None  # evaluate_many through vmap; None: off the CPU only (slower on CPU)
    # train_many stacked; None: off the CPU, or an MLP (batched matrix products); on the CPU vmap's grouped
    # convolutions train slower than one model after another (bench/scale.py: digits 0.73x)
    stacked_train: bool | None = None
    eval_channels_last: bool = False  # one-by-one evaluation in channels-last memory (CPU convolutions: ~2x)

    def __init__(self, run: RunConfig, data_dir: Path = Path("data"), *,
                 model: Callable[[], nn.Module] | None = None, train: Data = None, test: Data = None,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | float] | None = None,
                 optimizer: OptimizerFactory | None = None) -> None:
        """`optimizer`: parameters -> a torch.optim.Optimizer, instead of the run's --optimizer (its lr is the one
        --lr-schedule multiplies)."""
        super().__init__(run, data_dir)
        if optimizer is not None and (run.optimizer != "sgd" or run.optimizer_options or run.momentum):
            raise ValueError(f"--optimizer {run.optimizer}: {type(self).__name__} gives its own optimizer "
                             "(TorchTask(optimizer=...)); leave --optimizer, --optimizer-option and --momentum unset")
        self._model_factory, self._data = model, (train, test)
        self.optimizers = NodeOptimizers.of(run, optimizer)
        self.schedule = Schedule(run)
        self._loss_fn, self._metric_fn = loss, metric
        if run.partition not in self.partitions:
            raise PartitionError(supported_message(self.name, run.partition.value,
                                                   [p.value for p in self.partitions]))
        torch.set_num_threads(run.threads)  # the thread count changes float results: same on every node
        self.device = check_device(run.device)
        self._lock = threading.RLock()
        self._split: Split | None = None
        self._shards: list[np.ndarray] | None = None
        self._model: nn.Module | None = None
        self._eval_model: nn.Module | None = None  # channels-last copy for evaluation (`eval_model`)
        self._initial: np.ndarray | None = None

    @property
    def eval_model(self) -> nn.Module:
        """The model evaluation runs (torch_eval): the training model, or a channels-last copy of it (made once)."""
        if not self.eval_channels_last:
            return self.model
        if self._eval_model is None:
            self._eval_model = copy.deepcopy(self.model).to(memory_format=torch.channels_last)
        return self._eval_model

    # ---- what a subclass provides

    def load(self) -> Split:
        """Read the data set (called once per object): by default the `train` and `test` data given."""
        if any(data is None for data in self._data):
            raise NotImplementedError(f"{type(self).__name__}: give TorchTask train= and test=, or override load()")
        return Split(*as_arrays(self._data[0], "train"), *as_arrays(self._data[1], "test"))

    def build_model(self) -> nn.Module:
        """A freshly initialised model (called under torch.manual_seed(run.seed)): by default `model()`."""
        if self._model_factory is None:
            raise NotImplementedError(f"{type(self).__name__}: give TorchTask model=, or override build_model()")
        return self._model_factory()

    def inputs(self, x: np.ndarray) -> torch.Tensor:
        """Model input from stored rows (a copy; stored arrays may be read-only memory maps)."""
        return torch.from_numpy(np.array(x))

    def targets(self, y: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(y))

    def x(self, rows: np.ndarray) -> torch.Tensor:
        """`inputs` on the task's device."""
        return self.inputs(rows).to(self.device)

    def y(self, rows: np.ndarray) -> torch.Tensor:
        return self.targets(rows).to(self.device)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target) if self._loss_fn is None else self._loss_fn(output, target)

    def loss_many(self, outputs: torch.Tensor, targets: torch.Tensor,
                  counts: torch.Tensor | None = None) -> torch.Tensor:
        """The losses of m models' outputs (m, B, ...) against their own targets (m, B, ...): a tensor of m.
        `counts`: model j's batch is its first counts[j] rows (the rest pads a stack of smaller batches)."""
        if self._builtin_loss(outputs, targets):
            each = stacked_cross_entropy(outputs, targets)
            if counts is None:
                return each.mean(dim=1)
            mine = torch.arange(each.shape[1], device=each.device) < counts.unsqueeze(1)
            return torch.where(mine, each, 0.0).sum(dim=1) / counts
        if counts is None:
            return torch.stack([self.loss(o, t) for o, t in zip(outputs, targets, strict=True)])
        return torch.stack([self.loss(o[:c], t[:c]) for o, t, c in zip(outputs, targets, counts.tolist(),
                                                                         strict=True)])

    def loss_grad_many(self, outputs: torch.Tensor, targets: torch.Tensor,
                       counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`loss_many` and its gradient with respect to `outputs`: written out for the built-in cross-entropy
        (softmax minus the target's one-hot, each row weighted as the mean weights it), else through autograd."""
        if not self._builtin_loss(outputs, targets):
            leaf = outputs.detach().requires_grad_(True)
            with torch.enable_grad():
                losses = self.loss_many(leaf, targets, counts)
                (grad,) = torch.autograd.grad(losses.sum(), leaf)
            return losses.detach(), grad
        with torch.no_grad():
            index = targets.unsqueeze(-1)
            top = outputs.amax(dim=-1, keepdim=True)
            grad = (outputs - top).exp_()  # softmax's numerators, once for the loss and its gradient
            total = grad.sum(dim=-1, keepdim=True)
            each = (total.log().add_(top) - outputs.gather(-1, index)).squeeze(-1)
            grad.div_(total)
            grad.scatter_(-1, index, grad.gather(-1, index) - 1)
            if counts is None:
                return each.mean(dim=1), grad.mul_(1.0 / outputs.shape[1])
            mine = torch.arange(each.shape[1], device=each.device) < counts.unsqueeze(1)
            weight = torch.where(mine, 1.0 / counts.unsqueeze(1).to(outputs.dtype), 0.0)
            return torch.where(mine, each, 0.0).sum(dim=1) / counts, grad.mul_(weight.unsqueeze(-1))

    def _builtin_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> bool:
        """The loss is the built-in cross-entropy over class indices, which the stacked paths compute themselves."""
        return self._loss_fn is None and type(self).loss is TorchTask.loss and outputs.dim() == 3 \
            and targets.dim() == 2

    @property
    def _own_scores(self) -> bool:
        return self._loss_fn is not None or self._metric_fn is not None

    def score(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        """Sums over one test batch, turned into metrics by `summarize`."""
        if self._own_scores:  # the batch means of the given loss and metric, weighted by the batch's size
            metric = (self._metric_fn or _accuracy)(output, target)
            return {"loss": float(self.loss(output, target)) * len(target), "metric": float(metric) * len(target)}
        return {"loss": float(F.cross_entropy(output, target, reduction="sum")),
                "correct": float((output.argmax(dim=1) == target).sum())}

    def score_stacked(self, outputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """`score` of m models' outputs (m, B, ...) at once: tensors of m sums, left on the device."""
        m = outputs.shape[0]
        if self._own_scores:
            return {key: torch.stack([torch.as_tensor(value(o, target), dtype=torch.float64) * len(target)
                                      for o in outputs])
                    for key, value in (("loss", self.loss), ("metric", self._metric_fn or _accuracy))}
        loss = stacked_cross_entropy(outputs, target.expand(m, -1)).sum(dim=1)
        return {"loss": loss, "correct": stacked_correct(outputs, target)}

    def summarize(self, sums: dict[str, float], count: int) -> dict[str, float]:
        if "metric" in sums:
            return {self.metric: sums["metric"] / count, "test_loss": sums["loss"] / count}
        return {"accuracy": sums["correct"] / count, "test_loss": sums["loss"] / count}

    # ---- shared machinery

    @property
    def split(self) -> Split:
        with self._lock:
            if self._split is None:
                self._split = self.load()
            return self._split

    def groups(self) -> np.ndarray:
        """What the partition splits on: client ids (natural) or labels."""
        split = self.split
        if self.run.partition is Partition.NATURAL:
            if split.clients is None:  # pragma: no cover - guarded by `partitions`
                raise PartitionError(supported_message(self.name, "natural", [p.value for p in self.partitions]))
            return split.clients
        return split.y_train

    def shard(self, node: int) -> np.ndarray:
        """Indices of node `node`'s training samples (the partition of all nodes is computed once)."""
        s = self.run
        if not 0 <= node < s.nodes:
            raise ValueError(f"node {node} is not in 0..{s.nodes - 1}")
        with self._lock:
            if self._shards is None:
                self._shards = partition(self.groups(), s.nodes, s.partition, s.seed, alpha=s.alpha,
                                         shards_per_node=s.shards_per_node, min_samples=s.min_samples)
            return self._shards[node]

    def _fresh_model(self) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.run.seed)
            return self.build_model().to(self.device)

    @property
    def model(self) -> nn.Module:
        with self._lock:
            if self._model is None:
                self._model = self._fresh_model()
                self._initial = to_vector(self._model)
            return self._model

    @property
    def layout(self) -> Layout:
        return layout_of(self.model)

    def initial(self, node: int) -> np.ndarray:
        with self._lock:
            _ = self.model
            assert self._initial is not None
            return self._initial.copy()

    def train(self, node: int, round: int, vector: np.ndarray) -> tuple[np.ndarray, float]:
        s = self.run
        split = self.split
        shard = self.shard(node)
        if len(shard) == 0:
            raise ValueError(f"node {node} has no training samples")
        batch = min(s.batch_size, len(shard))
        gen = train_generator(s.seed, node, round)
        with self._lock:
            model = self.model
            load_vector(model, vector)
            model.train()
            if s.local_steps == 0:  # report the loss of one batch without stepping
                idx = shard[torch.randperm(len(shard), generator=gen)[:batch].numpy()]
                with torch.no_grad():
                    loss = self.loss(model(self.x(split.x_train[idx])), self.y(split.y_train[idx]))
                return np.asarray(vector, dtype=np.float32).copy(), float(loss)
            opt = self.optimizers.of_node(node, model.parameters())
            losses = []
            order, pos = np.zeros(0, dtype=np.int64), 0
            for h in range(s.local_steps):
                if pos + batch > len(order):  # a fresh pass over the shard, dropping the last partial batch
                    order, pos = torch.randperm(len(shard), generator=gen).numpy(), 0
                idx = shard[order[pos:pos + batch]]
                pos += batch
                opt.zero_grad()
                loss = self.loss(model(self.x(split.x_train[idx])), self.y(split.y_train[idx]))
                loss.backward()
                clip_gradients(model.parameters(), s.clip_grad_norm)
                set_lr(opt, self.schedule.factor(round * s.local_steps + h))
                opt.step()
                losses.append(loss.item())
            return to_vector(model), float(np.mean(losses))

    def node_state(self, node: int) -> dict[str, np.ndarray]:
        with self._lock:
            return self.optimizers.state(node)

    def load_node_state(self, node: int, state: dict[str, np.ndarray]) -> None:
        with self._lock:
            self.optimizers.restore(node, state)

    def train_many(self, nodes: Sequence[int], round: int,
                   vectors: Sequence[np.ndarray]) -> list[tuple[np.ndarray, float]]:
        """Every node's `train` at once through vmap (close to, not bit-equal with, `train`); one by one when
        stacking does not pay (`stacked_train`), the model cannot be vmapped, no step is taken, or the optimizer is
        not elementwise (`optim.ELEMENTWISE`)."""
        wanted = self.stacked_train if self.stacked_train is not None else (
            self.device.type != "cpu" or stacked.stackable_sequential(self.model))
        if not wanted or not self.vmappable or self.run.local_steps == 0 or stacked.has_buffers(self.model) \
                or not self.optimizers.elementwise:
            return super().train_many(nodes, round, vectors)
        with self._lock:
            return stacked.train_stacked(self, list(nodes), round, list(vectors))

    def test_size(self) -> int:
        return len(self.split.y_test)

    def evaluate(self, vector: np.ndarray) -> dict[str, float]:
        return self.evaluate_many([vector])[0] if self._stacked_eval() else self.evaluate_one(vector)

    def evaluate_many(self, vectors: Sequence[np.ndarray],
                      samples: np.ndarray | None = None) -> list[dict[str, float]]:
        if self._stacked_eval():
            with self._lock:
                return torch_eval.evaluate_stacked(self, list(vectors), samples)
        return [self.evaluate_one(v, samples) for v in vectors]

    def _stacked_eval(self) -> bool:
        """Many models at once: off the CPU, and in a --batched simulation of a model of matrix products (one by one
        elsewhere on the CPU: a cluster node evaluates its own model as `simulate` does, bit for bit)."""
        if self.stacked_eval is None:
            wanted = self.device.type != "cpu" or (getattr(self.run, "batched", False)
                                                   and stacked.stackable_sequential(self.model))
        else:
            wanted = self.stacked_eval
        return wanted and self.vmappable and not stacked.has_buffers(self.model)

    def evaluate_one(self, vector: np.ndarray, samples: np.ndarray | None = None) -> dict[str, float]:
        """One model, one test batch after another (`samples`: rows of the test set; None: all)."""
        with self._lock:
            return torch_eval.evaluate_one(self, vector, samples)
