"""LEAF Shakespeare: next character with embedding(8) + 2-layer LSTM(256) + linear over 80 characters."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mosaicd.learning.data import LEAF_LETTERS, Split, load_shakespeare
from mosaicd.settings import Partition

from .torch_task import TorchTask

__all__ = ["CharLSTM", "ShakespeareTask"]


class CharLSTM(nn.Module):
    """LEAF's reference model: the last LSTM output predicts the next character (819,920 parameters)."""

    def __init__(self, vocab: int = len(LEAF_LETTERS), embed: int = 8, hidden: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.head(out[:, -1])


class ShakespeareTask(TorchTask):
    """Natural partition = speaking roles (LEAF users) dealt to nodes; also iid."""

    name = "shakespeare"
    partitions = (Partition.IID, Partition.NATURAL)
    eval_batch_size = 500
    vmappable = False  # torch.func has no batching rule for aten::lstm: many nodes go one at a time

    def load(self) -> Split:
        return load_shakespeare(self.data_dir)

    def build_model(self) -> CharLSTM:
        return CharLSTM()

    def inputs(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(x, dtype=np.int64))
