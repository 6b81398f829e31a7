"""Small random data sets in the official on-disk formats, for tests and benchmarks."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np

from mosaicd.files import replacing, write_whole

from .common import data_path
from .shakespeare import LEAF_LETTERS


def write_synthetic(task: str, data_dir: Path | str, *, train: int = 50, test: int = 20, seed: int = 0,
                    users: int = 6) -> Path:
    """Write a small random data set for `task` in its official on-disk format (for tests and benchmarks).

    cifar10: 5 training batches (train split evenly) + test_batch; cifar100: train + test; movielens:
    ratings.csv from `users` users (train + test ratings in all); shakespeare: LEAF json with `users` roles
    in train/ and test/ (train and test samples in all).
    """
    task = str(task)
    rng = np.random.default_rng(seed)
    root = data_path(task, data_dir)
    root.mkdir(parents=True, exist_ok=True)

    def cifar_batch(path: Path, count: int, classes: int, key: bytes) -> None:
        blob = {b"batch_label": b"synthetic", key: rng.integers(0, classes, count).tolist(),
                b"data": rng.integers(0, 256, (count, 3072), dtype=np.uint8),
                b"filenames": [b"img_%d.png" % i for i in range(count)]}
        if key == b"fine_labels":
            blob[b"coarse_labels"] = [x // 5 for x in blob[key]]
        with replacing(path) as f:
            pickle.dump(blob, f, protocol=2)

    if task == "cifar10":
        for i, part in enumerate(np.array_split(np.arange(train), 5), start=1):
            cifar_batch(root / f"data_batch_{i}", len(part), 10, b"labels")
        cifar_batch(root / "test_batch", test, 10, b"labels")
    elif task == "cifar100":
        cifar_batch(root / "train", train, 100, b"fine_labels")
        cifar_batch(root / "test", test, 100, b"fine_labels")
    elif task == "movielens":
        total = train + test
        user = np.sort(np.arange(total) % users) + 1
        movie = rng.choice(np.arange(1, 4 * total + 1), total)
        rating = rng.integers(1, 11, total) / 2.0
        lines = ["userId,movieId,rating,timestamp"]
        rows = zip(user, movie, rating, strict=True)
        lines += [f"{u},{m},{r:.1f},{964982703 + i}" for i, (u, m, r) in enumerate(rows)]
        write_whole(root / "ratings.csv", "\n".join(lines) + "\n")
    elif task == "shakespeare":
        letters = np.array(list(LEAF_LETTERS))
        for sub, count in (("train", train), ("test", test)):
            names = [f"ROLE_{u}" for u in range(users)]
            per_user = np.array_split(np.arange(count), users)
            blob = {"users": names, "num_samples": [len(p) for p in per_user], "user_data": {}}
            for name, part in zip(names, per_user, strict=True):
                text = "".join(rng.choice(letters, 80 + len(part)))
                blob["user_data"][name] = {"x": [text[i:i + 80] for i in range(len(part))],
                                           "y": [text[i + 80] for i in range(len(part))]}
            (root / sub).mkdir(exist_ok=True)
            write_whole(root / sub / f"all_data_niid_0_keep_0_{sub}_8.json", json.dumps(blob))
    else:
        raise ValueError(f"no synthetic data for task {task!r}")
    return root
