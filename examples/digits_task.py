"""A task of your own in one file: a small MLP on scikit-learn's bundled digits, through `mosaicd.TorchTask`
(Mosaic partitions, batches, seeds and evaluates; the file gives the model and the data).

    mosaicd simulate --task examples/digits_task.py:DigitsMLP --task-option hidden=64 --nodes 8 --rounds 20
    mosaicd cluster  --task examples/digits_task.py:DigitsMLP --nodes 8 --rounds 20

In containers (compose.yaml mounts MOSAIC_TASKS, this folder by default, at /tasks in the barrier and every node):

    MOSAIC_TASK=/tasks/digits_task.py:DigitsMLP docker compose up --scale node=8
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from torch import nn

from mosaicd import TorchTask


def digits(test_every: int = 5) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(train, test): every `test_every`-th image is a test image; pixels standardised by the training images."""
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    test = torch.arange(len(y)) % test_every == 0
    x = (x - x[~test].mean()) / x[~test].std()
    return (x[~test], y[~test]), (x[test], y[test])


class DigitsMLP(TorchTask):
    name = "digits-mlp"

    def __init__(self, run, data_dir, hidden: int = 32) -> None:  # noqa: ANN001 (Mosaic passes its run, its folder)
        train, test = digits()
        super().__init__(run, data_dir, train=train, test=test,
                         model=lambda: nn.Sequential(nn.Linear(64, int(hidden)), nn.ReLU(), nn.Linear(int(hidden), 10)))
