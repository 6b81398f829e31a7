"""A class of the user's named `module:Name` or `/abs/path/file.py:Name`: a task (`--task`), an optimizer
(`--optimizer`), found the one way, with the same errors (each starting with the flag and its value)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import threading
from importlib import import_module
from pathlib import Path
from typing import Any


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


_file_lock = threading.Lock()  # a node's prefetch thread and its evaluation may load the file at once


def _from_file(path: Path, given: str) -> Any:
    """The module of a user's file (a task's, an optimizer's), loaded once per process under a name of its own
    (kept in sys.modules, so that pickling and dataclasses find it); `given`: the flag and its value, for errors."""
    with _file_lock:
        return _load_file(path, given)


def _load_file(path: Path, given: str) -> Any:
    name = f"mosaic_task_{path.stem if path.stem.isidentifier() else 'file'}_" \
           f"{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    if not path.is_file():
        raise ValueError(f"{given}: no such file: {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{given}: cannot load {path} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"{given}: cannot import {path}: {type(exc).__name__}: {one_line(exc)}") from exc
    return module


def user_class(target: str, given: str) -> Any:
    """What `module:Name` or `/file.py:Name` names, imported (a file loaded by `_from_file`); a ValueError
    starting with `given` (the flag and its value) when it cannot be had. The caller checks what it is."""
    where, _, name = target.rpartition(":")
    if where.endswith(".py") or "/" in where:
        module = _from_file(Path(where), given)
    else:
        try:
            module = import_module(where)
        except Exception as exc:
            raise ValueError(f"{given}: cannot import {where!r}: {one_line(exc)}") from exc
    found = getattr(module, name, None)
    if found is None:
        raise ValueError(f"{given}: {where} has no {name!r}")
    return found
