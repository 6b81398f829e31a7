"""What every loader shares: the `Split` it returns, where each data set lives, and the missing-data error."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DataMissing", "Split", "check_data", "data_path", "missing"]

_DIRS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python", "movielens": "ml-latest-small",
         "shakespeare": "shakespeare"}


class DataMissing(FileNotFoundError):
    """A data set is not on disk; the message says what to fetch and where to put it."""


@dataclass(frozen=True, eq=False)
class Split:
    """A data set's training and test arrays (numpy; possibly read-only memory maps)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    clients: np.ndarray | None = None  # client id of every training sample (natural partition)
    info: dict[str, Any] = field(default_factory=dict)


def data_path(task: str, data_dir: Path | str) -> Path:
    """Where `task`'s files are expected under data_dir."""
    return Path(data_dir) / _DIRS[str(task)]


def missing(task: str, path: Path, what: str = "") -> DataMissing:
    detail = f" ({what})" if what else ""
    return DataMissing(f"task {task}: data set not found at {path}{detail}; run `mosaicd data fetch {task}` "
                       f"(with --data-dir {Path(path).parent} if not the default) or put the files there")


def check_data(task: str, data_dir: Path | str) -> None:
    """DataMissing, as the task's loader would raise it, when the files of a built-in task's data set are not in
    data_dir; nothing read (a launcher asks this once, before any process starts). Other tasks: nothing."""
    task = str(task)
    if task not in _DIRS:
        return
    root = data_path(task, data_dir)
    if task == "cifar10":
        absent = [name for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
                  if not (root / name).is_file()]
        what = "missing " + ", ".join(absent) if absent else ""
    elif task == "cifar100":
        absent = [name for name in ("train", "test") if not (root / name).is_file()]
        what = "missing " + ", ".join(absent) if absent else ""
    elif task == "movielens":
        what = "" if (root / "ratings.csv").is_file() else "no ratings.csv"
    else:
        what = next((f"no {sub}/ folder" for sub in ("train", "test") if not (root / sub).is_dir()), "")
    if what:
        raise missing(task, root, what)
