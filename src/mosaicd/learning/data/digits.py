"""scikit-learn's bundled 8x8 digits (no download)."""

from __future__ import annotations

import numpy as np

from mosaicd.learning.partition import DataStream, data_rng

from .common import Split


def load_digits(seed: int, test_fraction: float = 0.2) -> Split:
    """scikit-learn's bundled 8x8 digits: float32 (N, 1, 8, 8) standardised images, int64 labels.

    The train/test split is a seeded permutation (359 test images of 1797).
    """
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = np.asarray(bunch.data, dtype=np.float32).reshape(-1, 1, 8, 8) / 16.0
    y = np.asarray(bunch.target, dtype=np.int64)
    perm = data_rng(seed, DataStream.DIGITS_SPLIT).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = np.sort(perm[:n_test]), np.sort(perm[n_test:])
    mean, std = float(x[train].mean()), float(x[train].std())
    x = ((x - mean) / std).astype(np.float32)
    return Split(x[train], y[train], x[test], y[test], info={"classes": 10})
