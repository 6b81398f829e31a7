"""scikit-learn's bundled 8x8 digits (no download)."""

from __future__ import annotations

import numpy as np

from mosaicd.learning.partition import DataStream, data_rng

from .common import Split


def load_digits(seed: int, test_fraction: float = 0.2) -> Split:
    """scikit-learn's bundled 8x8 digits: float32 (N, 1, 8, 8) standardised images, int64 labels.

    The train/test split is a seeded permutation (359 test images of 1797).
    """
    table = _digits_table()
    x = np.asarray(table[:, :-1], dtype=np.float32).reshape(-1, 1, 8, 8) / 16.0
    y = np.asarray(table[:, -1].astype(int), dtype=np.int64)
    perm = data_rng(seed, DataStream.DIGITS_SPLIT).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = np.sort(perm[:n_test]), np.sort(perm[n_test:])
    mean, std = float(x[train].mean()), float(x[train].std())
    x = ((x - mean) / std).astype(np.float32)
    return Split(x[train], y[train], x[test], y[test], info={"classes": 10})


def _digits_table() -> np.ndarray:
    """scikit-learn's digits.csv.gz (64 pixels, then the label, per row), read as sklearn.datasets reads it but
    without importing it: that import (scipy and more) took a second of every start."""
    import gzip
    from importlib.util import find_spec
    from pathlib import Path

    try:
        spec = find_spec("sklearn")
    except ValueError:  # sys.modules["sklearn"] is None: blocked, as if not installed
        spec = None
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = Path(base) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, mode="rt", encoding="utf-8") as rows:
                return np.loadtxt(rows, delimiter=",")
    from sklearn.datasets import load_digits as sk_digits  # another layout: its own loader

    bunch = sk_digits()
    return np.column_stack([bunch.data, bunch.target])
