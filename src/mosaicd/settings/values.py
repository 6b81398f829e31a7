"""The values settings take: the built-in tasks, partitions, optimizers and schedules, and the parsers of the
values given as text (a task's import path, KEY=VALUE options). Imports nothing that builds them."""

from __future__ import annotations

import re
import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Any


class TaskName(StrEnum):
    QUADRATIC = "quadratic"
    DIGITS = "digits"
    TEACHER = "teacher"
    CIFAR10 = "cifar10"
    CIFAR100 = "cifar100"
    MOVIELENS = "movielens"
    SHAKESPEARE = "shakespeare"


class EventLoop(StrEnum):
    """The event loop a process runs its role on (`mosaicd.daemon.loop`): it moves the same bytes, so no model
    depends on it."""

    AUTO = "auto"  # uvloop where it is installed, asyncio's own otherwise
    UVLOOP = "uvloop"
    ASYNCIO = "asyncio"


UVLOOP_MISSING = ("uvloop is not installed here: `pip install uvloop` (on Linux mosaic-learning installs it), or "
                  "give auto (uvloop where installed) or asyncio")


def uvloop_installed() -> bool:
    """Whether uvloop can be imported, without importing it (a settings check stays cheap)."""
    from importlib.util import find_spec

    try:
        return find_spec("uvloop") is not None
    except (ImportError, ValueError):
        return False


class Partition(StrEnum):
    IID = "iid"
    DIRICHLET = "dirichlet"
    SHARDS = "shards"
    NATURAL = "natural"


OWN_LOOP = "own loop"  # the task an own training loop's run shows where its loop gives no name
TASK_ENTRY_POINTS = "mosaic_learning.tasks"  # the entry-point group a package registers its task names in
TaskOption = str | int | float | bool


def task_spec(value: str) -> str:
    """`--task` as the run carries it: a built-in's `TaskName`, a registered name, `module:Class`, or
    `/absolute/file.py:Class` (resolved here, once, so that processes started in another folder find the file).
    Imports nothing: whether the task can be built is `learning.tasks.check_task`'s question."""
    if isinstance(value, TaskName):
        return value
    text = str(value).strip()
    if text in TaskName._value2member_map_:
        return TaskName(text)
    where, colon, name = text.rpartition(":")
    if not colon:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", text) or text not in _registered_tasks():
            raise ValueError(f"expected one of {', '.join(TaskName)}, a task a package registers (entry points "
                             f"{TASK_ENTRY_POINTS!r}), MODULE:CLASS or path/to/file.py:CLASS")
        return text
    if not name.isidentifier():
        raise ValueError(f"{name!r} is not a class name (expected MODULE:CLASS or path/to/file.py:CLASS)")
    if where.endswith(".py") or "/" in where or "\\" in where:
        return f"{Path(where).expanduser().resolve()}:{name}"
    if not all(part.isidentifier() for part in where.split(".")):
        raise ValueError(f"{where!r} is neither a module name nor a .py file (expected MODULE:CLASS or "
                         "path/to/file.py:CLASS)")
    return text


def _registered_tasks() -> set[str]:
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group=TASK_ENTRY_POINTS)}


def task_options(value: Any) -> dict[str, TaskOption]:
    """`--task-option key=value` items (a list; values read as TOML: 8, 0.5, true, a bare word as text) or a
    table (TOML, MOSAIC_TASK_OPTIONS as JSON) as the keyword arguments of the task's constructor."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list | tuple):
        items: dict[str, Any] = {}
        for item in value:
            key, sep, text = str(item).partition("=")
            if not sep or not key.strip():
                raise ValueError(f"{item!r}: expected key=value (e.g. --task-option width=16)")
            try:
                items[key.strip()] = tomllib.loads(f"value = {text.strip()}")["value"]
            except tomllib.TOMLDecodeError:
                items[key.strip()] = text.strip()
        value = items
    if isinstance(value, dict):
        for key in value:
            if not str(key).isidentifier():
                raise ValueError(f"{key!r}: an option is a keyword argument of the task's constructor, a Python name")
    return value


class OptimizerState(StrEnum):
    KEEP = "keep"
    RESET = "reset"


# The built-in optimizers and the keyword arguments each takes besides lr (tests/learning/test_optim.py holds them
# to the real constructors); sgd is `torch_util.SGD`, the others torch.optim's classes.
OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "sgd": ("momentum", "dampening", "weight_decay", "nesterov"),
    "adam": ("betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "adamw": ("betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "rmsprop": ("alpha", "eps", "weight_decay", "momentum", "centered", "maximize"),
    "adagrad": ("lr_decay", "weight_decay", "initial_accumulator_value", "eps", "maximize"),
}
# The built-in schedules and their options (learning/tasks/optim.py: `Schedule`).
LR_SCHEDULES: dict[str, tuple[str, ...]] = {
    "constant": (),
    "step": ("step_size", "gamma"),
    "cosine": ("eta_min", "T_max"),
    "linear": ("start_factor", "end_factor", "total_iters"),
}


def import_path(value: str, what: str, names: Any) -> str:
    """A built-in name of `names`, MODULE:CLASS or path/to/file.py:CLASS (made absolute, as `task_spec` does; checked
    for form only: importing it is the task's business)."""
    text = str(value).strip()
    if text.lower() in names:
        return text.lower()
    module, colon, name = text.rpartition(":")
    if colon and name.isidentifier() and (module.endswith(".py") or "/" in module or "\\" in module):
        return f"{Path(module).expanduser().resolve()}:{name}"
    if not colon or not name.isidentifier() or not all(p.isidentifier() for p in module.split(".")):
        raise ValueError(f"expected one of {', '.join(names)} or a {what} class as MODULE:CLASS or "
                         "path/to/file.py:CLASS")
    return text
