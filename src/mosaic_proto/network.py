"""n `RoundState`s exchanging bytes in one process: the reference every deployment must match bit for bit."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .fragmentation import Fragmentation
from .round import RoundReport, RoundState
from .sampling import PeerSampler

TrainFn = Callable[[int, int, np.ndarray], tuple[np.ndarray, float]]


def consensus_distance(vectors: np.ndarray) -> float:
    """Mean over nodes of ||x_i - mean_j x_j|| (the spec's metric)."""
    v = np.asarray(vectors, dtype=np.float64)
    return float(np.linalg.norm(v - v.mean(axis=0), axis=1).mean())


def consensus_error(vectors: np.ndarray) -> float:
    """sum_i ||x_i - mean_j x_j||^2 (the quadratic analysis' quantity)."""
    v = np.asarray(vectors, dtype=np.float64)
    return float(((v - v.mean(axis=0)) ** 2).sum())


@dataclass
class RoundRecord:
    round: int
    losses: list[float]
    reports: list[RoundReport]


class InMemoryNetwork:
    """Runs rounds of train -> send -> aggregate for nodes 0..n-1, all in this process."""

    def __init__(self, vectors: Sequence[np.ndarray], fragmentation: Fragmentation, sampler: PeerSampler,
                 train: TrainFn | None, run_id: str = "inmemory") -> None:
        self.vectors = [np.ascontiguousarray(v, dtype=np.float32) for v in vectors]
        self.fragmentation, self.sampler, self.train, self.run_id = fragmentation, sampler, train, run_id
        self.round = 0

    @property
    def members(self) -> list[int]:
        return list(range(len(self.vectors)))

    def step(self) -> RoundRecord:
        t, members = self.round, self.members
        states = [RoundState(node=i, round=t, members=members, fragmentation=self.fragmentation,
                             sampler=self.sampler, run_id=self.run_id) for i in members]
        losses = []
        for i, state in enumerate(states):
            local, loss = self.train(i, t, self.vectors[i]) if self.train else (self.vectors[i], float("nan"))
            losses.append(loss)
            for message in state.outgoing(local):
                states[message.peer].receive(message.payload)
        outcomes = [s.finish() for s in states]
        self.vectors = [o.vector for o in outcomes]
        self.round += 1
        return RoundRecord(t, losses, [o.report for o in outcomes])

    def run(self, rounds: int, on_round: Callable[[RoundRecord], None] | None = None) -> list[RoundRecord]:
        records = []
        for _ in range(rounds):
            record = self.step()
            records.append(record)
            if on_round:
                on_round(record)
        return records

    def matrix(self) -> np.ndarray:
        return np.stack(self.vectors)
