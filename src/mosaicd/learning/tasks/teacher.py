"""A workload that grows with the network: a fixed random teacher network labels Gaussian inputs, and a small MLP
learns them (`--task teacher`). Made from the seed, nothing on disk: `--samples-per-node` training samples per
node (so 1,000 or 10,000 nodes each train on real batches of their own), a fixed test set of TEST_SAMPLES, and any
partition over the labels (iid, dirichlet, shards) for non-IID nodes.

The teacher: x ~ N(0, I) in DIM dimensions, h = tanh(x W1 + b1) (HIDDEN units), labels = argmax(h W2 + b2) over
CLASSES, with b2 set so that the classes are about equally frequent. The student: linear(DIM->HIDDEN), ReLU,
linear(HIDDEN->CLASSES): 2,762 parameters. With 64 samples each (lr 0.1, batch 32, H=5, 100 rounds): one node
alone overfits its own at ~31% test accuracy; 16 nodes (Dirichlet 0.3, s=4) reach ~67%, 100 nodes ~73%.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from mosaic_proto import Purpose, keyed_rng
from mosaicd.learning.data import Split

from .torch_task import TorchTask
from .torch_util import blas_threads

__all__ = ["TeacherTask"]

DIM, HIDDEN, CLASSES = 32, 64, 10
TEST_SAMPLES = 2000
_TRAIN, _TEST, _TEACHER = 0, 1, 2  # the keyed streams (the `round` of the key: none of them is a round)


def teacher_split(seed: int, train: int) -> Split:
    """`train` training and TEST_SAMPLES test samples of the seed's teacher (the same first samples whatever
    `train`: a larger network adds samples).
    numpy's BLAS on one thread, whatever --threads: its products here are small (milliseconds for 64,000 samples),
    and its other threads spun past them, ~0.1-0.3 CPU-s of a 1,000-node run on 2 loaded cores (bench/README.md,
    issue 59). The same values on any number of threads (its rows split among threads, each summed alike)."""
    with blas_threads(1):
        return _split(seed, train)


def _split(seed: int, train: int) -> Split:
    rng = keyed_rng(seed, Purpose.DATA, _TEACHER)
    w1 = rng.standard_normal((DIM, HIDDEN)) / np.sqrt(DIM)
    b1 = 0.5 * rng.standard_normal(HIDDEN)
    w2 = rng.standard_normal((HIDDEN, CLASSES)) / np.sqrt(HIDDEN)

    def hidden(x: np.ndarray) -> np.ndarray:
        return np.tanh(x @ w1 + b1) @ w2

    balance = -np.median(hidden(keyed_rng(seed, Purpose.DATA, _TEACHER, 1).standard_normal((4096, DIM))), axis=0)
    x_train = keyed_rng(seed, Purpose.DATA, _TRAIN).standard_normal((train, DIM)).astype(np.float32)
    x_test = keyed_rng(seed, Purpose.DATA, _TEST).standard_normal((TEST_SAMPLES, DIM)).astype(np.float32)
    return Split(x_train, np.argmax(hidden(x_train) + balance, axis=1).astype(np.int64), x_test,
                 np.argmax(hidden(x_test) + balance, axis=1).astype(np.int64))


class TeacherTask(TorchTask):
    name = "teacher"

    def load(self) -> Split:
        return teacher_split(self.run.seed, self.run.nodes * self.run.samples_per_node)

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
