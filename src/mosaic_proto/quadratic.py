"""The quadratic objective f_i(x) = ||x - x_i*||_A^2 = (x - x_i*)^T A (x - x_i*), in numpy.

It is the reference workload: small, exact, and the one the spec's consensus claim is about.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from .rng import Purpose, keyed_rng


class Curvature(StrEnum):
    CORRELATED = "correlated"
    DIAGONAL = "diagonal"


CORRELATED_MAX_DIM = 8192  # a correlated A is d^2 floats (512 MiB here) made by a d x d QR


def curvature_eigenvalues(d: int, lo: float = 0.1, hi: float = 4.0) -> np.ndarray:
    """A's eigenvalues, evenly spread over [lo, hi] (a diagonal A is just these)."""
    return np.linspace(lo, hi, d)


def curvature_matrix(d: int, kind: Curvature | str, seed: int, lo: float = 0.1, hi: float = 4.0) -> np.ndarray:
    """A = Q diag(linspace(lo, hi, d)) Q^T with a seeded random orthogonal Q (correlated), or the diagonal."""
    eig = curvature_eigenvalues(d, lo, hi)
    if Curvature(kind) is Curvature.DIAGONAL:
        return np.diag(eig)
    g = keyed_rng(seed, Purpose.INIT, node=2**30).standard_normal((d, d))
    q, r = np.linalg.qr(g)
    q *= np.sign(np.diag(r))
    return (q * eig) @ q.T


@dataclass(frozen=True)
class Quadratic:
    """n nodes, one A, per-node optima `targets` (n x d); every node starts from its own x_0 ~ N(0, 1).

    A diagonal A is kept as its diagonal (d floats, not d^2: a large --dim trains); products with it are those of
    the matrix, bit for bit."""

    a: np.ndarray
    targets: np.ndarray
    seed: int
    lr: float = 0.05
    local_steps: int = 1

    @classmethod
    def build(cls, n: int, d: int, kind: Curvature | str, seed: int, *, heterogeneous: bool = False,
              lr: float = 0.05, local_steps: int = 1) -> Quadratic:
        targets = np.zeros((n, d))
        if heterogeneous:
            targets = np.stack([keyed_rng(seed, Purpose.DATA, node=i).standard_normal(d) for i in range(n)])
        diagonal = Curvature(kind) is Curvature.DIAGONAL
        return cls(curvature_eigenvalues(d) if diagonal else curvature_matrix(d, kind, seed), targets, seed, lr,
                   local_steps)

    @property
    def dim(self) -> int:
        return self.a.shape[0]

    def initial(self, node: int) -> np.ndarray:
        return keyed_rng(self.seed, Purpose.INIT, node=node).standard_normal(self.dim).astype(np.float32)

    def energy(self, e: np.ndarray) -> float:
        """e^T A e."""
        return float(np.dot(e * self.a, e) if self.a.ndim == 1 else e @ self.a @ e)

    def loss(self, node: int, vector: np.ndarray) -> float:
        return self.energy(vector.astype(np.float64) - self.targets[node])

    def train(self, node: int, round: int, vector: np.ndarray) -> tuple[np.ndarray, float]:
        """H full-gradient steps x <- x - lr * 2A(x - x*); returns the new vector and the loss before them."""
        x = vector.astype(np.float64)
        loss = self.loss(node, vector)
        for _ in range(self.local_steps):
            e = x - self.targets[node]
            x -= self.lr * 2.0 * (self.a * e if self.a.ndim == 1 else self.a @ e)
        return x.astype(np.float32), loss
