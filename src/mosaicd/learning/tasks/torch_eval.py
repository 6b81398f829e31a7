"""Evaluation of torch models: one at a time (`evaluate_one`) or many at once (`evaluate_stacked`), on the
whole test set or on rows of it (`--eval-samples`).

One at a time on the CPU, a convolutional model runs in channels-last memory where the task says so
(`eval_channels_last`: about twice as fast for GN-LeNet), in a copy of the model: the training model keeps its
memory format, so its kernels and bits do not change. Many at once, chunks of models go through torch.func.vmap
over each test batch (the default off the CPU; on the CPU it is slower than one at a time).
The caller holds the task's lock.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.func import functional_call, vmap

from .stacked import chunks, sequential_forward, stackable_sequential, unstack
from .torch_util import TorchModelTask, blas_threads, load_vector

__all__ = ["EVAL_STACK_SAMPLES", "evaluate_one", "evaluate_stacked", "test_rows"]

EVAL_STACK_SAMPLES = {"cpu": 32768}  # samples (models x batch) per vmapped call, per device type
EVAL_STACK_DEFAULT = 8192


def test_rows(task: TorchModelTask, samples: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The test set, or its rows `samples` (sorted indices)."""
    split = task.split
    if len(split.y_test) == 0:
        raise ValueError(f"task {task.name}: the test set is empty")
    if samples is None:
        return split.x_test, split.y_test
    return split.x_test[samples], split.y_test[samples]


def evaluate_one(task: TorchModelTask, vector: np.ndarray, samples: np.ndarray | None = None) -> dict[str, float]:
    x_test, y_test = test_rows(task, samples)
    count = len(y_test)
    sums: dict[str, float] = {}
    with torch.no_grad():
        model = task.eval_model
        load_vector(model, vector)
        model.eval()
        for start in range(0, count, task.eval_batch_size):
            sl = slice(start, start + task.eval_batch_size)
            x = task.x(x_test[sl])
            if task.eval_channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            for key, value in task.score(model(x), task.y(y_test[sl])).items():
                sums[key] = sums.get(key, 0.0) + value
    return task.summarize(sums, count)


def evaluate_stacked(task: TorchModelTask, vectors: list[np.ndarray],
                     samples: np.ndarray | None = None) -> list[dict[str, float]]:
    """`task.evaluate_one(v, samples)` of every vector: each test batch goes to the device once and through
    chunks of models together; the sums stay on the device until the end."""
    x_test, y_test = test_rows(task, samples)
    count, model = len(y_test), task.model
    model.eval()
    batch = min(task.eval_batch_size, count)
    per_call = EVAL_STACK_SAMPLES.get(task.device.type, EVAL_STACK_DEFAULT) // batch
    if stackable_sequential(model):  # matrix products of the stacked weights, the first one with the shared batch
        blas = task.run.threads  # numpy's BLAS (`stacked.products` at one thread) on the threads torch has

        def forward(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return sequential_forward(model, p, x, shared=True)
    else:
        forward, blas = vmap(lambda p, x: functional_call(model, p, (x,)), in_dims=(0, None)), None
    with torch.no_grad(), blas_threads(blas):
        stacks = [unstack(model, chunk, task.device) for chunk in chunks(vectors, per_call)]
        sums: list[dict[str, torch.Tensor]] = [{} for _ in stacks]
        for start in range(0, count, batch):
            sl = slice(start, start + batch)
            x, y = task.x(x_test[sl]), task.y(y_test[sl])
            for params, total in zip(stacks, sums, strict=True):
                for key, value in task.score_stacked(forward(params, x), y).items():
                    total[key] = total[key] + value.double() if key in total else value.double()
    out: list[dict[str, float]] = []
    for total in sums:
        host = {key: value.cpu().numpy() for key, value in total.items()}
        m = len(next(iter(host.values())))
        out += [task.summarize({key: float(v[j]) for key, v in host.items()}, count) for j in range(m)]
    return out
