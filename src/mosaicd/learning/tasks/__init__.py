"""The workloads. `build_task(settings)` is the one way to get one."""

from __future__ import annotations

from importlib import import_module

from mosaicd.extras import MissingExtra, needs, require
from mosaicd.learning.data import DataMissing
from mosaicd.settings import Settings, TaskName

from .base import Task

_REGISTRY = {
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


def build_task(settings: Settings) -> Task:
    target = _REGISTRY.get(settings.task)
    if target is None:
        raise ValueError(f"--task {settings.task.value}: not available in this build")
    require_task(settings.task)
    module, cls = target.split(":")
    with needs(f"--task {settings.task.value}"):  # an import of an extra that _NEEDS missed
        return getattr(import_module(module), cls)(settings)


__all__ = ["DataMissing", "MissingExtra", "Task", "build_task", "require_task"]
