"""The workloads. `build_task(settings)` is the one way to get one."""

from __future__ import annotations

from importlib import import_module

from ..settings import Settings, TaskName
from .base import DataMissing, Task

_REGISTRY = {
    TaskName.QUADRATIC: "mosaicd.tasks.quadratic:QuadraticTask",
    TaskName.DIGITS: "mosaicd.tasks.digits:DigitsTask",
    TaskName.CIFAR10: "mosaicd.tasks.cifar:Cifar10Task",
    TaskName.CIFAR100: "mosaicd.tasks.cifar:Cifar100Task",
    TaskName.MOVIELENS: "mosaicd.tasks.movielens:MovieLensTask",
    TaskName.SHAKESPEARE: "mosaicd.tasks.shakespeare:ShakespeareTask",
}


def build_task(settings: Settings) -> Task:
    target = _REGISTRY.get(settings.task)
    if target is None:
        raise ValueError(f"--task {settings.task.value}: not available in this build")
    module, cls = target.split(":")
    return getattr(import_module(module), cls)(settings)


__all__ = ["DataMissing", "Task", "build_task"]
