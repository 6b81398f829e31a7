"""The workloads. `build_task(run, data_dir)` is the one way to get one.

`--task` names a built-in (`TASK_CLASSES`), a name a package registers in the entry-point group
`mosaic_learning.tasks` (its value `module:Class`), `module:Class` (importable: on PYTHONPATH or installed) or
`/abs/path/file.py:Class` (loaded from the file; `settings.task_spec` made the path absolute). Any of them is a
`Task` subclass, built as `Class(run, data_dir, **run.task_options)`.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from mosaicd.extras import MissingExtra, needs, require
from mosaicd.learning.data import DataMissing
from mosaicd.settings import LR_SCHEDULES, OPTIMIZERS, TASK_ENTRY_POINTS, RunConfig, SettingsError, TaskName

from .base import Task
from .by_path import one_line, user_class

TASK_CLASSES = {
    TaskName.QUADRATIC: "mosaicd.learning.tasks.quadratic:QuadraticTask",
    TaskName.DIGITS: "mosaicd.learning.tasks.digits:DigitsTask",
    TaskName.TEACHER: "mosaicd.learning.tasks.teacher:TeacherTask",
    TaskName.CIFAR10: "mosaicd.learning.tasks.cifar:Cifar10Task",
    TaskName.CIFAR100: "mosaicd.learning.tasks.cifar:Cifar100Task",
    TaskName.MOVIELENS: "mosaicd.learning.tasks.movielens:MovieLensTask",
    TaskName.SHAKESPEARE: "mosaicd.learning.tasks.shakespeare:ShakespeareTask",
}

# What a task imports beyond the core install: the `learning` extra (see mosaicd.extras); torch unless listed.
_NEEDS: dict[TaskName, tuple[str, ...]] = {TaskName.QUADRATIC: (), TaskName.DIGITS: ("torch", "sklearn"),
                                           TaskName.TEACHER: ("torch",)}


def require_task(task: str) -> None:
    """Raise MissingExtra (a ValueError naming `pip install 'mosaic-learning[learning]'`) when the built-in
    `task` needs a module of an extra that is not installed. Imports nothing; a task of the user's is checked by
    `check_task` instead."""
    if isinstance(task, TaskName):
        require(f"--task {task.value}", *_NEEDS.get(task, ("torch",)))


def check_requirements(task: str, data_dir: Path | str) -> None:
    """What every process of a run would find wrong, found once before any folder is made or process starts (by
    `cluster` and `simulate` alike): the task's extras and a built-in task's data set (one error line:
    MissingExtra, DataMissing)."""
    from mosaicd.learning.data import check_data

    require_task(task)
    check_data(task, data_dir)


def _target(task: str) -> str:
    """`module:Class` or `/file.py:Class` of a task that is not built in (a registered name looked up)."""
    if ":" in task:
        return task
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=TASK_ENTRY_POINTS) if ep.name == task]
    if not found:
        raise ValueError(f"--task {task}: no installed package registers it (entry points {TASK_ENTRY_POINTS!r})")
    return found[0].value


def task_class(task: str) -> type[Task]:
    """The class `--task` names, imported; a ValueError naming --task and the cause when it cannot be had."""
    if isinstance(task, TaskName):
        require_task(task)
        module, cls = TASK_CLASSES[task].split(":")
        with needs(f"--task {task.value}"):  # an import of an extra that _NEEDS missed
            return getattr(import_module(module), cls)
    target = _target(task)
    found, name = user_class(target, f"--task {task}"), target.rpartition(":")[2]
    if not (isinstance(found, type) and issubclass(found, Task)):
        raise ValueError(f"--task {task}: {name} is not a subclass of mosaicd.Task (it is {found!r})")
    return found


def import_task_modules(task: str) -> None:
    """Import what `task` needs (torch, its model's module; a user's task: its module) if it can, ahead of its
    build (a node while it registers, a barrier while the nodes do); errors are the build's to report."""
    try:
        require_task(task)
        if task in TASK_CLASSES:
            import_module(TASK_CLASSES[task].split(":")[0])
        else:
            task_class(task)
    except (ImportError, MissingExtra, KeyError, ValueError):
        pass


def build_task(run: RunConfig, data_dir: Path | str | None = None) -> Task:
    """The run's workload; `data_dir` is where this host keeps data sets (not part of the run; a `Settings`
    carries its own, the default for it)."""
    data_dir = data_dir if data_dir is not None else getattr(run, "data_dir", Path("data"))
    if run.own_loop:
        raise ValueError(f"--task {run.task}: the run is an own training loop's (--own-loop): its nodes are "
                         "mosaicd.Peer in your program, with no task to build (docs/own-model.md)")
    if not isinstance(run.task, TaskName) and run.task not in TASK_CLASSES:
        return task_class(run.task)(run, Path(data_dir), **run.task_options)
    target = TASK_CLASSES.get(run.task)
    if target is None:
        raise ValueError(f"--task {run.task}: not available in this build")
    require_task(run.task)
    module, cls = target.split(":")
    with needs(f"--task {run.task}"):  # an import of an extra that _NEEDS missed
        return getattr(import_module(module), cls)(run, Path(data_dir))


def check_task(run: RunConfig, data_dir: Path | str | None = None) -> Task | None:
    """A task of the user's, imported, built once and asked for its layout and node 0's initial model, so that
    one that cannot run is a SettingsError naming --task before any process starts or folder is written; the
    task built. Built-in tasks: None, nothing done (their extras and data are checked where they always were).
    The optimizer, where given options or by import path or file, is built once on a dummy parameter, and a schedule
    class by import path asked for its factors, for any task (`optim.check_training`)."""
    if run.optimizer not in OPTIMIZERS or run.optimizer_options or run.lr_schedule not in LR_SCHEDULES:
        from .optim import check_training

        check_training(run)
    if isinstance(run.task, TaskName) or run.own_loop:
        return None
    try:
        cls = task_class(run.task)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    options = ", ".join(f"{k}={v!r}" for k, v in run.task_options.items())
    step = f"{cls.__name__}(run, data_dir{', ' + options if options else ''})"
    try:
        task = cls(run, Path(data_dir if data_dir is not None else getattr(run, "data_dir", "data")),
                   **run.task_options)
        step = "its layout"
        dim = task.layout.dim
        step = "initial(0)"
        vector = task.initial(0)
    except Exception as exc:
        raise SettingsError(f"--task {run.task}: {step} failed: {type(exc).__name__}: {one_line(exc)}") from None
    shape, dtype = getattr(vector, "shape", None), getattr(vector, "dtype", None)
    if shape != (dim,) or str(dtype) != "float32":
        raise SettingsError(f"--task {run.task}: initial(0) gave {type(vector).__name__} of shape {shape} and "
                            f"dtype {dtype}; a float32 vector of the layout's {dim} values is needed")
    return task


__all__ = ["DataMissing", "MissingExtra", "Task", "build_task", "check_requirements", "check_task", "require_task",
           "task_class"]
