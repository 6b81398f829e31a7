"""The workloads. `build_task(settings)` is the one way to get one."""

from __future__ import annotations

from importlib import import_module

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


def build_task(settings: Settings) -> Task:
    target = _REGISTRY.get(settings.task)
    if target is None:
        raise ValueError(f"--task {settings.task.value}: not available in this build")
    module, cls = target.split(":")
    return getattr(import_module(module), cls)(settings)


__all__ = ["DataMissing", "Task", "build_task"]
