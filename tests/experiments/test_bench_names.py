"""Every bench script names only what the package has: most run by hand, in no test, so a renamed function broke
one unseen (`node_start_cpu.py` called `warmup.prefetch` for several passes after it was renamed)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
OURS = ("mosaicd", "mosaic_proto")


def missing_names(source: str) -> list[str]:
    """`module.name` for each name of ours that `source` imports or reads off one of our modules and that does not
    exist: `from mosaicd.x import y`, `import mosaicd.x as m` then `m.y`, `from mosaicd.x import m` then `m.y`."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # a local name -> the module of ours it is
    missing: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in OURS:
                    importlib.import_module(alias.name)
                    if alias.asname:
                        modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if hasattr(module, alias.name):
                    value = getattr(module, alias.name)
                    if isinstance(value, type(module)):
                        modules[alias.asname or alias.name] = value.__name__
                    continue
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    missing.append(f"{node.module}.{alias.name}")
                else:
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if not hasattr(importlib.import_module(modules[node.value.id]), node.attr):
                missing.append(f"{modules[node.value.id]}.{node.attr}")
    return missing


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_a_bench_script_names_only_what_exists(script: Path) -> None:
    assert missing_names(script.read_text()) == []


@pytest.mark.parametrize("snippet", [
    "from mosaicd.daemon.node import warmup\nwarmup.prefetch('digits')\n",
    "import mosaicd.daemon.node.warmup as w\nw.prefetch('digits')\n",
    "from mosaicd.daemon.node.warmup import prefetch\n",
    "from mosaicd.daemon.node import no_such_module\n",
])
def test_the_name_check_catches_a_name_that_is_gone(snippet: str) -> None:
    assert missing_names(snippet)


def test_the_name_check_lets_what_exists_through() -> None:
    assert missing_names("from mosaicd.daemon.node import warmup\nimport mosaicd.daemon.node.warmup as w\n"
                         "from mosaicd.learning.tasks import import_task_modules\n"
                         "warmup.set_threads(1)\nw.imports_done()\nother.anything()\n") == []
