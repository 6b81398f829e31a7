"""The workloads. `build_task(run, data_dir)` is the one way to get one."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from mosaicd.extras import MissingExtra, needs, require
from mosaicd.learning.data import DataMissing
from mosaicd.settings import RunConfig, TaskName

from .base import Task

TASK_CLASSES = {
    TaskName.QUADRATIC: "mosaicd.learning.tasks.quadratic:QuadraticTask",
    TaskName.DIGITS: "mosaicd.learning.tasks.digits:DigitsTask",
    TaskName.CIFAR10: "mosaicd.learning.tasks.cifar:Cifar10Task",
    TaskName.CIFAR100: "mosaicd.learning.tasks.cifar:Cifar100Task",
    TaskName.MOVIELENS: "mosaicd.learning.tasks.movielens:MovieLensTask",
    TaskName.SHAKESPEARE: "mosaicd.learning.tasks.shakespeare:ShakespeareTask",
}

# What a task imports beyond the core install: the `learning` extra (see mosaicd.extras); torch unless listed.
_NEEDS: dict[TaskName, tuple[str, ...]] = {TaskName.QUADRATIC: (), TaskName.DIGITS: ("torch", "sklearn")}


def require_task(task: TaskName) -> None:
    """Raise MissingExtra (a ValueError naming `pip install 'mosaic-learning[learning]'`) when `task` needs a
    module of an extra that is not installed. Imports nothing."""
    require(f"--task {task.value}", *_NEEDS.get(task, ("torch",)))


def build_task(run: RunConfig, data_dir: Path | str | None = None) -> Task:
    """The run's workload; `data_dir` is where this host keeps data sets (not part of the run; a `Settings`
    carries its own, the default for it)."""
    data_dir = data_dir if data_dir is not None else getattr(run, "data_dir", Path("data"))
    target = TASK_CLASSES.get(run.task)
    if target is None:
        raise ValueError(f"--task {run.task.value}: not available in this build")
    require_task(run.task)
    module, cls = target.split(":")
    with needs(f"--task {run.task.value}"):  # an import of an extra that _NEEDS missed
        return getattr(import_module(module), cls)(run, Path(data_dir))


__all__ = ["DataMissing", "MissingExtra", "Task", "build_task", "require_task"]
