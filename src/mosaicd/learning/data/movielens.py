"""MovieLens ml-latest-small ratings.csv."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mosaicd.learning.partition import DataStream, data_rng

from .common import Split, data_path, missing


def load_movielens(data_dir: Path | str, seed: int, test_fraction: float = 0.2) -> Split:
    """ml-latest-small ratings: x = (N, 2) int64 [user index, item index], y = float32 rating.

    Users and items are numbered densely over the whole file. Every user's ratings are split with the
    seed: floor(test_fraction * count) of them go to the test set (a user with one rating keeps it for
    training). clients = the user index of every training rating (the natural partition).
    """
    root = data_path("movielens", data_dir)
    path = root / "ratings.csv"
    if not path.is_file():
        raise missing("movielens", root, "no ratings.csv")
    with open(path, encoding="utf-8") as f:
        header = f.readline().strip().split(",")
        if header[:3] != ["userId", "movieId", "rating"]:
            raise ValueError(f"{path}: expected a userId,movieId,rating,... header, got {header}")
        table = np.loadtxt(f, delimiter=",", usecols=(0, 1, 2), dtype=np.float64, ndmin=2)
    if len(table) == 0:
        raise ValueError(f"{path}: no ratings")
    user_ids, users = np.unique(table[:, 0].astype(np.int64), return_inverse=True)
    item_ids, items = np.unique(table[:, 1].astype(np.int64), return_inverse=True)
    users, items = users.reshape(-1), items.reshape(-1)
    ratings = table[:, 2].astype(np.float32)
    keys = data_rng(seed, DataStream.MOVIELENS_SPLIT).random(len(ratings))
    order = np.lexsort((keys, users))  # by user, then by the random key
    counts = np.bincount(users, minlength=len(user_ids))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.empty(len(ratings), dtype=np.int64)
    rank[order] = np.arange(len(ratings)) - starts[users[order]]
    test = rank < np.floor(counts * test_fraction).astype(np.int64)[users]
    x = np.stack([users, items], axis=1).astype(np.int64)
    return Split(x[~test], ratings[~test], x[test], ratings[test], clients=users[~test],
                 info={"users": len(user_ids), "items": len(item_ids), "mean": float(ratings[~test].mean())})
